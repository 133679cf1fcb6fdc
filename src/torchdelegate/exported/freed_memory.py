"""Heap memory this process has freed, handed back to the system.

Stages that make weight-sized temporaries one weight at a time (quantizing, packing) free them
again, but glibc keeps much of what it frees in the process (its threshold for mapping large blocks
on their own rises as they are freed, and freed blocks fragment its heap): without a return the
process grows by tens of MB per weight while holding none of them.
"""

from __future__ import annotations

import ctypes
import sys
from functools import cache
from typing import Any


@cache
def _malloc_trim() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None).malloc_trim  # glibc's; musl has none
    except Exception:
        return None


def return_freed_memory() -> None:
    """Hand the heap memory freed so far back to the system (glibc's ``malloc_trim``; elsewhere nothing)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
