"""The Python source torch.fx keeps for every graph module it compiles, released with the module.

torch.fx registers each compiled ``forward``'s source in its loader cache and in
``linecache`` (for tracebacks) and never removes it: a few KiB per graph module, so loading
and closing a program a thousand times would keep megabytes of dead source. A reader of
graphs records the keys torch.fx hands out while it builds a program's modules, and forgets
them when those modules are released.

The keys are the ones torch.fx numbered during the recording; a graph module that another
thread compiled in that window loses its source lines in tracebacks, nothing else.
"""

from __future__ import annotations

import linecache
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch.fx import graph_module as _graph_module

_KEY = "<eval_with_key>.{}"


def _loader() -> Any:
    return getattr(_graph_module, "_loader", None)


class GeneratedSource:
    """Keys of the graph-module source compiled while :meth:`recording`; :meth:`forget` drops them."""

    def __init__(self) -> None:
        self._keys: list[str] = []

    @contextmanager
    def recording(self) -> Iterator[None]:
        loader = _loader()
        start = getattr(loader, "next_id", None)
        try:
            yield
        finally:
            end = getattr(loader, "next_id", None)
            if isinstance(start, int) and isinstance(end, int):
                self._keys.extend(_KEY.format(number) for number in range(start, end))

    def forget(self) -> None:
        cache = getattr(_loader(), "eval_cache", None)
        caches = [linecache.cache, cache] if isinstance(cache, dict) else [linecache.cache]
        for key in self._keys:
            for entries in caches:
                entries.pop(key, None)
        self._keys.clear()
