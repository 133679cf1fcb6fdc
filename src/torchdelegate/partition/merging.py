"""Joining one backend's groups when their union stays cycle-free.

Level grouping (``capability.py``) is always cycle-free but not always maximal: two groups on
different levels may have no path between them through a node outside both, and then they
can be one delegate call. This pass looks at each pair of groups joined by an edge, in the
order of the groups, and joins them unless a path leaves one and comes back into the other
through something else — which it records, so a report can say why two partitions stayed two.

Reachability is kept as one bit per group on every vertex of the graph in which each group
is one vertex (Python ints as bit sets), computed once in reverse topological order and
widened after each join, so checking a pair costs the edges leaving the two groups and a
join costs one pass over the vertices: O((vertices + edges) log vertices + joins x vertices) in all.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from torchdelegate.partition.components import DisjointSets
from torchdelegate.partition.topological_order import topological_order

V = TypeVar("V", bound=Hashable)


@dataclass(frozen=True)
class Refusal(Generic[V]):
    """Groups ``group`` and ``other`` share an edge but stay apart: a path leaves one through ``via``."""

    group: int
    other: int
    via: V


def merge_groups(
    successors: Mapping[V, Sequence[V]], groups: Sequence[Sequence[V]]
) -> tuple[list[list[int]], list[Refusal[V]]]:
    """Which of ``groups`` (disjoint vertex lists of a DAG) to join, and the joins refused.

    Returns the joined groups as sorted lists of indices into ``groups``, ordered by their first
    index. The graph with every group contracted to a vertex must be acyclic; it stays so.
    """
    # Contracted graph: group i is vertex i, every other vertex comes after the groups.
    vertex_id = {vertex: index for index, members in enumerate(groups) for vertex in members}
    outside: list[V] = []
    for vertex in successors:
        if vertex not in vertex_id:
            vertex_id[vertex] = len(groups) + len(outside)
            outside.append(vertex)
    contracted = _Contracted(len(groups), len(vertex_id) - sum(map(len, groups)) + len(groups))
    for vertex, targets in successors.items():
        for target in targets:
            contracted.add_edge(vertex_id[vertex], vertex_id[target])
    contracted.compute_reach()

    def name(vertex: int) -> V:
        return groups[vertex][0] if vertex < len(groups) else outside[vertex - len(groups)]

    refusals: list[Refusal[V]] = []
    for index in range(len(groups)):  # first, groups an edge joins, in order
        neighbours = {contracted.find(v) for v in contracted.after[index] | contracted.before[index]}
        for other in sorted(n for n in neighbours if n < index):
            mine = contracted.find(index)
            if other == mine:
                continue
            via = contracted.path_between(other, mine)
            if via is None:
                contracted.join(other, mine)
            else:
                refusals.append(Refusal(index, other, name(via)))
    roots = 0  # then groups no edge joins: the earliest with no path either way
    for index in range(len(groups)):
        mine = contracted.find(index)
        if mine != index:
            continue
        free = roots & ~contracted.reach[mine] & ~contracted.above[mine]
        if free:
            other = (free & -free).bit_length() - 1
            contracted.join(other, mine)
        else:
            roots |= 1 << mine
    joined: dict[int, list[int]] = {}
    for index in range(len(groups)):
        joined.setdefault(contracted.find(index), []).append(index)
    return sorted(joined.values()), refusals


class _Contracted:
    """A DAG whose first ``groups`` vertices are groups, with the groups each vertex reaches as bits."""

    def __init__(self, groups: int, vertices: int) -> None:
        self.groups = groups
        self.after: list[set[int]] = [set() for _ in range(vertices)]
        self.before: list[set[int]] = [set() for _ in range(vertices)]
        self.sets = DisjointSets(range(groups))
        self.mask = [1 << index for index in range(groups)]
        self.reach = [0] * vertices  # the groups each vertex reaches, itself included
        self.above = [0] * vertices  # the groups that reach each vertex, itself included

    def add_edge(self, source: int, target: int) -> None:
        if source != target:
            self.after[source].add(target)
            self.before[target].add(source)

    def compute_reach(self) -> None:
        order = topological_order(dict(enumerate(self.after)))
        if len(order) != len(self.after):
            raise ValueError("merge_groups: the groups do not contract to an acyclic graph")
        for vertex in reversed(order):
            bits = 1 << vertex if vertex < self.groups else 0
            for target in self.after[vertex]:
                bits |= self.reach[target]
            self.reach[vertex] = bits
        for vertex in order:
            bits = 1 << vertex if vertex < self.groups else 0
            for source in self.before[vertex]:
                bits |= self.above[source]
            self.above[vertex] = bits

    def find(self, vertex: int) -> int:
        """The group a vertex now belongs to (itself for a vertex outside every group)."""
        return vertex if vertex >= self.groups else self.sets.find(vertex)

    def path_between(self, first: int, second: int) -> int | None:
        """A vertex outside both groups on a path from one into the other, if there is one."""
        for source, target in ((first, second), (second, first)):
            for step in self.after[source]:
                if self.find(step) not in (first, second) and self.reach[step] & self.mask[target]:
                    return step
        return None

    def join(self, keep: int, other: int) -> None:
        """Make ``other`` part of ``keep``: whatever reached either now reaches what both reach."""
        self.sets.join(keep, other)
        self.mask[keep] |= self.mask[other]
        for table, mirror in ((self.after, self.before), (self.before, self.after)):
            table[keep] |= table[other]
            for neighbour in table[other]:
                mirror[neighbour].discard(other)
                mirror[neighbour].add(keep)
            table[other] = set()
        self.after[keep] -= {keep, other}
        self.before[keep] -= {keep, other}
        for closure in (self.reach, self.above):
            widened = closure[keep] | closure[other]
            for vertex, bits in enumerate(closure):
                if bits & self.mask[keep]:
                    closure[vertex] = bits | widened
