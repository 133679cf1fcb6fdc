"""Pages of a file mapped into memory, let go once read: the one home of that release, for the
weights of a checkpoint being lowered and the segments of a program file being loaded.

A mapping registered here (:func:`register_mapping`) is known by its addresses, so a stage that
reads bytes without knowing where they came from (hashing named data, writing a file) reads them
a chunk at a time and lets each chunk's pages go after (:func:`sha256_releasing`,
:func:`write_releasing`): the process never holds more of a mapped checkpoint than a chunk.
"""

from __future__ import annotations

import bisect
import ctypes
import hashlib
import mmap
import os
import threading
import weakref
from typing import Any, BinaryIO

CHUNK = 32 * 1024 * 1024
"""Bytes read between two releases."""

_lock = threading.Lock()
_starts: list[int] = []  # sorted
_mappings: dict[int, tuple[int, weakref.ref[mmap.mmap]]] = {}  # start address: (length, mapping)


def release_pages(mapping: mmap.mmap, start: int, length: int) -> None:
    """Let the OS drop the pages wholly inside ``[start, start + length)`` of a mapping from this
    process's resident memory; they are read from the file again when touched.

    For a private mapping, only bytes nothing has written through it (a written page would go back
    to the file's bytes); a shared mapping's writes are the file's, and stay."""
    first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
    end = (start + length) // mmap.PAGESIZE * mmap.PAGESIZE
    if end > first and hasattr(mmap, "MADV_DONTNEED"):
        mapping.madvise(mmap.MADV_DONTNEED, first, end - first)


def register_mapping(mapping: mmap.mmap) -> None:
    """Make ``mapping`` (shared, or private and never written through) known by its addresses while it lives."""
    if len(mapping) == 0:
        return
    start = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
    with _lock:
        bisect.insort(_starts, start)
        _mappings[start] = (len(mapping), weakref.ref(mapping))
    weakref.finalize(mapping, _unregister, start)


def _unregister(start: int) -> None:
    with _lock:
        if _mappings.pop(start, None) is not None:
            _starts.remove(start)


def release_address_range(address: int, length: int) -> None:
    """Release the pages of ``[address, address + length)`` where they lie in a registered mapping."""
    with _lock:
        index = bisect.bisect_right(_starts, address) - 1
        if index < 0:
            return
        start = _starts[index]
        size, reference = _mappings[start]
    mapping = reference()
    if mapping is not None and address + length <= start + size:
        release_pages(mapping, address - start, length)


def release_buffer(data: Any) -> None:
    """Release the pages of a contiguous tensor, an array or a buffer where they lie in a registered
    mapping (a weight mapped from a checkpoint, a spilled tensor); elsewhere nothing."""
    if hasattr(data, "data_ptr"):  # a torch tensor: this module does not import torch
        address, length = int(data.data_ptr()), int(data.nbytes)
    else:
        length = memoryview(data).nbytes
        address = address_of(data) or 0
    if address and length:
        release_address_range(address, length)


def address_of(data: Any) -> int | None:
    """Where a buffer's bytes start in memory (None for an empty one)."""
    view = memoryview(data)
    if view.nbytes == 0:
        return None
    import numpy

    array: Any = numpy.frombuffer(view.cast("B") if view.format != "B" or view.ndim != 1 else view, dtype=numpy.uint8)
    return int(array.__array_interface__["data"][0])


def sha256_releasing(data: bytes | memoryview) -> bytes:
    """The SHA-256 of ``data``, read a chunk at a time, each chunk's mapped pages released after."""
    digest = hashlib.sha256()
    hash_releasing(digest, data)
    return digest.digest()


def hash_releasing(digest: Any, data: bytes | memoryview) -> None:
    """``digest.update(data)`` a chunk at a time, each chunk's mapped pages released after."""
    if isinstance(data, bytes) or not _starts:
        digest.update(data)
        return
    for chunk in _chunks(data):
        digest.update(chunk)


def write_releasing(out: BinaryIO, data: bytes | memoryview) -> None:
    """Write ``data`` to ``out`` a chunk at a time, each chunk's mapped pages released after."""
    if isinstance(data, bytes) or not _starts:
        out.write(data)
        return
    for chunk in _chunks(data):
        out.write(chunk)


def _chunks(data: memoryview) -> Any:
    view = data.cast("B") if data.format != "B" or data.ndim != 1 else data
    base = address_of(view)
    for offset in range(0, len(view), CHUNK):
        chunk = view[offset : offset + CHUNK]
        yield chunk
        if base is not None:
            release_address_range(base + offset, len(chunk))


def mapped_file(path: str) -> memoryview:
    """A file's bytes, read-only, as a view of a private mapping registered here (its pages read when
    touched and released where they are hashed or written a chunk at a time); empty for an empty file."""
    with open(path, "rb") as file:
        size = os.fstat(file.fileno()).st_size
        if size == 0:
            return memoryview(b"")
        mapping = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY)
    register_mapping(mapping)
    return memoryview(mapping).toreadonly()
