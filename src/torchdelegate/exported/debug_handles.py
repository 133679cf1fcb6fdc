"""Debug handles: a number for every computation of a method, given at ``to_edge``.

A backend maps what its blob runs (an ONNX node, a kernel) to these numbers
(``DelegateMappingBuilder``); the map is saved with the delegate, and the lowering's report says
which node each number is, so a profile of the blob can name the graph's nodes. ExecuTorch keeps
the number in ``node.meta["debug_handle"]``, and so do we: the computations of each method are
numbered from 1 in graph order (a ``getitem`` of a tuple shares its producer's number), then
those of its control-flow sub-graphs (by their attribute names), so equal programs get equal
numbers; attribute reads (a control-flow sub-graph, a delegate) are numbered after them. A pass that
stands one node for several (a linear
layer put back together from its decomposition) lists theirs in ``meta["debug_handles"]``.
A delegate call that lowering puts in place of a partition is numbered as ExecuTorch numbers
it, after the largest number in its program (:func:`number_after`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from torch.export import ExportedProgram
from torch.fx import Graph, GraphModule, Node

from torchdelegate.exported.programs import is_tuple_item

DEBUG_HANDLE = "debug_handle"
DEBUG_HANDLES = "debug_handles"


def number_nodes(program: ExportedProgram) -> None:
    """Give each computation of ``program`` (one of our own making) without a handle the next number
    after the largest it holds (an item of a computation's tuple takes that computation's); ones
    already numbered keep theirs. Then its attribute reads (``get_attr``: a sub-graph, a delegate),
    as ExecuTorch numbers every node but the inputs and the output, after all of those."""
    graphs = [gm.graph for gm in _graph_modules(program.graph_module)]
    nodes = [node for graph in graphs for node in graph.nodes if node.op == "call_function"]
    handles = [node.meta.get(DEBUG_HANDLE) for node in nodes]
    following = max((h for h in handles if isinstance(h, int)), default=0) + 1
    for node, handle in zip(nodes, handles, strict=True):
        if isinstance(handle, int):
            continue
        if is_tuple_item(node):  # a tuple's item is its producer's value: the same computation
            producer = node.args[0].meta.get(DEBUG_HANDLE)  # type: ignore[union-attr]
            if isinstance(producer, int):
                node.meta[DEBUG_HANDLE] = producer
                continue
        node.meta[DEBUG_HANDLE] = following
        following += 1
    attributes = [node for graph in graphs for node in graph.nodes if node.op == "get_attr"]
    number_after([node for node in attributes if not isinstance(node.meta.get(DEBUG_HANDLE), int)], graphs)


def number_after(nodes: Sequence[Node], graphs: Iterable[Graph]) -> None:
    """Give ``nodes`` the numbers after the largest that any node of ``graphs`` holds or stands for,
    one each, in order: a number no computation of those graphs has."""
    largest = max((h for graph in graphs for node in graph.nodes for h in node_debug_handles(node)), default=0)
    for following, node in enumerate(nodes, start=largest + 1):
        node.meta[DEBUG_HANDLE] = following


def node_debug_handles(node: Node) -> tuple[int, ...]:
    """The handles ``node`` stands for: those a pass recorded for it, else its own; () if none."""
    recorded = node.meta.get(DEBUG_HANDLES)
    if recorded is not None:
        return tuple(recorded)
    handle = node.meta.get(DEBUG_HANDLE)
    return (handle,) if isinstance(handle, int) else ()


def stand_for(node: Node, absorbed: Iterable[Node]) -> None:
    """Record that ``node`` (in a graph of our own making) now computes what ``absorbed`` did."""
    node.meta[DEBUG_HANDLES] = tuple(sorted({h for source in (node, *absorbed) for h in node_debug_handles(source)}))


def handle_table(program: ExportedProgram) -> list[dict[str, list[int]]]:
    """Each graph's (the program's, then its sub-graphs') ``node name -> handles``: what travels with a
    program serialized by torch, whose form has no place for them."""
    return [
        {node.name: list(handles) for node in gm.graph.nodes if (handles := node_debug_handles(node))}
        for gm in _graph_modules(program.graph_module)
    ]


def restore_handles(program: ExportedProgram, table: list[dict[str, list[int]]]) -> None:
    """Give the nodes of ``program`` (rebuilt from its serialized form) the handles ``table`` names."""
    for gm, handles in zip(_graph_modules(program.graph_module), table, strict=False):
        for node in gm.graph.nodes:
            found = handles.get(node.name)
            if found and len(found) == 1:
                node.meta[DEBUG_HANDLE] = found[0]
            elif found:
                node.meta[DEBUG_HANDLES] = tuple(found)


def _graph_modules(root: GraphModule) -> list[GraphModule]:
    """``root``, then its sub-graphs, by attribute name."""
    found = [root]
    for _, module in sorted(root.named_modules(remove_duplicate=True)):
        if module is not root and isinstance(module, GraphModule):
            found.append(module)
    return found
