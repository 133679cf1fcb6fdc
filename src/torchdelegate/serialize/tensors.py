"""Tensors in a file: a dtype name, a shape, and the raw bytes of a segment.

Bytes are the contiguous, row-major, little-endian values; a tensor is rebuilt over the
mapped segment without a copy. Only the dtypes below can be stored; their names are the
torch names without the ``torch.`` prefix.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch

from torchdelegate.errors import FormatError, SerializationError
from torchdelegate.serialize.arrays import checked_shape, physical_memory

DTYPES: dict[str, torch.dtype] = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.complex64,
        torch.complex128,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint64,
        torch.uint32,
        torch.uint16,
        torch.uint8,
        torch.bool,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
    )
}
_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def dtype_name(tensor: torch.Tensor, where: str) -> str:
    """The stored name of ``tensor``'s dtype; a ``SerializationError`` if it cannot be stored."""
    name = _NAMES.get(tensor.dtype)
    if name is None or tensor.layout != torch.strided or tensor.is_quantized:
        raise SerializationError(
            f"{where}: a {tensor.dtype} {tensor.layout} tensor cannot be stored; "
            f"the format stores dense tensors of {', '.join(DTYPES)}"
        )
    if tensor.device.type != "cpu" or type(tensor) not in (torch.Tensor, torch.nn.Parameter):
        raise SerializationError(
            f"{where}: a {type(tensor).__name__} on {tensor.device} cannot be stored; move real tensors to the CPU"
        )
    return name


def _checked(dtype: Any, shape: Any, where: str) -> torch.dtype:
    torch_dtype = DTYPES.get(dtype) if isinstance(dtype, str) else None
    if torch_dtype is None:
        raise FormatError(f"{where}: unknown dtype {dtype!r}")
    checked_shape(shape, where)
    return torch_dtype


def zeros(dtype: Any, shape: Any, where: str) -> torch.Tensor:
    """A tensor of zeros (stored as its shape alone), no larger than this machine's memory."""
    torch_dtype = _checked(dtype, shape, where)
    nbytes = math.prod(shape) * torch.empty((), dtype=torch_dtype).element_size()
    if nbytes > physical_memory():
        raise FormatError(f"{where}: asks for {nbytes} bytes of zeros, more than this machine's memory")
    return torch.zeros(shape, dtype=torch_dtype)


def tensor_from_bytes(data: memoryview, dtype: str, shape: Any, where: str) -> torch.Tensor:
    """A tensor over ``data`` (no copy), after checking that dtype and shape account for every byte."""
    torch_dtype = _checked(dtype, shape, where)
    numel = math.prod(shape)
    itemsize = torch.empty((), dtype=torch_dtype).element_size()
    if numel * itemsize != len(data):
        raise FormatError(f"{where}: a {dtype} tensor of shape {shape} needs {numel * itemsize} bytes, has {len(data)}")
    if numel == 0:
        return torch.empty(shape, dtype=torch_dtype)
    with warnings.catch_warnings():
        # A read-only segment: the tensor is used read-only, or copied before any write.
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(data, dtype=torch_dtype, count=numel).view(shape)
