"""A delegate's calls through one IO binding kept from call to call.

A call that writes a KV cache in place goes through ONNX Runtime's IO binding (``in_place``). Most
of what a binding says does not change between a delegate's calls: the inputs of the branches it
does not take, the selector, the donated buffers (the program's own tensors) and where each output
goes. :class:`KeptBinding` binds those once and, per call, only the inputs that change (token ids,
positions) and the outputs ONNX Runtime allocates anew (a bound output it allocated would be
reused, whatever the next call's shape).
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import torch

from torchdelegate.backends.onnxruntime.settings import ONNX_TYPES


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
        self._buffers: dict[int, tuple[int, tuple[int, ...], torch.dtype]] = {}
        self.lock = threading.Lock()
        """Held by the call using the binding (calls that share a program's buffers are serialized anyway)."""

    def run(self, inputs: list[Any], tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """One call on ``tensors`` (``inputs`` made contiguous tensors); the donated inputs are
        ``inputs`` themselves, so their memory is the program's."""
        for j, (name, tensor) in enumerate(zip(self._names, tensors, strict=True)):
            if j not in self._donated:
                self._binding.bind_input(name, "cpu", 0, numpy_dtype(tensor), list(tensor.shape), tensor.data_ptr())
                continue
            where = (tensor.data_ptr(), tuple(tensor.shape), tensor.dtype)
            if self._buffers.get(j) != where:  # bound once for the program's buffer
                dtype, shape, pointer = numpy_dtype(tensor), list(tensor.shape), tensor.data_ptr()
                self._binding.bind_input(name, "cpu", 0, dtype, shape, pointer)
                self._binding.bind_output(self._outputs[self._donated[j]], "cpu", 0, dtype, shape, pointer)
                self._buffers[j] = where
        for k in self._allocated:  # left to ONNX Runtime: a new tensor each call, of this call's shape
            self._binding.bind_output(self._outputs[k], "cpu")
        self._session._sess.run_with_iobinding(self._binding._iobinding, None)
        values = self._binding._iobinding.get_outputs()
        return [
            inputs[self._written[k]] if k in self._written else torch.from_dlpack(values[k])
            for k in range(len(self._outputs))
        ]


_TORCH_TO_NUMPY = {getattr(torch, name): np.dtype(name) for name in ONNX_TYPES if name != "bfloat16"}


def numpy_dtype(tensor: torch.Tensor) -> np.dtype:
    """The numpy dtype ONNX Runtime's binding takes for ``tensor``'s (numpy has no bfloat16)."""
    dtype = _TORCH_TO_NUMPY.get(tensor.dtype)
    if dtype is None:
        raise TypeError(f"a {tensor.dtype} tensor cannot be bound to ONNX Runtime")
    return dtype
