"""Which graph nodes each ONNX node computes: the partition's debug handle map.

torch's exporter re-traces the partition before it translates it, and writes on every ONNX node
the node of that re-traced graph it came from (``pkg.torch.onnx.fx_node``); each re-traced node
remembers the partition's node it was made from (``meta["from_node"]``, torch's provenance). Read
together, they give each ONNX node the debug handles of the partition's nodes, those a pass here
folded into one included (``exported/debug_handles.py``). onnxscript's fusions keep the metadata
of one node they fuse, so a fused kernel is mapped to that node's handles. Read before the
metadata is stripped from the model; ONNX node names are the identifiers, as ONNX Runtime's
profiler names its events.
"""

from __future__ import annotations

from typing import Any

from torch.export import ExportedProgram
from torch.fx import Node

from torchdelegate.exported.debug_handles import node_debug_handles

FX_NODE = "pkg.torch.onnx.fx_node"


def onnx_node_handles(
    ir: Any, model: Any, traced: ExportedProgram, program: ExportedProgram
) -> dict[str, tuple[int, ...]]:
    """``ONNX node name -> debug handles`` for the nodes of ``model`` (translated from ``traced``, the
    exporter's re-trace of ``program``) whose source carries handles, in the model's node order."""
    handles = {node.name: node_debug_handles(node) for node in program.graph.nodes if node.op == "call_function"}
    by_traced = {node.name: _source_handles(node, handles) for node in traced.graph.nodes if node.op == "call_function"}
    own: dict[Any, tuple[int, ...]] = {}
    nodes = list(ir.traversal.RecursiveGraphIterator(model.graph))
    for node in nodes:
        described = node.metadata_props.get(FX_NODE, "")
        source = described.split(" ", 1)[0].removeprefix("%") if described.startswith("%") else ""
        if by_traced.get(source):
            own[node] = by_traced[source]
    found: dict[str, tuple[int, ...]] = {}
    for node in nodes:
        mapped = own.get(node) or _of_neighbour(node, own)
        if node.name and mapped:
            found[node.name] = mapped
    return found


def _of_neighbour(node: Any, own: dict[Any, tuple[int, ...]]) -> tuple[int, ...]:
    """For a node a fusion made without metadata (a matrix product onnxscript folded a weight's transpose
    into): the handles of the nearest node reading what it makes, else of the nearest making what it reads."""
    for step in (_readers, _makers):
        frontier, seen = [node], {node}
        for _ in range(3):
            frontier = [n for current in frontier for n in step(current) if n not in seen]
            seen.update(frontier)
            for neighbour in frontier:
                if neighbour in own:
                    return own[neighbour]
    return ()


def _readers(node: Any) -> list[Any]:
    return [user for value in node.outputs for user, _ in value.uses()]


def _makers(node: Any) -> list[Any]:
    return [value.producer() for value in node.inputs if value is not None and value.producer() is not None]


def _source_handles(node: Node, handles: dict[str, tuple[int, ...]]) -> tuple[int, ...]:
    """The handles of the partition's nodes ``node`` was made from: the first step back in its provenance
    that names nodes of the partition."""
    sources = node.meta.get("from_node") or []
    for _ in range(8):  # a chain of re-traces, newest first
        if not sources:
            break
        named = sorted({h for source in sources for h in handles.get(source.name, ())})
        if named:
            return tuple(named)
        sources = [earlier for source in sources for earlier in (source.from_node or [])]
    return ()
