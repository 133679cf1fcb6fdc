"""Tensors a stage makes from the weights (quantized, packed), written to an unlinked temporary file as
they are made and read back by memory map.

A model larger than memory cannot hold a second form of its weights either: a stage that makes one
weight's new form at a time spills each as it is made, so the process holds a tensor's temporaries,
not the model's. The file is mapped in arenas of at least ``ARENA`` bytes (one mapping, and one file
descriptor, per arena, not per tensor); the pages are registered with ``mapped_pages``, released as
soon as a tensor is written, and read again a chunk at a time where they are hashed and saved.
Small tensors stay in memory.
"""

from __future__ import annotations

import errno
import mmap
import os
import tempfile
from typing import Any

import numpy as np
import torch

from torchdelegate.exported.mapped_pages import register_mapping, release_buffer

SMALLEST_SPILLED = 1 << 20
"""Tensors of fewer bytes stay in memory."""
ARENA = 256 * 1024 * 1024
"""Bytes of the file mapped at once; a larger tensor gets an arena of its own."""
_ALIGNMENT = 64


class SpilledTensors:
    """An unlinked temporary file (in ``TMPDIR``) tensors are written into, each a view of a shared
    mapping of its arena. The file lives as long as a view does."""

    def __init__(self, smallest: int = SMALLEST_SPILLED) -> None:
        self.smallest = smallest
        self._file: Any = None
        self._end = 0  # the file's mapped length
        self._arena: mmap.mmap | None = None
        self._used = 0

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A tensor to fill, its bytes in the file (what is written reaches the file; its pages may be
        released once written); in memory when small."""
        count = int(np.prod(shape, dtype=np.int64)) if shape else 1
        nbytes = count * torch.empty((), dtype=dtype).element_size()
        if nbytes < self.smallest:
            return torch.empty(shape, dtype=dtype)
        arena, offset = self._region(nbytes)
        return torch.frombuffer(arena, dtype=dtype, count=count, offset=offset).view(shape)

    def tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor``'s values spilled, as a tensor of its dtype and shape; itself when small."""
        if tensor.nbytes < self.smallest or tensor.device.type != "cpu":
            return tensor
        spilled = self.empty(tuple(tensor.shape), tensor.dtype)
        spilled.copy_(tensor.detach())
        release_buffer(spilled)
        return spilled

    def array(self, array: np.ndarray) -> np.ndarray:
        """``array``'s values spilled, as an array of its dtype and shape; itself when small."""
        if array.nbytes < self.smallest:
            return array
        arena, offset = self._region(array.nbytes)
        spilled = np.frombuffer(arena, dtype=array.dtype, count=array.size, offset=offset).reshape(array.shape)
        spilled[...] = array
        release_buffer(spilled)
        return spilled

    def _region(self, nbytes: int) -> tuple[mmap.mmap, int]:
        """Where ``nbytes`` go: an arena and an offset in it."""
        if self._arena is None or self._used + nbytes > len(self._arena):
            if self._file is None:
                self._file = tempfile.TemporaryFile(prefix="torchdelegate-spill-")
            size = -(-max(ARENA, nbytes) // mmap.ALLOCATIONGRANULARITY) * mmap.ALLOCATIONGRANULARITY
            _reserve(self._file.fileno(), self._end, size)
            self._arena = mmap.mmap(self._file.fileno(), size, access=mmap.ACCESS_WRITE, offset=self._end)
            register_mapping(self._arena)
            self._end += size
            self._used = 0
        offset = self._used
        self._used += -(-nbytes // _ALIGNMENT) * _ALIGNMENT
        return self._arena, offset


def _reserve(descriptor: int, start: int, size: int) -> None:
    """The file's blocks from ``start`` to ``start + size``, reserved on disk now: a full disk is an
    ``OSError`` here, where writing into a mapping of blocks that cannot be had would kill the
    process with SIGBUS."""
    try:
        os.posix_fallocate(descriptor, start, size)
    except OSError as e:
        if e.errno != errno.ENOSPC:  # a file system that cannot reserve: extended without reserving
            os.ftruncate(descriptor, start + size)
            return
        raise OSError(
            errno.ENOSPC,
            f"no room left in {tempfile.gettempdir()} for {size / 2**20:.0f} MiB more of spilled tensors "
            f"({start / 2**30:.1f} GiB spilled so far): free disk space there, or point TMPDIR at a larger disk",
        ) from None
