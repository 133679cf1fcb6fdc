"""Groups of nodes widened until each can be one partition: the nodes between them join them.

A group that must stay whole (``groups.py``) cannot be one partition if a path leaves it and
comes back into it: fused, the partition would wait for its own output. The same holds for
several groups that each wait for another. Every node on such a path must then be in the same
partition as the groups, so the only way out is to take it in. These are exactly the blocks of
a strongly connected component of the graph in which each group is one block: each such
component becomes one group, which contracts to a graph without cycles (the components of a
graph always do). It works when every block of the component is a computation the operator
support accepts; otherwise no partition can keep the groups whole, and the result names the
groups and a node that stands in the way.

Cost: a topological order of the blocks (``O((nodes + edges) log nodes)``); only where it finds
a cycle, one pass of Tarjan's algorithm over the blocks left over.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from torch.fx import Graph, Node

from torchdelegate.partition.capability import UnitGraph
from torchdelegate.partition.contract import is_tuple_item


@dataclass(frozen=True)
class Entangled:
    """Groups (indices, in order) that cannot be kept whole: a path between them goes through ``via``,
    a node the operator support refuses."""

    groups: list[int]
    via: Node


def widen_groups(
    graph: Graph, groups: Sequence[Sequence[Node]], accepts: Callable[[Node], bool]
) -> list[list[Node]] | Entangled:
    """``groups`` (disjoint lists of supported computations of ``graph``) with the nodes between them
    taken in: groups on one cycle merged, in order of their first group, each in graph order.
    ``accepts`` says whether a computation may join a group. Returns :class:`Entangled` instead when
    a node in the way is not accepted (the first such node in graph order)."""
    blocks = UnitGraph(graph, groups)
    order, successors = blocks.order()
    if len(order) == len(blocks.members):
        return [list(group) for group in groups]
    group_of = {node: index for index, group in enumerate(groups) for node in group}
    left = sorted(set(blocks.members) - set(order))
    merged: dict[int, int] = {}  # group index -> the first group of its component
    taken: dict[int, list[Node]] = {}  # first group of a component -> the nodes it takes in
    for component in strongly_connected(successors, left):
        if len(component) < 2:
            continue
        members = [node for block in component for node in blocks.members[block]]
        inside = sorted({group_of[node] for node in members if node in group_of})
        if not inside:  # a cycle holds a group: the graph itself has none
            continue
        refused = [node for node in members if node not in group_of and not _joinable(node, accepts)]
        if refused:
            return Entangled(inside, refused[0])
        merged.update(dict.fromkeys(inside, inside[0]))
        taken[inside[0]] = [node for node in members if node not in group_of]
    widened: dict[int, list[Node]] = {}
    for index, group in enumerate(groups):
        widened.setdefault(merged.get(index, index), []).extend(group)
    index_of = {node: position for position, node in enumerate(graph.nodes)}
    return [sorted([*nodes, *taken.get(first, ())], key=index_of.__getitem__) for first, nodes in widened.items()]


def _joinable(node: Node, accepts: Callable[[Node], bool]) -> bool:
    """A computation the support accepts, or an item of a tuple (it goes with its producer)."""
    return node.op == "call_function" and (is_tuple_item(node) or accepts(node))


def strongly_connected(successors: Mapping[int, Sequence[int]], vertices: Sequence[int]) -> list[list[int]]:
    """The strongly connected components among ``vertices`` (edges leaving them are ignored), each
    sorted, in order of their first vertex (Tarjan's algorithm, without recursion)."""
    among = set(vertices)
    number: dict[int, int] = {}
    low: dict[int, int] = {}
    stack: list[int] = []
    on_stack: set[int] = set()
    found: list[list[int]] = []
    for root in vertices:
        if root in number:
            continue
        work = [(root, iter([s for s in successors[root] if s in among]))]
        number[root] = low[root] = len(number)
        stack.append(root)
        on_stack.add(root)
        while work:
            vertex, pending = work[-1]
            step = next(pending, None)
            if step is not None:
                if step not in number:
                    number[step] = low[step] = len(number)
                    stack.append(step)
                    on_stack.add(step)
                    work.append((step, iter([s for s in successors[step] if s in among])))
                elif step in on_stack:
                    low[vertex] = min(low[vertex], number[step])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[vertex])
            if low[vertex] == number[vertex]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == vertex:
                        break
                found.append(sorted(component))
    return sorted(found, key=lambda component: component[0])
