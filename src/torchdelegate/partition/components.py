"""Units joined into groups by pairs of them: the connected components of an undirected graph.

One union-find for every place that groups by "these two go together" (a level's units
linked by edges, partitions linked by the weights they read, groups joined by merging.py).
"""

from __future__ import annotations

from collections.abc import Iterable


class DisjointSets:
    """Units in disjoint sets, each named by a root unit (union-find with path halving)."""

    def __init__(self, units: Iterable[int]) -> None:
        self.root = {unit: unit for unit in units}

    def find(self, unit: int) -> int:
        """The root of ``unit``'s set."""
        root = self.root
        while root[unit] != unit:
            root[unit] = root[root[unit]]
            unit = root[unit]
        return unit

    def join(self, keep: int, other: int) -> None:
        """Put ``other``'s set into ``keep``'s; ``keep``'s root names the union."""
        self.root[self.find(other)] = self.find(keep)


def components(units: Iterable[int], pairs: Iterable[tuple[int, int]]) -> list[list[int]]:
    """The groups ``pairs`` join ``units`` into: each sorted, in the order of their first units.

    A unit in no pair is a group of its own; both units of every pair must be among ``units``.
    """
    sets = DisjointSets(units)
    for first, second in pairs:
        low, high = sorted((sets.find(first), sets.find(second)))
        sets.join(low, high)
    grouped: dict[int, list[int]] = {}
    for unit in sorted(sets.root):
        grouped.setdefault(sets.find(unit), []).append(unit)
    return sorted(grouped.values(), key=lambda members: members[0])
