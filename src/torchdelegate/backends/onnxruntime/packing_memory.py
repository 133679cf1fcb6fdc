"""The memory ONNX Runtime's weight packing leaves behind: the mapped pages it has read, released while
it packs, and the heap it freed, returned to the system.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from torchdelegate.delegate.named_data import NamedDataMap
from torchdelegate.exported.freed_memory import return_freed_memory

_RELEASE_INTERVAL = 0.02  # seconds between releases of the pages a packing session has read
_TRIMS_EVERY = 10  # releases between two returns of the heap (a walk of all of it)


@contextlib.contextmanager
def pages_released_while_packing(named_data: NamedDataMap, keys: list[str]) -> Iterator[None]:
    """While ONNX Runtime packs the weights ``keys`` name (reading each once), and when it is done,
    let the pages it has read go, so the process never holds the file's pages and the packed copy
    together: the first call's peak stays near the packed copy's size, not twice it. A page read
    again comes back from the file."""
    if not keys:
        yield
        return
    done = threading.Event()

    def release() -> None:
        sweeps = 0
        while not done.wait(_RELEASE_INTERVAL):
            for key in keys:
                named_data.release_pages(key)
            sweeps += 1
            if sweeps % _TRIMS_EVERY == 0:  # each reading kernel packs its own copy; all but one are dropped
                return_freed_memory()

    releasing = threading.Thread(target=release, name="torchdelegate-release-pages", daemon=True)
    releasing.start()
    try:
        yield
    finally:
        done.set()
        releasing.join()
        for key in keys:  # the packed copies are read now; the rest come back when read
            named_data.release_pages(key)
