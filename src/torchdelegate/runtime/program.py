"""``load`` and :class:`Program`: a saved program, mapped and ready to run.

Loading maps the file, checks its structure (docs/FORMAT.md), resolves each delegate's
backend, and reads every method's graph; it reads no weights. A delegate's ``init`` runs
on its first call, once per Program. Methods share their buffers by name, as in eager: the
KV cache that ``prefill`` fills is the one ``decode`` reads.

Threads: a method that reads or writes a mutable buffer runs under the program's state
lock, so calls of stateful methods are serialized and each sees the state the previous one
left. Methods without mutable state run concurrently; a backend's ``execute`` is serialized
per delegate unless the backend declares ``thread_safe_execute``. ``close()`` waits for the
calls in progress, then destroys every delegate handle exactly once; later calls raise
:class:`~torchdelegate.errors.ProgramClosedError`. A call's path (the gate, the state lock) is
``bound_method.py``; named data over the file, ``file_named_data.py``; a delegate on its backend,
``file_delegates.py``.
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any

from torchdelegate.cache.machine_cache import remember_checked, required_cache_directory
from torchdelegate.delegate.trust import trusted_backends as trusted_backends_of
from torchdelegate.errors import FormatError, ProgramClosedError, TorchRequiredError
from torchdelegate.runtime.array_method import ArrayMethod
from torchdelegate.runtime.backend_options import BackendOptions, checked_backend_options
from torchdelegate.runtime.bound_method import BoundMethod, CallGate
from torchdelegate.runtime.engine import ENGINES, array_plans, require_torch
from torchdelegate.runtime.file_delegates import file_delegate
from torchdelegate.runtime.file_named_data import FileNamedDataMap
from torchdelegate.serialize.arrays import array_from_bytes, numpy_dtype, zeros_array
from torchdelegate.serialize.call_plan import CallPlan
from torchdelegate.serialize.manifest import DelegateRecord
from torchdelegate.serialize.reader import ProgramFile
from torchdelegate.serialize.tree_specs import output_type_name

if TYPE_CHECKING:
    from torchdelegate.runtime.method import Method


class Program:
    """A loaded program: run its methods with :meth:`run` or :meth:`method`, then :meth:`close`."""

    def __init__(
        self,
        file: ProgramFile,
        trust: frozenset[str] = frozenset(),
        backend_options: BackendOptions | None = None,
        plans: dict[str, CallPlan] | None = None,
    ) -> None:
        """``plans``: each method's call plan, to run on array runtimes without torch; None: on torch."""
        self._file = file
        self._plans = plans
        self._trust = trust
        self._backend_options = backend_options or {}
        self._gate = CallGate(str(file.path))
        self._state_lock = threading.Lock()
        self._verify_lock = threading.Lock()
        self.named_data = FileNamedDataMap(file)
        self._state = self._load_state()
        self._mutable = frozenset(r.name for r in file.state if r.mutable)
        arrays = plans is not None
        self._delegates = [
            file_delegate(file, record, self.named_data, trust, self._backend_options, arrays=arrays)
            for record in file.delegates
        ]
        self._methods: dict[str, Method | ArrayMethod] = {}
        self._bound: dict[str, BoundMethod] = {}
        self._unverified: dict[str, list[tuple[str, str]]] = {}  # method: (name, digest) of its read-only state
        self._output_types: dict[str, str | None] = {}
        self._plain_types: dict[str, str] = {}
        self._source: Any = None
        if plans is not None:
            for record in file.methods:
                self._output_types[record.name] = output_type_name(record.graph)
                method = self._checked(
                    record.name, lambda r=record: self._array_method(r.name, plans[r.name], r.delegates)
                )
                self._methods[record.name] = method
                self._bound[record.name] = self._bound_method(method)
            self._keep_shared_inputs()
            return
        from torchdelegate.exported.generated_source import GeneratedSource

        self._source = GeneratedSource()
        try:
            with self._source.recording():
                for record in file.methods:
                    self._methods[record.name] = method = self._method(record.name, record.graph, record.delegates)
                    self._bound[record.name] = self._bound_method(method)
        except BaseException:
            self._source.forget()
            raise
        self._keep_shared_inputs()

    def _bound_method(self, method: Method | ArrayMethod) -> BoundMethod:
        output_type = self._output_types[method.name]
        return BoundMethod(method, self._gate, output_type, self._state_lock, self._verify_state)

    def _keep_shared_inputs(self) -> None:
        """A delegate that several methods list takes no input's memory: one method's donated buffer may
        be another's user input or weight (a crafted file's), which the backend must not write."""
        listed = Counter(i for record in self._file.methods for i in record.delegates)
        for index, count in sorted(listed.items()):
            if count > 1:
                self._delegates[index].donate({})

    @property
    def engine(self) -> str:
        """What runs the methods: ``"arrays"`` (the delegates' array runtimes, numpy, no torch) or ``"torch"``."""
        return "torch" if self._plans is None else "arrays"

    @property
    def path(self) -> str:
        return str(self._file.path)

    @property
    def method_names(self) -> list[str]:
        return list(self._methods)

    @property
    def file(self) -> ProgramFile:
        """The checked manifest: methods, delegates, state and named data records (for inspection)."""
        return self._file

    @property
    def report(self) -> dict[str, Any] | None:
        """The partition report lowering saved in the file (``LoweringReport.from_json`` reads it), if any:
        read from its segment when asked, never by loading or running."""
        if self._gate.closed:
            raise ProgramClosedError(f"cannot read the report: the program {self.path} is closed; load it again")
        return self._file.report()

    @property
    def asset_names(self) -> list[str]:
        """The names of the files the program carries for its users (``save(..., assets=...)``), sorted."""
        return sorted(self._file.assets)

    def asset(self, name: str) -> bytes:
        """The bytes of asset ``name``, its checksum checked (a ``FormatError`` if it does not match)."""
        digest = self._file.assets.get(name) if isinstance(name, str) else None
        if digest is None:
            raise KeyError(f"no asset {name!r} in {self.path}; its assets are {self.asset_names}")
        if self._gate.closed:
            raise ProgramClosedError(f"cannot read asset {name!r}: the program {self.path} is closed; load it again")
        return bytes(self._file.data(digest, f"asset {name!r}"))

    @property
    def plain_types(self) -> dict[str, str]:
        """Container types the file names that this process has not registered, each with the plain
        type (``"dict"`` or ``"tuple"``) its values are passed and returned as (docs/FORMAT.md §3).

        Import the module that registers a type before ``load`` to get that type instead.
        """
        return dict(sorted(self._plain_types.items()))

    @property
    def delegates(self) -> list[DelegateRecord]:
        """The delegate table: backend ids, blobs and compile specs, in file order."""
        return list(self._file.delegates)

    def profile(self) -> dict[int, dict[Any, float]]:
        """``delegate index -> {identifier: seconds}``: what each delegate's backend measured of the calls so
        far, per unit of its blob that its ``debug_handle_map`` names, for the delegates that ran and whose
        backend recorded a profile (ONNX Runtime's: ``load(path, backend_options={"onnxruntime": {"profile":
        1}})``). Reading a backend's profile may end its recording. ``torchdelegate.report.attributed_profile``
        names the graph nodes behind each unit."""
        profiles = {}
        for index, delegate in enumerate(self._delegates):
            seconds = delegate.profile()
            if seconds is not None:
                profiles[index] = seconds
        return profiles

    def method(self, name: str) -> BoundMethod:
        """The method ``name`` as a callable: ``program.method("decode")(token, position)`` is
        ``program.run("decode", token, position)``, its lookup done once for many calls."""
        if not isinstance(name, str):
            raise TypeError(
                f"the method's name comes first: run(METHOD, *inputs), METHOD one of {self.method_names}; "
                f"got a {type(name).__name__}"
            )
        try:
            return self._bound[name]
        except KeyError:
            raise KeyError(f"no method {name!r} in {self.path}; the methods are {self.method_names}") from None

    def run(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Run ``method`` with the exported module's calling convention; outputs in its structure."""
        return self.method(method)(*args, **kwargs)

    def verify(self) -> None:
        """Check every segment's checksum now, instead of on first use."""
        self._file.container.verify_all()
        if self._file.external is not None:
            self._file.external.verify_all()

    def initialize(self) -> None:
        """Initialize every delegate now (each backend's ``init``: ONNX Runtime makes its sessions and
        packs the weights) instead of at its first call, so that a first call costs what later ones do.
        Idempotent; a delegate that fails raises as its first call would have."""
        self._gate.enter("initialize")
        try:
            for delegate in self._delegates:
                delegate.ensure_initialized()
        finally:
            self._gate.leave()

    def prepare(self) -> list[str]:
        """Do now, and keep for later loads on this machine, the machine-specific work each delegate's
        backend would otherwise repeat at every load (ONNX Runtime packs the weights for this CPU).

        Later loads find it in the machine cache (``TORCHDELEGATE_CACHE``) and start
        faster. Returns a line per entry, in delegate order; none when no backend has anything to
        prepare. The file is not changed.
        """
        required_cache_directory()  # before any delegate's work
        self._gate.enter("prepare")
        try:
            lines: list[str] = []
            for delegate in self._delegates:
                line = delegate.prepare()
                if line is not None and line not in lines:
                    lines.append(line)
            if lines:  # what was prepared stands in for bytes later loads need not read: check them all once
                started = time.time_ns()
                self.verify()
                remember_checked(self._file.identity(), started)
            return lines
        finally:
            self._gate.leave()

    def close(self) -> None:
        """Wait for calls in progress, then destroy every delegate handle (once). Idempotent."""
        if not self._gate.close():
            return
        for delegate in self._delegates:
            delegate.release()
        if self._source is not None:
            self._source.forget()
        self._file.close()

    def __enter__(self) -> Program:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._gate.closed else f"{len(self._delegates)} delegates"
        return f"Program({self.path!r}, methods={self.method_names}, {state})"

    def _load_state(self) -> dict[str, Any]:
        """The state by name: tensors on torch, arrays on array runtimes; read-only views of the file,
        but for mutable state, which is the program's own copy (written by its methods)."""
        if self._plans is None:
            from torchdelegate.serialize.tensors import tensor_from_bytes as from_bytes
            from torchdelegate.serialize.tensors import zeros
        else:
            from_bytes, zeros = array_from_bytes, zeros_array  # type: ignore[assignment]
        state: dict[str, Any] = {}
        for record in self._file.state:
            where = f"{self._file.path}: state {record.name!r}"
            if record.data is None:
                state[record.name] = zeros(record.dtype, record.shape, where)
            elif record.mutable:
                data = self._file.data(record.data, f"state {record.name!r}")
                value = from_bytes(data, record.dtype, record.shape, where)
                state[record.name] = value.copy() if self._plans is not None else value.clone()  # type: ignore[attr-defined]
            else:
                data = self._file.data(record.data, f"state {record.name!r}", verify=False)  # on first call
                state[record.name] = from_bytes(data, record.dtype, record.shape, where)
        return state

    def _verify_state(self, method: Method | ArrayMethod) -> None:
        """Check the checksums of the state ``method`` reads, before its first call runs.

        Until every one has passed, each call checks again: a corrupt weight never runs.
        """
        if method.name not in self._unverified:
            return
        with self._verify_lock:
            pending = self._unverified.get(method.name)
            if pending is None:
                return
            for fqn, digest in pending:
                self._file.data(digest, f"state {fqn!r} of method {method.name!r}")
            del self._unverified[method.name]

    def _array_method(self, name: str, plan: CallPlan, indices: list[int]) -> ArrayMethod:
        digests = {r.name: r.data for r in self._file.state}
        for spec in plan.inputs:
            if spec.target is None or spec.kind == "user_input":
                continue
            state = self._state.get(spec.target)
            if state is None:
                raise FormatError(f"method {name!r} reads state {spec.target!r}, which the file does not hold")
            expected = None if spec.dtype is None else numpy_dtype(spec.dtype, f"method {name!r}")
            static = all(isinstance(size, int) for size in spec.sizes)
            if expected is not None and (state.dtype != expected or (static and state.shape != spec.sizes)):
                raise FormatError(
                    f"method {name!r}: state {spec.target!r} is stored as {state.dtype} {state.shape}, "
                    f"the graph reads {expected} {spec.sizes}"
                )
        reads = {s.target for s in plan.inputs if s.target is not None}
        self._unverified[name] = [
            (fqn, digest) for fqn in sorted(reads - self._mutable) if (digest := digests[fqn]) is not None
        ]
        return ArrayMethod(name, plan, self._state, {i: self._delegates[i] for i in indices}, self._mutable)

    def _checked(self, name: str, make: Any) -> Any:
        """``make()``, a method, checked to write only mutable state; its problems as ``FormatError``s."""
        try:
            method = make()
            unmarked = sorted(method.writes - self._mutable)
            if unmarked:  # the program's copy would be the file's shared, read-only bytes
                raise FormatError(f"method {name!r} writes {', '.join(map(repr, unmarked))}, not marked mutable")
            return method
        except FormatError as e:
            raise FormatError(f"{self._file.path}: {e}") from e
        except Exception as e:  # anything else a malformed graph trips over
            where = f"{self._file.path}: method {name!r}"
            raise FormatError(f"{where}: the graph cannot be prepared to run ({type(e).__name__}: {e})") from e

    def _method(self, name: str, graph: dict[str, Any], indices: list[int]) -> Method:
        from torchdelegate.runtime.method import Method
        from torchdelegate.serialize.residual_graph import residual_graph

        where = f"{self._file.path}: method {name!r}"
        program = residual_graph(graph, self._state, where, self._plain_types)
        self._output_types[name] = output_type_name(graph)
        digests = {r.name: r.data for r in self._file.state}
        reads = {s.target for s in program.inputs if s.target is not None}
        self._unverified[name] = [
            (fqn, digest)
            for fqn in sorted(reads - self._mutable)
            if (digest := digests[fqn]) is not None  # type: ignore[operator]
        ]
        delegates = {i: self._delegates[i] for i in indices}
        kinds = {i: self._file.delegates[i].input_kinds for i in indices}
        return self._checked(name, lambda: Method(name, program, self._state, delegates, kinds, self._mutable))  # type: ignore[no-any-return]


def load(
    path: str | os.PathLike[str],
    *,
    external_data_path: str | os.PathLike[str] | None = None,
    trusted_backends: Iterable[str] | None = None,
    backend_options: Mapping[str, Mapping[str, Any]] | None = None,
    engine: str | None = None,
) -> Program:
    """Map a program file and get it ready to run; see :class:`Program`.

    ``engine``: what runs the methods. By default, the delegates' array runtimes on numpy arrays, without
    importing torch, when every graph only calls delegates and every backend has one (ONNX Runtime's does);
    else torch. ``"arrays"`` requires the former (a ``TorchRequiredError`` naming what needs torch),
    ``"torch"`` runs on torch whatever the file. Either takes numpy arrays and torch tensors.

    ``trusted_backends``: ids of backends whose native code this file may run (with those in
    ``TORCHDELEGATE_TRUSTED_BACKENDS``); a delegate of any other backend that declares
    ``runs_native_code`` is an ``UntrustedCodeError`` here, before its blob is read.
    ``backend_options``: ``{backend_id: {key: value}}``, what depends on this machine (a thread
    count), among the keys each backend declares in ``load_options`` (``runtime/backend_options.py``).
    """
    if engine not in ENGINES:
        raise ValueError(f"engine {engine!r}: give None (the file decides), 'arrays' or 'torch'")
    trust = trusted_backends_of(trusted_backends)
    file = ProgramFile(path, external_data_path)
    try:
        options = checked_backend_options(backend_options, [d.backend_id for d in file.delegates], str(file.path))
        plans, reasons = array_plans(file) if engine != "torch" else (None, ["torch was asked for"])
        if plans is None:
            if engine == "arrays":
                raise TorchRequiredError(f"{file.path} cannot run without torch: {'; '.join(reasons)}")
            require_torch(reasons, str(file.path))
        return Program(file, trust, options, plans)
    except BaseException:
        file.close()
        raise
