"""Which graph nodes each unit of a delegate's blob computes, read from a saved file.

A delegate's ``debug_handle_map`` (what its backend's ``preprocess`` returned) maps the blob's
identifiers (ONNX node names for ONNX Runtime) to debug handles; the partition report saved beside
it says which node of the method each handle is (its name and op). Together they name the graph
nodes behind a profiler's event: :func:`delegate_nodes`, :func:`attributed_profile` (``torchdelegate
run --profile``), and ``torchdelegate inspect --debug-handles``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class GraphNode:
    """A node of a method's graph as the report names it; ``name`` and ``op`` are None without a report."""

    handle: int
    name: str | None
    op: str | None

    def __str__(self) -> str:
        return f"#{self.handle}" if self.name is None else f"{self.name} ({self.op})"


def delegate_nodes(delegate: Any, report: Mapping[str, Any] | None) -> dict[Any, list[GraphNode]]:
    """``identifier -> graph nodes`` of one delegate of a loaded program (``Program.delegates[i]``),
    named by the program's ``report`` (``Program.report``; None: handles only); {} without a map."""
    handles = delegate.debug_handle_map or {}
    rows = _rows_by_handle(report, delegate.method)
    found: dict[Any, list[GraphNode]] = {}
    for identifier, value in handles.items():
        numbers = value if isinstance(value, (list, tuple)) else (value,)
        found[identifier] = [_node(number, rows) for number in numbers if isinstance(number, int)]
    return found


@dataclass(frozen=True)
class ProfiledUnit:
    """A unit of a delegate's blob (``identifier`` in its map), the seconds its backend measured, and
    the graph nodes it computes ([] if the map does not name it)."""

    delegate: int
    identifier: Any
    seconds: float
    nodes: list[GraphNode]


def attributed_profile(program: Any) -> list[ProfiledUnit]:
    """A loaded program's profile (``Program.profile()``), each unit with its graph nodes, the longest first.

    A profiler may name a unit its backend made of several at load (ONNX Runtime's own fusions): such a
    name is taken as the longest identifier of the map it starts with."""
    report = program.report
    units = []
    for index, seconds in program.profile().items():
        known = delegate_nodes(program.delegates[index], report)
        for identifier, time in seconds.items():
            units.append(ProfiledUnit(index, identifier, time, _known(identifier, known)))
    return sorted(units, key=lambda unit: (-unit.seconds, unit.delegate, str(unit.identifier)))


def _known(identifier: Any, known: Mapping[Any, list[GraphNode]]) -> list[GraphNode]:
    if identifier in known:
        return known[identifier]
    text = str(identifier)
    prefixes = [key for key in known if isinstance(key, str) and key and text.startswith(key)]
    return known[max(prefixes, key=len)] if prefixes else []


def _rows_by_handle(report: Mapping[str, Any] | None, method: str) -> dict[int, Mapping[str, Any]]:
    if not report:
        return {}
    for entry in report.get("methods", []):
        if entry.get("method") == method:
            return {row["debug_handle"]: row for row in entry.get("nodes", []) if row.get("debug_handle") is not None}
    return {}


def _node(handle: int, rows: Mapping[int, Mapping[str, Any]]) -> GraphNode:
    row = rows.get(handle)
    return GraphNode(handle, None, None) if row is None else GraphNode(handle, row["name"], row["op"])
