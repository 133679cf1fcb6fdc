"""The backend contract and the registry of backends.

One :class:`BackendDetails` subclass is one backend, both halves: ``preprocess`` compiles a
sub-program ahead of time into bytes; ``init``/``execute``/``destroy`` run those bytes. The
compile hooks form one ladder: ``preprocess_multimethod`` sees every partition of every method;
its default compiles each partition's ``preprocess`` as a unit (``compile_units.py``: perhaps on
workers, perhaps from the compile cache), then hands all results to ``link_results``.
Every concrete subclass registers itself under its ``backend_id`` when it is defined;
installed packages add backends through the entry-point group ``torchdelegate.backends``
(name = backend id, value = ``module:Class``), so a program loads without importing its
backends by hand.

This is the documented home of the names backend authors import: what ``preprocess`` returns
(:class:`PreprocessResult`, :func:`with_named_data`, :func:`shared_named_data`) lives in
``preprocess_result.py`` and is re-exported here.
"""

from __future__ import annotations

import inspect
import warnings
from abc import ABC, abstractmethod
from collections.abc import Mapping
from importlib import metadata
from typing import Any, ClassVar

import torch
from torch.export import ExportedProgram

from torchdelegate.delegate.compile_units import compile_partitions, current_partition
from torchdelegate.delegate.named_data import NamedDataMap, NamedDataStore
from torchdelegate.delegate.preprocess_checks import checked_result
from torchdelegate.delegate.preprocess_result import PreprocessResult as PreprocessResult
from torchdelegate.delegate.preprocess_result import shared_named_data as shared_named_data
from torchdelegate.delegate.preprocess_result import with_named_data as with_named_data
from torchdelegate.delegate.specs import CompileSpec
from torchdelegate.errors import (
    BackendNotFoundError,
    BackendRegistrationError,
    DelegateExecutionError,
    PreprocessError,
)

ENTRY_POINT_GROUP = "torchdelegate.backends"

_REGISTRY: dict[str, type[BackendDetails]] = {}
_COMPILE_HOOKS = ("preprocess", "preprocess_multimethod", "link_results", "preprocess_partition", "compile_partition")


def _qualified_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


