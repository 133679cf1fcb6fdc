"""How far preprocess has gone, for whoever watches a lowering (the command's progress bar).

Lowering announces how many partitions it will compile; each compiled partition is one step,
reported by the loop that compiled it (a backend's own ``preprocess_multimethod`` may report
its steps, or lowering reports them all when that call returns). Without a listener, nothing
is reported and nothing is paid but a context-variable read.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass


@dataclass(frozen=True)
class PreprocessProgress:
    """``done`` of ``total`` partitions compiled; the last by ``backend_id`` (``where`` names it)."""

    done: int
    total: int
    backend_id: str
    where: str


Listener = Callable[[PreprocessProgress], None]


class _Count:
    def __init__(self, listener: Listener) -> None:
        self.listener = listener
        self.done = 0
        self.total = 0


_current: ContextVar[_Count | None] = ContextVar("torchdelegate_preprocess_progress", default=None)


@contextmanager
def preprocess_progress(listener: Listener) -> Iterator[None]:
    """Call ``listener`` as each partition is compiled by lowerings inside this block."""
    token = _current.set(_Count(listener))
    try:
        yield
    finally:
        _current.reset(token)


def expect_partitions(count: int) -> None:
    """Lowering: ``count`` more partitions are about to be compiled."""
    current = _current.get()
    if current is not None:
        current.total += count


def partition_compiled(backend_id: str, where: str) -> None:
    """A backend's loop: one partition is compiled."""
    current = _current.get()
    if current is not None and current.done < current.total:
        current.done += 1
        current.listener(PreprocessProgress(current.done, current.total, backend_id, where))


def partitions_compiled_until(done: int, backend_id: str, where: str) -> None:
    """Lowering, after a backend's call: report the steps up to ``done`` its loop did not."""
    current = _current.get()
    while current is not None and current.done < min(done, current.total):
        partition_compiled(backend_id, where)


def steps_done() -> int:
    current = _current.get()
    return current.done if current is not None else 0
