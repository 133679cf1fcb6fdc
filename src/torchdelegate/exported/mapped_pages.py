"""Pages of a file mapped into memory, let go once read: the one home of that release, for the
weights of a checkpoint being lowered and the segments of a program file being loaded."""

from __future__ import annotations

import mmap


def release_pages(mapping: mmap.mmap, start: int, length: int) -> None:
    """Let the OS drop the pages wholly inside ``[start, start + length)`` of a private, unwritten
    mapping from this process's resident memory; they are read from the file again when touched.

    Only for bytes nothing has written through the mapping: a written page would go back to the
    file's bytes."""
    first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
    end = (start + length) // mmap.PAGESIZE * mmap.PAGESIZE
    if end > first and hasattr(mmap, "MADV_DONTNEED"):
        mapping.madvise(mmap.MADV_DONTNEED, first, end - first)