class BackendDetails(ABC):
    """A backend: ahead-of-time ``preprocess`` and the run-time ``init``/``execute``/``destroy``.

    ``backend_id`` defaults to the class name; a subclass of a backend is a new backend with
    its own id. ``execute`` receives the sub-program's user inputs in order (tensors, or
    ints for symbolic sizes) and returns its user outputs in order; buffers that the
    sub-program mutates are the backend's own state to keep between calls.
    """

    backend_id: ClassVar[str]
    thread_safe_execute: ClassVar[bool] = False
    """Whether ``execute`` may run on one handle from several threads at once; when False
    (the default) the runtime serializes the calls of each delegate."""
    runs_native_code: ClassVar[bool] = False
    """Whether ``init`` makes the process execute code the blob carries (a shared library, say).
    A file's delegates of such a backend are loaded only when the caller trusts it
    (``load(path, trusted_backends=[...])``); a backend that declares False must treat its
    blob as untrusted input and check everything it hands to its runtime."""
    array_runtime: ClassVar[str | None] = None
    """``"module:Class"`` of this backend's run-time half on numpy arrays, an
    :class:`~torchdelegate.ArrayRuntime` in a module that imports no torch; None
    (the default): running its blobs needs torch. Declare it also in the entry-point group
    ``torchdelegate.array_runtimes`` (name: the backend id), so a process without torch finds it."""
    load_options: ClassVar[dict[str, str]] = {}
    """The compile specs that depend on the machine that runs a file rather than the one that lowered
    it (a thread count), each with what it means: ``load(path, backend_options={id: {key: value}})``
    sets them for this process, and ``init`` sees each as the compile spec of that key, its value
    ``str(value).encode()``, in place of the file's. Any other key is refused at load."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "backend_id" not in cls.__dict__:
            cls.backend_id = cls.__name__
        if not isinstance(cls.backend_id, str) or not cls.backend_id:
            raise BackendRegistrationError(
                f"{_qualified_name(cls)}.backend_id must be a non-empty str, got {cls.backend_id!r}"
            )
        if "compile_cache_version" not in cls.__dict__ and any(hook in cls.__dict__ for hook in _COMPILE_HOOKS):
            cls.compile_cache_version = None  # it compiles its own way: its parent's cache entries are not its own
        if "preprocess_partition" in cls.__dict__:
            cls._calls_preprocess_partition = True
            warnings.warn(
                f"{cls.__qualname__}.preprocess_partition is deprecated (it goes in the next release): implement "
                "preprocess; current_partition() names the partition it compiles",
                DeprecationWarning,
                stacklevel=2,
            )
        if not inspect.isabstract(cls):
            register_backend(cls)

    @staticmethod
    @abstractmethod
    def preprocess(edge_program: ExportedProgram, compile_specs: list[CompileSpec]) -> PreprocessResult:
        """Compile one sub-program into a blob."""

    _calls_preprocess_partition: ClassVar[bool] = False  # a subclass overrides the deprecated hook

    @classmethod
    def preprocess_partition(
        cls, edge_program: ExportedProgram, compile_specs: list[CompileSpec], where: str = "sub-program"
    ) -> PreprocessResult:
        """Deprecated (it goes in the next release): implement :meth:`preprocess`;
        :func:`~torchdelegate.current_partition` names the partition. An override is still called in its
        place, and this default, which such an override may call through ``super()``, is ``preprocess``."""
        del where
        return cls.preprocess(edge_program, compile_specs)

    @classmethod
    def preprocess_multimethod(
        cls,
        edge_programs: dict[str, list[ExportedProgram]],
        compile_specs: dict[str, list[list[CompileSpec]]],
    ) -> dict[str, list[PreprocessResult]]:
        """Compile every partition of every method at once.

        The default compiles each partition on its own with :meth:`preprocess`, as a compile unit
        that lowering may run on worker processes or a cluster and answer from its compile cache,
        then hands all results to :meth:`link_results`. A backend that overrides this method and
        calls ``super()`` keeps all of that; one that does not is called once, in the lowering
        process, and compiles as it likes.
        """
        compiled = compile_partitions(cls, edge_programs, compile_specs)
        results = [checked_result(result, cls.backend_id, method) for method, result in compiled]
        flat_specs = [list(specs) for method in edge_programs for specs in compile_specs[method]]
        try:
            linked = cls.link_results(results, flat_specs)
        except Exception as e:
            raise PreprocessError(
                f"backend {cls.backend_id!r} failed to link its {len(results)} partition(s): {type(e).__name__}: {e}"
            ) from e
        if not isinstance(linked, (list, tuple)) or len(linked) != len(results):
            got = f"{len(linked)} result(s)" if isinstance(linked, (list, tuple)) else type(linked).__name__
            raise PreprocessError(
                f"backend {cls.backend_id!r}: link_results returned {got}; expected a list "
                f"of {len(results)} PreprocessResult, one per partition in the order given"
            )
        joined = iter(linked)
        return {method: [next(joined) for _ in programs] for method, programs in edge_programs.items()}

    @classmethod
    def profile(cls, handle: Any) -> Mapping[Any, float] | None:
        """Seconds the blob spent on each unit its ``debug_handle_map`` names (an ONNX node...), over the
        calls so far, as the backend's own profiler measured them; None (the default) if it records none
        (a backend usually records only when a load option asks it to). May end the recording."""
        del handle
        return None

    @classmethod
    def link_results(
        cls, results: list[PreprocessResult], compile_specs: list[list[CompileSpec]]
    ) -> list[PreprocessResult]:
        """Every partition's result of one lowering (all methods, in order), once all are compiled:
        a backend may join them here (the default keeps them; :func:`~torchdelegate.shared_named_data` puts their
        named data in one store). Runs in the lowering process."""
        del compile_specs
        return results

    compile_cache_version: ClassVar[str | None] = None
    """Names the backend's compiler: change it whenever :meth:`preprocess` may return other
    bytes for the same input. None (the default): results are never taken from the compile cache.
    A subclass that overrides a compile hook (``preprocess``, ``preprocess_multimethod``,
    ``link_results``) does not inherit its parent's version: it sets its own, or is not cached."""
    weights_by_reference: ClassVar[bool] = False
    """True when a state tensor whose exact bytes a result stores as named data reaches nothing
    else in that result (no folded constant, no size or value chosen from it): the compile cache
    then answers a partition of other weights with the same compiled blob, its named data
    keys replaced. False: the cache key covers every weight's bytes."""

    @classmethod
    def compile_cache_identity(cls) -> dict[str, str] | None:
        """What a compiled result depends on besides the sub-program and compile specs (the
        backend's and its runtime's versions), as strings; None: never cached. Asked only of a backend
        that declares a ``compile_cache_version`` (one without is never cached)."""
        return {"compiler": str(cls.compile_cache_version)}

    @classmethod
    def named_data_keys(cls, processed: memoryview, compile_specs: list[CompileSpec]) -> list[str] | None:
        """The named data keys a blob reads at ``init``, or None when the backend cannot tell (the default).

        Saving checks that a program holds every key its delegates' blobs name, so a file
        never lacks data its delegates need.
        """
        return None

    @classmethod
    def check_blob(cls, processed: memoryview, compile_specs: list[CompileSpec], named_data: NamedDataMap) -> None:
        """Raise a ``FormatError`` if ``init`` would refuse this blob, without building what ``init``
        builds: the checks a blob made elsewhere passes before a lowering uses it (an entry of a
        shared compile cache is written by whoever can write there). The default checks nothing; a
        backend whose blobs are untrusted input at load should check here what it checks there.

        It runs under the trust its caller gives native code (``delegate.trust.current_trust()``): a
        backend whose ``init`` would load code (``runs_native_code``) or make delegates of other
        backends (nested in its blob) raises ``UntrustedCodeError`` here for what that trust does not
        name, as loading would (``trust.check_trusted``).
        """
        del processed, compile_specs, named_data

    needs: ClassVar[str] = "what it needs is not installed"
    """What this machine lacks when ``is_available()`` is False, and how to get it (shown in errors)."""

    @classmethod
    def partitioner(cls, compile_specs: list[CompileSpec] | None = None) -> Any:
        """The partitioner this backend proposes (a ``Partitioner``), delegating to it with
        ``compile_specs``: what ``torchdelegate lower --backend ID`` and ``backend_supports([...])`` use.
        A ``CapabilityPartitioner`` can be joined with other backends' in priority order. The default
        proposes none."""
        raise ValueError(
            f"backend {cls.backend_id!r} proposes no partitioner (it does not override "
            "BackendDetails.partitioner); lower with it from Python: "
            f"CapabilityPartitioner(support, DelegationSpec({cls.backend_id!r}))"
        )

    @classmethod
    def warm_up(cls) -> None:
        """Build, once in a process, what this backend's first compile would otherwise pay for (its
        compiler's imports and caches). A compile worker runs it for every installed backend as it
        starts, while the lowering partitions; the default does nothing."""
        return None

    @classmethod
    def is_available(cls) -> bool:
        """Whether this backend's runtime can run here."""
        return True

    @classmethod
    def init(cls, processed: memoryview, compile_specs: list[CompileSpec], named_data: NamedDataMap) -> Any:
        """Prepare a blob for execution; the handle returned is passed to ``execute``."""
        raise DelegateExecutionError(
            f"backend {cls.backend_id!r} has no Python runtime: it does not implement init(); "
            "run the program with a runtime that has this backend, or implement init/execute"
        )

    @classmethod
    def prepare(cls, processed: memoryview, compile_specs: list[CompileSpec], named_data: NamedDataMap) -> str | None:
        """Do once on this machine the work ``init`` would otherwise repeat at every load, and keep its
        result in the machine cache (``TORCHDELEGATE_CACHE``), where ``init`` looks first.

        For work that depends on the machine (weights packed for this CPU's kernels), which lowering
        cannot do for every machine a file runs on. Returns one line saying what is stored, or None
        when the backend has nothing to prepare (the default).
        """
        return None

    @classmethod
    def accept_donated_inputs(cls, handle: Any, donated: dict[int, int]) -> None:
        """Inputs whose memory the backend may write its outputs into, as ``{input: output}`` positions.

        The runtime donates an input when it is a buffer that the method replaces with that output
        after every call and that nothing else reads (a static KV cache): writing the output into
        the input's memory and returning the input tensor itself as that output saves making it and
        copying it back. Called once, after ``init``; the backend may take any of them, or none (the
        default). Only the tensor passed as that input may be written, and only with that output.
        """
        del handle, donated

    @classmethod
    def execute(cls, handle: Any, inputs: list[Any]) -> list[torch.Tensor]:
        """Run one call of a delegate."""
        raise DelegateExecutionError(
            f"backend {cls.backend_id!r} does not implement execute(); implement it to run delegates"
        )

    @classmethod
    def destroy(cls, handle: Any) -> None:
        """Release a handle returned by ``init``; the default keeps nothing to release."""
        del handle


