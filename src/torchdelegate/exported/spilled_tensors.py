"""Tensors a stage makes from the weights (quantized, packed), written to an unlinked temporary file as
they are made and read back by memory map.

A model larger than memory cannot hold a second form of its weights either: a stage that makes one
weight's new form at a time spills each as it is made, so the process holds a tensor's temporaries,
not the model's. The pages are the file's (registered with ``mapped_pages``): hashing and saving
read them a chunk at a time and let them go. Small tensors stay in memory.
"""

from __future__ import annotations

import mmap
import os
import tempfile
from typing import Any

import numpy as np
import torch

from torchdelegate.exported.mapped_pages import register_mapping

SMALLEST_SPILLED = 1 << 20
"""Tensors of fewer bytes stay in memory: their pages are not worth a mapping each."""


class SpilledTensors:
    """An unlinked temporary file (in ``TMPDIR``) that tensors are appended to, each read back as a
    view of its own private mapping. The file lives as long as a view does."""

    def __init__(self, smallest: int = SMALLEST_SPILLED) -> None:
        self.smallest = smallest
        self._file: Any = None
        self._end = 0

    def tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor``'s bytes spilled, as a tensor of its dtype and shape; itself when small."""
        if tensor.nbytes < self.smallest or tensor.device.type != "cpu":
            return tensor
        flat = tensor.detach().contiguous().reshape(-1)
        mapping, offset = self._spill(flat.view(torch.uint8).numpy().data)
        view = torch.frombuffer(mapping, dtype=tensor.dtype, count=flat.numel(), offset=offset)
        return view.view(tensor.shape)

    def array(self, array: np.ndarray) -> np.ndarray:
        """``array``'s bytes spilled, as an array of its dtype and shape; itself when small."""
        if array.nbytes < self.smallest:
            return array
        contiguous = np.ascontiguousarray(array)
        mapping, offset = self._spill(contiguous.reshape(-1).view(np.uint8).data)
        return np.frombuffer(mapping, dtype=array.dtype, count=array.size, offset=offset).reshape(array.shape)

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A tensor to fill, its bytes in the file (a shared mapping: what is written reaches the file,
        and its pages may be released once written); in memory when small."""
        count = 1
        for n in shape:
            count *= n
        nbytes = count * torch.empty((), dtype=dtype).element_size()
        if nbytes < self.smallest:
            return torch.empty(shape, dtype=dtype)
        file = self._opened()
        start = self._end
        os.ftruncate(file.fileno(), start + nbytes)
        self._end = _aligned(start + nbytes)
        mapping = mmap.mmap(file.fileno(), nbytes, access=mmap.ACCESS_WRITE, offset=start)
        register_mapping(mapping)
        return torch.frombuffer(mapping, dtype=dtype, count=count).view(shape)

    def _opened(self) -> Any:
        if self._file is None:
            self._file = tempfile.TemporaryFile(prefix="torchdelegate-spill-")
        return self._file

    def _spill(self, data: memoryview) -> tuple[mmap.mmap, int]:
        file = self._opened()
        start = self._end
        written = 0
        while written < len(data):
            written += os.pwrite(file.fileno(), data[written:], start + written)
        self._end = _aligned(start + len(data))
        mapping = mmap.mmap(file.fileno(), len(data), access=mmap.ACCESS_COPY, offset=start)
        register_mapping(mapping)
        return mapping, 0


def _aligned(position: int) -> int:
    """The next offset a mapping may start at."""
    return -(-position // mmap.ALLOCATIONGRANULARITY) * mmap.ALLOCATIONGRANULARITY
