"""Cycle-free grouping of claimed nodes, in one pass.

Fusing claimed nodes into one delegate must not create a cycle through a node left
outside (A -> outside -> B with A and B in one partition). Each node's *level* counts the
unclaimed nodes on the longest path reaching it; claimed nodes of equal level can share a
partition, because levels never decrease along an edge and rise after an unclaimed node,
so a path that leaves a level never comes back to it. A forward pass in graph order gives
each node its lowest level; a backward pass then raises each claimed node as far as its
users allow (to the lowest level among them), so that a node feeding only a later group
(``permute(weight)`` before an ``addmm`` that follows a size computation) joins that
group instead of making a group of its own. Both passes are linear in nodes and edges.
"""

from __future__ import annotations

import operator
from collections.abc import Callable

from torch.fx import Graph, Node


def cycle_free_levels(graph: Graph, claimed: Callable[[Node], bool]) -> dict[Node, int]:
    """The level of every claimed ``call_function`` node of ``graph``."""
    level: dict[Node, int] = {}
    groups: dict[Node, int] = {}
    for node in graph.nodes:
        inherited = 0
        for source in node.all_input_nodes:
            source_level = level.get(source, 0)
            if source.op == "call_function" and source not in groups:
                source_level += 1  # an unclaimed computation between
            inherited = max(inherited, source_level)
        level[node] = inherited
        if node.op != "call_function":
            continue
        if node.target is operator.getitem and isinstance(node.args[0], Node):
            if node.args[0] in groups:  # a tuple's items go where the tuple is
                groups[node] = level[node] = groups[node.args[0]]
        elif claimed(node):
            groups[node] = inherited
    _raise_to_users(graph, level, groups)
    return groups


def _raise_to_users(graph: Graph, level: dict[Node, int], groups: dict[Node, int]) -> None:
    """Raise each claimed node to the lowest level among its users (a tuple's: its items' users).

    Levels stay non-decreasing along every edge and unclaimed nodes keep theirs, so the
    grouping stays cycle-free.
    """
    for node in reversed(graph.nodes):
        if node not in groups or node.target is operator.getitem:
            continue
        items = [u for u in node.users if u.target is operator.getitem and u in groups]
        users = [w for item in items for w in item.users] + [u for u in node.users if u not in items]
        if not users:
            continue
        highest = min(level[u] for u in users)
        if highest > level[node]:
            level[node] = groups[node] = highest
            for item in items:
                level[item] = groups[item] = highest