class SharedDataBackend(BackendDetails):
    """Deprecated (it goes in the next release): subclass :class:`BackendDetails`, implement
    ``preprocess`` returning the blob with its named data, and ``link_results`` as
    ``shared_named_data(results)``.

    Kept for backends written against it: ``compile_partition`` makes each partition's blob, its
    weights put in a store of its own, and ``link_partitions`` sees every blob over one store.
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        warnings.warn(
            f"{cls.__qualname__}: SharedDataBackend is deprecated (it goes in the next release); subclass "
            "BackendDetails, implement preprocess (its PreprocessResult carries the named data) and "
            "link_results as shared_named_data(results)",
            DeprecationWarning,
            stacklevel=2,
        )
        super().__init_subclass__(**kwargs)

    @classmethod
    @abstractmethod
    def compile_partition(
        cls, program: ExportedProgram, compile_specs: list[CompileSpec], store: NamedDataStore, where: str
    ) -> bytes:
        """The blob of one partition; its weights go to ``store`` (``where`` names it in errors)."""

    @classmethod
    def link_partitions(
        cls, blobs: list[bytes], compile_specs: list[list[CompileSpec]], store: NamedDataStore
    ) -> list[bytes]:
        """The blobs of every partition of one lowering over their one store (the default keeps them)."""
        del compile_specs, store
        return blobs

    @classmethod
    def preprocess(cls, edge_program: ExportedProgram, compile_specs: list[CompileSpec]) -> PreprocessResult:  # type: ignore[override]
        return with_named_data(
            lambda store: cls.compile_partition(edge_program, compile_specs, store, current_partition())
        )

    @classmethod
    def link_results(
        cls, results: list[PreprocessResult], compile_specs: list[list[CompileSpec]]
    ) -> list[PreprocessResult]:
        return shared_named_data(results, lambda blobs, store: cls.link_partitions(blobs, compile_specs, store))


def register_backend(cls: type[BackendDetails]) -> None:
    """Register ``cls`` under its ``backend_id``; a different class with that id is an error."""
    backend_id = cls.backend_id
    current = _REGISTRY.get(backend_id)
    if current is not None and current is not cls and _qualified_name(current) != _qualified_name(cls):
        raise BackendRegistrationError(
            f"backend id {backend_id!r} is claimed by both {_qualified_name(current)} and "
            f"{_qualified_name(cls)}; set a distinct backend_id on one of them"
        )
    _REGISTRY[backend_id] = cls


def _entry_points() -> dict[str, metadata.EntryPoint]:
    return {ep.name: ep for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)}


def registered_backend_ids() -> list[str]:
    """Every backend id known: registered classes and installed entry points, sorted."""
    return sorted(set(_REGISTRY) | set(_entry_points()))


def get_backend(backend_id: str) -> type[BackendDetails]:
    """The backend class for ``backend_id``, importing it through its entry point if needed."""
    cls = _REGISTRY.get(backend_id)
    if cls is not None:
        return cls
    entry_point = _entry_points().get(backend_id)
    if entry_point is not None:
        loaded = entry_point.load()
        if not (isinstance(loaded, type) and issubclass(loaded, BackendDetails)):
            raise BackendNotFoundError(
                f"entry point {backend_id!r} in group {ENTRY_POINT_GROUP!r} points to "
                f"{entry_point.value}, which is not a BackendDetails subclass"
            )
        if loaded.backend_id != backend_id:
            raise BackendNotFoundError(
                f"entry point {backend_id!r} loads {_qualified_name(loaded)}, whose backend_id is "
                f"{loaded.backend_id!r}; make the entry point's name equal the backend_id"
            )
        register_backend(loaded)
        return loaded
    known = ", ".join(repr(i) for i in registered_backend_ids()) or "none"
    raise BackendNotFoundError(
        f"no backend with id {backend_id!r}; registered backends: {known}. Import the module "
        f"that defines it, or install a package that declares it in the entry-point group "
        f"{ENTRY_POINT_GROUP!r}"
    )
