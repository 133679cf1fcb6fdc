"""Python's cyclic garbage collector paused while lowering builds graphs (``benchmarks/lowering.py``
measures what it saves)."""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

_gc_lock = threading.Lock()
_gc_pauses = 0
_gc_was_enabled = True


@contextlib.contextmanager
def cyclic_gc_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector while lowering builds graphs (reentrant, across threads).

    A full collection walks every live object, and building graphs allocates enough nodes to
    trigger several, so with the collector on the cost of lowering grows faster than the graphs.
    Reference counting still frees acyclic garbage. Never held around a partitioner's or a
    backend's code.
    """
    global _gc_pauses, _gc_was_enabled
    with _gc_lock:
        if _gc_pauses == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_pauses += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_pauses -= 1
            if _gc_pauses == 0 and _gc_was_enabled:
                gc.enable()
