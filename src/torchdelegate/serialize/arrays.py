"""Arrays in a file, without torch: the numpy dtype of each stored dtype, shapes checked, zero-copy views.

A program run on array runtimes (``delegate/array_runtime.py``) holds its state as numpy arrays over
the file's mapped segments. Dtypes numpy lacks (bfloat16, the float8s) come from ``ml_dtypes``,
imported only when a file uses one of them.
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np

from torchdelegate.errors import FormatError

# Stored dtype names (docs/FORMAT.md) numpy holds; the others need ml_dtypes.
_NUMPY = ("float64", "float32", "float16", "complex64", "complex128", "int64", "int32", "int16", "int8",
          "uint64", "uint32", "uint16", "uint8", "bool")  # fmt: skip
_ML_DTYPES = {"bfloat16": "bfloat16", "float8_e4m3fn": "float8_e4m3fn", "float8_e5m2": "float8_e5m2"}

# torch.export's serialized ScalarType codes (a graph's tensor values) as stored dtype names.
SCALAR_TYPES = {1: "uint8", 2: "int8", 3: "int16", 4: "int32", 5: "int64", 6: "float16", 7: "float32",
                8: "float64", 10: "complex64", 11: "complex128", 12: "bool", 13: "bfloat16", 28: "uint16",
                29: "float8_e4m3fn", 30: "float8_e5m2", 34: "uint32", 35: "uint64"}  # fmt: skip


def numpy_dtype(name: str, where: str) -> np.dtype:
    """The numpy dtype of stored dtype ``name``; a ``FormatError`` if unknown, an ``ImportError`` naming
    ``ml_dtypes`` when it is one numpy lacks and that library is not installed."""
    if name in _NUMPY:
        return np.dtype(name)
    extended = _ML_DTYPES.get(name)
    if extended is None:
        raise FormatError(f"{where}: unknown dtype {name!r}")
    try:
        import ml_dtypes
    except ImportError:
        raise ImportError(
            f"{where}: its {name} tensors need the ml_dtypes library, which numpy uses for the dtypes it lacks: "
            "pip install ml_dtypes"
        ) from None
    return np.dtype(getattr(ml_dtypes, extended))


def checked_shape(shape: Any, where: str) -> list[int]:
    """``shape`` if it is a list of at most 64 sizes whose product fits 48 bits, else a ``FormatError``."""
    if not isinstance(shape, list) or len(shape) > 64 or any(type(d) is not int or not 0 <= d < 1 << 48 for d in shape):
        raise FormatError(f"{where}: shape must be a list of at most 64 sizes below 2**48, got {shape!r:.200}")
    if math.prod(max(d, 1) for d in shape) >= 1 << 48:
        raise FormatError(f"{where}: shape {shape!r:.200} has too many elements (even if one size is 0)")
    return shape


def physical_memory() -> int:
    """This machine's memory in bytes (a bound no allocation a file asks for may pass)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - not POSIX
        return 1 << 40


def array_from_bytes(data: memoryview, dtype: str, shape: Any, where: str) -> np.ndarray:
    """A read-only array over ``data`` (no copy), after checking that dtype and shape account for every byte."""
    kind = numpy_dtype(dtype, where)
    sizes = checked_shape(shape, where)
    count = math.prod(sizes)
    if count * kind.itemsize != len(data):
        raise FormatError(
            f"{where}: a {dtype} tensor of shape {shape} needs {count * kind.itemsize} bytes, has {len(data)}"
        )
    return np.frombuffer(data, dtype=kind, count=count).reshape(sizes)


def zeros_array(dtype: str, shape: Any, where: str) -> np.ndarray:
    """An array of zeros (a state entry stored as its shape alone), no larger than this machine's memory."""
    kind = numpy_dtype(dtype, where)
    sizes = checked_shape(shape, where)
    if math.prod(sizes) * kind.itemsize > physical_memory():
        raise FormatError(
            f"{where}: asks for {math.prod(sizes) * kind.itemsize} bytes of zeros, more than this machine's memory"
        )
    return np.zeros(sizes, dtype=kind)
