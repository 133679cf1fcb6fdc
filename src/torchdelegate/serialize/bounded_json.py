"""The one reader of JSON that comes from outside: a file's manifest, graphs, tree specs, report and
blob headers, and cache entries.

Python's parser recurses once per nesting level: a document nested close to the interpreter's
recursion limit parses, and then every recursive walk over it (ours or torch's) raises
``RecursionError`` far from the reader. So a document is refused where it is read when it is
longer than its reader's limit or nests deeper than :data:`MAX_DEPTH`, and every value read here
is safe to walk recursively.
"""

from __future__ import annotations

import json
from typing import Any

MAX_DEPTH = 128
"""How deep any JSON read from outside may nest. Graph documents nest about ten levels per
control-flow sub-graph; tree specs one per container level."""


class JsonLimitError(ValueError):
    """A JSON document is not JSON, is longer than its limit, or nests deeper than :data:`MAX_DEPTH`."""


def bounded_json(data: bytes | bytearray | memoryview | str, limit: int) -> Any:
    """The JSON value in ``data``: a :class:`JsonLimitError` (a ``ValueError``) unless ``data`` is at
    most ``limit`` bytes (characters, for a ``str``) of JSON nesting at most :data:`MAX_DEPTH` deep."""
    if len(data) > limit:
        raise JsonLimitError(f"{len(data)} bytes of JSON, more than the {limit} this reader takes")
    text = bytes(data) if isinstance(data, memoryview) else data
    try:
        value = json.loads(text)
    except RecursionError:
        raise JsonLimitError(f"JSON nesting deeper than {MAX_DEPTH} levels") from None
    except (ValueError, TypeError) as e:
        raise JsonLimitError(f"not JSON ({e})") from None
    _check_depth(value)
    return value


def _check_depth(value: Any) -> None:
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > MAX_DEPTH:
            raise JsonLimitError(f"JSON nesting deeper than {MAX_DEPTH} levels")
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
