"""A topological order of a directed graph given as successor lists (Kahn's algorithm).

One home for the order every pass over a graph of blocks needs: the capability partitioner's
levels, the joins of its groups, and lowering's fused graph (each partition one step).
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Iterable, Mapping
from typing import TypeVar

V = TypeVar("V", bound=Hashable)


def topological_order(successors: Mapping[V, Iterable[V]]) -> list[V]:
    """The keys of ``successors`` with every vertex before its successors, ties in key order.

    Every successor must be a key; an edge listed twice counts twice. On a cycle the list is
    shorter: the vertices on a cycle, and those after one, are left out (the caller names the
    cycle). Cost: ``O((vertices + edges) log vertices)``.
    """
    position = {vertex: index for index, vertex in enumerate(successors)}
    vertices = list(position)
    indegree = [0] * len(vertices)
    for targets in successors.values():
        for target in targets:
            indegree[position[target]] += 1
    ready = [index for index, count in enumerate(indegree) if count == 0]
    heapq.heapify(ready)
    order: list[V] = []
    while ready:
        vertex = vertices[heapq.heappop(ready)]
        order.append(vertex)
        for target in successors[vertex]:
            index = position[target]
            indegree[index] -= 1
            if indegree[index] == 0:
                heapq.heappush(ready, index)
    return order
