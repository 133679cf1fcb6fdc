"""Units joined into groups by pairs of them: the connected components of an undirected graph.

One union-find for every place that groups by "these two go together" (a level's units
linked by edges, partitions linked by the weights they read).
"""

from __future__ import annotations

from collections.abc import Iterable


def components(units: Iterable[int], pairs: Iterable[tuple[int, int]]) -> list[list[int]]:
    """The groups ``pairs`` join ``units`` into: each sorted, in the order of their first units.

    A unit in no pair is a group of its own; both units of every pair must be among ``units``.
    """
    root = {unit: unit for unit in units}

    def find(unit: int) -> int:
        while root[unit] != unit:
            root[unit] = root[root[unit]]
            unit = root[unit]
        return unit

    for first, second in pairs:
        low, high = sorted((find(first), find(second)))
        root[high] = low
    grouped: dict[int, list[int]] = {}
    for unit in sorted(root):
        grouped.setdefault(find(unit), []).append(unit)
    return sorted(grouped.values(), key=lambda members: members[0])
