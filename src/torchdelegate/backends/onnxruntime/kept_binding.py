"""A delegate's calls through one IO binding kept from call to call.

A call that writes a KV cache in place goes through ONNX Runtime's IO binding (``in_place``). Most
of what a binding says does not change between a delegate's calls: the inputs of the branches it
does not take, the selector, the donated buffers (the program's own tensors) and where each output
goes. :class:`KeptBinding` binds those once and, per call, only the inputs that change (token ids,
positions: not even those when the caller passes the same arrays again) and the outputs ONNX
Runtime allocates anew (a bound output it allocated would be reused, whatever the next call's shape).
"""

from __future__ import annotations

import operator
import threading
from typing import Any

import numpy as np

from torchdelegate.backends.onnxruntime.settings import ONNX_TYPES


def as_array(value: Any) -> np.ndarray:
    """``value`` as a C-contiguous array: itself when it is one already (a Python int, a symbolic
    size, becomes an int64 scalar)."""
    if isinstance(value, np.ndarray):
        return value if value.flags.c_contiguous else np.ascontiguousarray(value)
    return np.asarray(value, dtype=np.int64)


class KeptBinding:
    """The IO binding of one branch of a session, for calls that write ``written`` outputs (output
    position: input position) into their inputs' memory."""

    def __init__(
        self,
        session: Any,
        branch: tuple[list[str], list[str]],
        unread: dict[str, Any],
        selector: tuple[str, np.ndarray] | None,
        written: dict[int, int],
    ) -> None:
        self._session = session
        self._names, self._outputs = branch
        self._written = dict(written)
        self._donated = {j: k for k, j in written.items()}
        self._binding = session.io_binding()
        for name, value in unread.items():  # this branch's own inputs are bound again at each call
            self._binding.bind_ortvalue_input(name, value)
        if selector is not None:
            self._selector = selector[1]  # kept alive: the binding reads its memory
            self._binding.bind_cpu_input(selector[0], self._selector)
        for name in self._outputs:  # in order: the outputs are read back by position
            self._binding.bind_output(name, "cpu")
        self._allocated = [k for k in range(len(self._outputs)) if k not in written]
        # The donated inputs are the program's own buffers, which nothing else reshapes: only the others'
        # layouts are looked at again at each call.
        undonated = [j for j in range(len(self._names)) if j not in self._donated]
        self._undonated: Any = lambda inputs: [inputs[j] for j in undonated]
        if len(undonated) > 1:
            self._undonated = operator.itemgetter(*undonated)
        self._kept: list[Any] = [None] * len(self._names)  # the arrays bound, as the caller passed them
        self._layouts: list[Any] = []  # their shapes and strides
        self._where: list[Any] = [None] * len(self._names)  # the memory, shape, strides and dtype bound
        self._alive: list[np.ndarray | None] = [None] * len(self._names)
        self._written_outputs: list[Any] = []
        self.lock = threading.Lock()
        """Held by the call using the binding (calls that share a program's buffers are serialized anyway)."""

    def run(self, inputs: list[Any]) -> list[np.ndarray] | None:
        """One call; the outputs written in place are the donated input arrays themselves. None, having
        run nothing, when a donated input is not a writable C-contiguous array (not the program's memory).

        Inputs that are the very arrays bound at the previous call, of the same shapes and strides (kept
        referenced, so they cannot be resized but with ``refcheck=False``, which numpy calls unsafe; a
        donated one, the program's own buffer, is not reshaped either), are not bound again, nor looked at
        one by one: a decode step that reuses its arrays binds nothing but the outputs ONNX Runtime allocates."""
        same = all(map(operator.is_, inputs, self._kept))
        if not (same and list(map(_layout, self._undonated(inputs))) == self._layouts):
            if not self._bind(inputs):
                return None
        for k in self._allocated:  # left to ONNX Runtime: a new tensor each call, of this call's shape
            self._binding.bind_output(self._outputs[k], "cpu")
        self._session._sess.run_with_iobinding(self._binding._iobinding, None)
        values = self._binding._iobinding.get_outputs()
        outputs = list(self._written_outputs)
        for k in self._allocated:
            outputs[k] = values[k].numpy()
        return outputs

    def _bind(self, inputs: list[Any]) -> bool:
        """Bind the inputs (and the outputs written into donated ones) that are not bound already; False
        when a donated input is not memory the program may write."""
        for j, value in enumerate(inputs):
            array = as_array(value)
            same = array is value
            if j in self._donated and (not same or not array.flags.writeable):
                return False
            where = (array.ctypes.data, array.shape, array.strides, array.dtype)
            if where != self._where[j]:  # another array, or the same memory seen through a new view
                dtype, pointer = bound_dtype(array), array.ctypes.data
                if j in self._donated:
                    self._binding.bind_output(self._outputs[self._donated[j]], "cpu", 0, dtype, array.shape, pointer)
                self._binding.bind_input(self._names[j], "cpu", 0, dtype, array.shape, pointer)
                self._where[j] = where
            # A Python int (a symbolic size) is kept too: the same object again is the same value.
            self._kept[j] = value if same or isinstance(value, int) else None
            self._alive[j] = array  # the binding reads its memory
        self._layouts = [
            _layout(value) if kept is not None else None
            for value, kept in zip(self._undonated(inputs), self._undonated(self._kept), strict=True)
        ]
        self._written_outputs = [
            inputs[self._written[k]] if k in self._written else None for k in range(len(self._outputs))
        ]
        return True


def _layout(value: Any) -> Any:
    """An array's shape and strides; anything else (a Python int) as itself."""
    return (value.shape, value.strides) if isinstance(value, np.ndarray) else value


_BINDABLE = frozenset(np.dtype(name) for name in ONNX_TYPES if name != "bfloat16")


def bound_dtype(array: np.ndarray) -> np.dtype:
    """``array``'s dtype, one ONNX Runtime's binding takes (numpy has no bfloat16 of its own)."""
    if array.dtype not in _BINDABLE:
        raise TypeError(f"a {array.dtype} array cannot be bound to ONNX Runtime")
    return array.dtype
