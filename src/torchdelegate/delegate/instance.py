"""A blob bound to its backend at run time: ``init`` once, ``execute`` per call, ``destroy`` once.

Both the in-memory delegate (:class:`~torchdelegate.delegate.lowered_module.LoweredBackendModule`) and
a loaded :class:`~torchdelegate.runtime.Program` run their delegates through this class, so
the contract a backend sees is the same in both places: ``init`` is called once, lazily and
under a lock; ``execute`` gets the sub-program's user inputs and must return exactly its
user outputs; ``destroy`` is called exactly once, by :meth:`release` or when the instance is
collected. A backend that does not declare ``thread_safe_execute`` has its calls serialized.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from torchdelegate.delegate.named_data import NamedDataMap
from torchdelegate.delegate.specs import CompileSpec
from torchdelegate.delegate.trust import INHERITED, Inherited, Trust, check_trusted, current_trust, trusting
from torchdelegate.errors import DelegateExecutionError, FormatError, OperatorNotFoundError, UntrustedCodeError

if TYPE_CHECKING:
    from torchdelegate.delegate.backend_details import BackendDetails

_PASS_THROUGH = (DelegateExecutionError, FormatError, OperatorNotFoundError, UntrustedCodeError)


class DelegateInstance:
    """One delegate's blob, compile specs and named data on its backend."""

    def __init__(
        self,
        backend: type[BackendDetails],
        blob: bytes | memoryview | Callable[[], memoryview],
        compile_specs: Sequence[CompileSpec],
        named_data: Callable[[], NamedDataMap],
        *,
        name: str,
        output_count: int,
        trust: Trust | Inherited = INHERITED,
    ) -> None:
        """``trust``: the backend ids whose native code may run, ``None`` for any; by default, that of
        the delegate being initialized (a delegate nested in its blob), else any."""
        self._trust = current_trust() if isinstance(trust, Inherited) else trust
        check_trusted(backend, self._trust, f"delegate {name!r}")
        self.backend = backend
        self.name = name
        self.output_count = output_count
        self._blob = blob
        self._compile_specs = list(compile_specs)
        self._named_data = named_data
        self._lock = threading.Lock()
        self._execute_lock: threading.Lock | None = (
            None if getattr(backend, "thread_safe_execute", False) else threading.Lock()
        )
        self._handle: Any = None
        self._finalizer: weakref.finalize | None = None
        self._donated: dict[int, int] = {}

    @property
    def initialized(self) -> bool:
        return self._finalizer is not None and self._finalizer.alive

    def _describe(self) -> str:
        return f"backend {self.backend.backend_id!r}, delegate {self.name!r}"

    def ensure_initialized(self) -> Any:
        """The backend handle, calling ``init`` the first time (once, even from several threads)."""
        finalizer = self._finalizer
        if finalizer is not None and finalizer.alive:
            return self._handle
        with self._lock:
            if self._finalizer is None or not self._finalizer.alive:
                handle = self._on_blob("init", self.backend.init)
                self._handle = handle
                self._finalizer = weakref.finalize(self, self.backend.destroy, handle)
                if self._donated:
                    self._offer(handle)
        return self._handle

    def donate(self, donated: dict[int, int]) -> None:
        """Offer the backend the memory of these inputs for these outputs (``{input: output}``, see
        ``BackendDetails.accept_donated_inputs``), from its next ``init`` on."""
        with self._lock:
            self._donated = dict(sorted(donated.items()))
            if self._finalizer is not None and self._finalizer.alive:
                self._offer(self._handle)

    def _offer(self, handle: Any) -> None:
        try:
            self.backend.accept_donated_inputs(handle, dict(self._donated))
        except Exception as e:
            raise DelegateExecutionError(f"{self._describe()}: accept_donated_inputs failed: {e}") from e

    def profile(self) -> dict[Any, float] | None:
        """The backend's ``profile`` of this delegate's calls so far; None if it was never run or records none."""
        if not self.initialized:
            return None
        try:
            seconds = self.backend.profile(self._handle)
        except Exception as e:
            raise DelegateExecutionError(f"{self._describe()}: profile failed: {e}") from e
        return None if seconds is None else {key: float(value) for key, value in seconds.items()}

    def prepare(self) -> str | None:
        """The backend's ``prepare`` of this blob: machine-specific work kept for later loads, or None."""
        line = self._on_blob("prepare", self.backend.prepare)
        if line is not None and not isinstance(line, str):
            raise DelegateExecutionError(f"{self._describe()}: prepare() returned a {type(line).__name__}, not a line")
        return line

    def _on_blob(self, stage: str, hook: Callable[[memoryview, list[CompileSpec], NamedDataMap], Any]) -> Any:
        """The backend's ``hook(blob, compile_specs, named_data)`` under this delegate's trust; any
        failure but the runtime's own errors becomes a ``DelegateExecutionError`` naming ``stage``."""
        blob = self._blob() if callable(self._blob) else memoryview(self._blob)
        try:
            with trusting(self._trust):
                return hook(blob, list(self._compile_specs), self._named_data())
        except _PASS_THROUGH:
            raise
        except Exception as e:
            raise DelegateExecutionError(f"{self._describe()}: {stage} failed: {e}") from e

    def execute(self, inputs: list[Any]) -> list[Any]:
        """Run one call; the backend's outputs, checked to be ``output_count`` values."""
        handle = self.ensure_initialized()
        try:
            if self._execute_lock is None:
                outputs = self.backend.execute(handle, inputs)
            else:
                with self._execute_lock:
                    outputs = self.backend.execute(handle, inputs)
        except _PASS_THROUGH:
            raise
        except Exception as e:
            raise DelegateExecutionError(f"{self._describe()}: execute failed: {e}") from e
        if type(outputs) is not list or len(outputs) != self.output_count:
            if not isinstance(outputs, (list, tuple)) or len(outputs) != self.output_count:
                got = f"{len(outputs)} values" if isinstance(outputs, (list, tuple)) else type(outputs).__name__
                raise DelegateExecutionError(
                    f"{self._describe()}: execute() returned {got}; expected a list of {self.output_count} outputs"
                )
            outputs = list(outputs)
        return outputs

    def call(self, *inputs: Any) -> list[Any]:
        """``execute`` with the inputs as arguments: the form a loaded graph calls."""
        return self.execute(list(inputs))

    def release(self) -> None:
        """Destroy the handle now, if there is one; the next call initializes again."""
        with self._lock:
            finalizer, self._finalizer, self._handle = self._finalizer, None, None
        if finalizer is not None:
            finalizer()
