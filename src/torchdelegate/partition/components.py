"""Blocks joined into groups by pairs of them: the connected components of an undirected graph.

One union-find for every place that groups by "these two go together" (a level's blocks
linked by edges, partitions linked by the weights they read, groups joined by merging.py).
"""

from __future__ import annotations

from collections.abc import Iterable


class DisjointSets:
    """Blocks in disjoint sets, each named by a root block (union-find with path halving)."""

    def __init__(self, blocks: Iterable[int]) -> None:
        self.root = {block: block for block in blocks}

    def find(self, block: int) -> int:
        """The root of ``block``'s set."""
        root = self.root
        while root[block] != block:
            root[block] = root[root[block]]
            block = root[block]
        return block

    def join(self, keep: int, other: int) -> None:
        """Put ``other``'s set into ``keep``'s; ``keep``'s root names the union."""
        self.root[self.find(other)] = self.find(keep)


def components(blocks: Iterable[int], pairs: Iterable[tuple[int, int]]) -> list[list[int]]:
    """The groups ``pairs`` join ``blocks`` into: each sorted, in the order of their first blocks.

    A block in no pair is a group of its own; both blocks of every pair must be among ``blocks``.
    """
    sets = DisjointSets(blocks)
    for first, second in pairs:
        low, high = sorted((sets.find(first), sets.find(second)))
        sets.join(low, high)
    grouped: dict[int, list[int]] = {}
    for block in sorted(sets.root):
        grouped.setdefault(sets.find(block), []).append(block)
    return sorted(grouped.values(), key=lambda members: members[0])
