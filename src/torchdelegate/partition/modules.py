"""The ``nn.Module`` calls a node was made in, as export recorded them (``nn_module_stack``).

A partitioner that chooses by layer, a quantization recipe that keeps a module in float and
the report's pictures that group computations by layer all read them here. The root module
(path ``""``) is left out; a module called twice in one method gives two calls, ``lin`` and
``lin@1``, as export numbers them, so the calls of one method form a tree.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable
from dataclasses import dataclass

from torch.fx import Node

NO_MODULE = "_empty_nn_module_stack_from_metadata_hook"
"""The stack torch's export passes give a node they add outside any module (a ``sym_size`` of a dynamic
dimension): no module call, whatever its entry says."""


@dataclass(frozen=True)
class ModuleCall:
    """One call of a module: ``name`` is its path, with ``@N`` for the (N+1)th call of it in the method."""

    name: str
    path: str
    type_name: str  # the class's qualified name, as export recorded it


def module_calls(node: Node) -> list[ModuleCall]:
    """The module calls ``node`` was made in, outermost first; empty when export recorded none."""
    stack = node.meta.get("nn_module_stack") or {}
    try:
        return list(_read_once(tuple(stack.items())))  # the nodes of one layer share their stack
    except TypeError:  # an entry that cannot be a key: read as it is
        return _read(stack.items())


@functools.lru_cache(maxsize=4096)
def _read_once(items: tuple[tuple[object, object], ...]) -> tuple[ModuleCall, ...]:
    return tuple(_read(items))


def _read(items: Iterable[tuple[object, object]]) -> list[ModuleCall]:
    calls = []
    for key, entry in items:
        if not (isinstance(entry, tuple | list) and len(entry) == 2 and isinstance(entry[0], str)) or not entry[0]:
            continue
        if key == NO_MODULE:
            continue
        path, kind = entry
        _, at, count = str(key).rpartition("@")
        name = f"{path}@{count}" if at and count.isdigit() else path
        calls.append(ModuleCall(name, path, kind if isinstance(kind, str) else _qualified_name(kind)))
    return calls


def module_path(node: Node) -> str:
    """The path of the innermost module that called ``node``, ``""`` when none is recorded."""
    calls = module_calls(node)
    return calls[-1].path if calls else ""


def call_label(call: str, caller: str) -> str:
    """A module call's name under its caller's: ``layers.0`` under ``model.layers``, ``lin@1`` for a second call."""
    path = _CALL_NUMBER.sub("", caller)
    return call[len(path) + 1 :] if path and call.startswith(path + ".") else call


_CALL_NUMBER = re.compile(r"@\d+$")


def _qualified_name(kind: object) -> str:
    return f"{getattr(kind, '__module__', '')}.{getattr(kind, '__qualname__', kind)}"
