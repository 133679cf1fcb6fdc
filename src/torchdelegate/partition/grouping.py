"""Cycle-free grouping of claimed nodes, in one pass.

Fusing claimed nodes into one delegate must not create a cycle through a node left
outside (A -> outside -> B with A and B in one partition). Each node's *level* counts the
unclaimed nodes on the longest path reaching it; claimed nodes of equal level can share a
partition, because any path that leaves through an unclaimed node arrives at a higher
level. One pass in graph order, linear in nodes and edges.
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
    return groups
