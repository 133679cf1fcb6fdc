"""What every side of a benchmark measures with: resident memory, its peak, call latency.

Plain Python and torch, so that the ExecuTorch side (in its own virtual environment) and
ours measure with the same instruments.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any


def rss_bytes() -> int:
    """This process's resident memory now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def pss_bytes() -> int:
    """This process's proportional set size now: a page shared with other processes counts by its share."""
    return _status_bytes("/proc/self/smaps_rollup", "Pss:")


def anonymous_bytes() -> int:
    """This process's resident memory backed by no file: copies, unlike the pages of a mapped file."""
    return _status_bytes("/proc/self/status", "RssAnon:")


def reset_peak_rss() -> None:
    """Start :func:`peak_rss_bytes` afresh from the resident memory now (Linux's ``clear_refs``)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_rss_bytes() -> int:
    """The kernel's record of this process's peak resident memory (since start or the last reset):
    exact, unlike a sampler, however briefly the peak lasted."""
    return _status_bytes("/proc/self/status", "VmHWM:")


def descendants(root: int) -> list[int]:
    """``root`` and every process below it (a server and its workers), read from ``/proc``."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/stat") as f:
                    text = f.read()
                parent = int(text[text.rindex(")") + 2 :].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
    found, queue = [], [root]
    while queue:
        pid = queue.pop()
        found.append(pid)
        queue.extend(children.get(pid, []))
    return found


def processes_bytes(pids: list[int], file: str, field: str) -> int:
    """``field`` of ``/proc/PID/file`` summed over ``pids`` (``"smaps_rollup", "Pss:"``: their PSS;
    ``"status", "RssAnon:"``: their anonymous memory); a process gone meanwhile counts nothing."""
    total = 0
    for pid in pids:
        try:
            total += _status_bytes(f"/proc/{pid}/{file}", field)
        except (OSError, RuntimeError):
            continue
    return total


def _status_bytes(path: str, field: str) -> int:
    with open(path) as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{path} has no {field} line")


class PeakRss:
    """Samples ``reading`` (resident memory by default) in a thread every ``interval`` seconds;
    ``growth`` is the peak above the start."""

    def __init__(self, interval: float = 0.0005, reading: Callable[[], int] = rss_bytes) -> None:
        self.interval = interval
        self.reading = reading

    def __enter__(self) -> PeakRss:
        self.start = self.peak = self.reading()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, self.reading())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.reading())

    @property
    def growth(self) -> int:
        return self.peak - self.start


def call_latency_us(call: Callable[[], Any], calls: int, repeats: int, warm_up: int = 20) -> list[float]:
    """Microseconds per call, for each of ``repeats`` runs of ``calls`` calls, after ``warm_up`` calls."""
    for _ in range(warm_up):
        call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return times


def warm_up_torch(width: int) -> None:
    """Pay torch's one-time costs (its thread pool, MKL's GEMM workspace) before a memory baseline.

    Every side does this, eager torch included, so that resident memory growth counts what
    loading a program costs, not what the first large matrix product in a process costs.
    """
    import torch

    a = torch.randn(8, 4 * width)
    b = torch.randn(4 * width, 4 * width)
    (a @ b).sum().item()
