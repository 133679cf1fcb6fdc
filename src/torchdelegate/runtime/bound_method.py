"""A call into a loaded program: :class:`BoundMethod`, what ``Program.method(name)`` returns, and
the :class:`CallGate` every call passes.

The gate counts the calls in progress so that ``Program.close`` waits for them, and refuses calls once
the program is closed. A method that reads or writes mutable state runs under the program's state lock
(calls of stateful methods are serialized, each seeing the state the previous one left); before each
call, the checksums of the state the method reads are checked until all have passed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torchdelegate.errors import ProgramClosedError
from torchdelegate.runtime.array_method import ArrayMethod

if TYPE_CHECKING:
    from torchdelegate.runtime.method import Method


class CallGate:
    """Counts calls in progress so that ``close`` can wait for them, and refuses calls after it."""

    def __init__(self, path: str) -> None:
        self._condition = threading.Condition(threading.Lock())  # never re-entered: a plain lock is cheaper
        self._active = 0
        self._path = path
        self.closed = False

    def enter(self, method: str) -> None:
        with self._condition:
            if self.closed:
                raise ProgramClosedError(f"cannot run {method!r}: the program {self._path} is closed; load it again")
            self._active += 1

    def leave(self) -> None:
        with self._condition:
            self._active -= 1
            if not self._active:
                self._condition.notify_all()

    def close(self) -> bool:
        """Mark closed and wait for running calls; False if it was already closed."""
        with self._condition:
            if self.closed:
                return False
            self.closed = True
            while self._active:
                self._condition.wait()
            return True


class BoundMethod:
    """``Program.method(name)``: a callable with the method's calling convention."""

    def __init__(
        self,
        method: Method | ArrayMethod,
        gate: CallGate,
        output_type: str | None,
        state_lock: threading.Lock,
        verify: Callable[[Method | ArrayMethod], None],
    ) -> None:
        """``state_lock`` is taken around calls of a method that uses mutable state; ``verify`` checks the
        state ``method`` reads before a call runs."""
        self._gate = gate
        self._method = method
        self.output_type = output_type
        self._state_lock = state_lock if method.uses_mutable_state else None
        self._verify = verify
        self.name = method.name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self._gate.enter(self.name)
        try:
            self._verify(self._method)
            if self._state_lock is None:
                return self._method.call(args, kwargs)
            with self._state_lock:
                return self._method.call(args, kwargs)
        finally:
            self._gate.leave()

    def signature(self) -> list[str]:
        """The user inputs as ``name: dtype[sizes]``, in the order a call passes them."""
        return self._method.inputs.parameters()

    def size_ranges(self) -> dict[str, tuple[int | None, int | None]]:
        """Each size the export let vary (its symbol, ``s0``, as :meth:`signature` shows it) with the
        smallest and largest value a call may give (None: unbounded)."""
        ranges = {
            dim.symbol: (dim.lower, dim.upper)
            for leaf in self._method.inputs.leaves
            if leaf.kind == "tensor"
            for dim in leaf.dims
            if dim.symbol is not None
        }
        return dict(sorted(ranges.items(), key=lambda item: (len(item[0]), item[0])))  # s2 before s10

    def input_shape(self, name: str) -> tuple[int | None, ...]:
        """The sizes of tensor input ``name``: each fixed size, or None where the export let it vary."""
        for leaf in self._method.inputs.leaves:
            if leaf.name == name and leaf.kind == "tensor":
                return tuple(d.value for d in leaf.dims)
        tensors = [leaf.name for leaf in self._method.inputs.leaves if leaf.kind == "tensor"]
        raise KeyError(f"method {self.name!r} has no tensor input {name!r}; its tensor inputs are {tensors}")

    output_type: str | None
    """The container type the file says the outputs come in (``builtins.tuple``,
    ``transformers.modeling_outputs.CausalLMOutputWithPast``), None for a single value. If this
    process has not registered it, the outputs come back plain: see :attr:`Program.plain_types`."""

    def __repr__(self) -> str:
        return f"<method {self._method.inputs.describe()}>"
