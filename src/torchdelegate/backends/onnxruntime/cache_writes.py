"""Writes into an inner dimension of a tensor (a KV cache's positions) as writes where it lies.

A static KV cache is written with ``index_copy(cache, 2, positions, new)`` (or ``index_put``
with leading ``None`` indices). torch's ONNX exporter translates that as a ``Transpose`` of
the whole cache, a ``ScatterND`` on the first dimension and a ``Transpose`` back: two copies of
every layer's cache at every token, and a result that can never be the cache's own memory. A
write into dimension ``d`` is the same as one that indexes every dimension up to ``d`` (each
leading one by its whole range, broadcast against the positions), which the exporter
translates as one ``ScatterND`` on the cache as it lies; ``in_place`` then lets the session
write it into the cache's memory. :func:`cache_writes_in_place` returns a copy of a partition
with each such write rewritten; the caller's program is not touched.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch._guards import detect_fake_mode
from torch.export import ExportedProgram
from torch.fx import Node

from torchdelegate.exported.structural_copy import copy_graph, program_around

_aten = torch.ops.aten


def cache_writes_in_place(program: ExportedProgram) -> ExportedProgram:
    """A copy of ``program`` whose writes into an inner dimension index every leading one; ``program``
    itself when it has none."""
    if not any(_inner_write(node) is not None for node in program.graph.nodes):
        return program  # no copy of a graph that has no such write
    graph, attrs = copy_graph(program.graph_module)
    for node in list(graph.nodes):
        written = _inner_write(node)
        if written is not None:
            _rewrite(graph, node, *written)
    graph.eliminate_dead_code()
    graph.lint()
    return program_around(program, graph, attrs)


def _inner_write(node: Node) -> tuple[Node, int, Node, Any] | None:
    """``(tensor, dimension, positions, values)`` when ``node`` writes ``values`` at 1-D ``positions`` of
    ``tensor``'s ``dimension`` (1 or more, every dimension before it of a static size); else None."""
    if node.op != "call_function":
        return None
    if node.target is _aten.index_copy.default and len(node.args) == 4 and not node.kwargs:
        tensor, dimension, positions, values = node.args
    elif node.target is _aten.index_put.default and len(node.args) in (3, 4) and not node.kwargs:
        tensor, indices, values = node.args[:3]
        if (len(node.args) == 4 and node.args[3] is not False) or not isinstance(indices, (list, tuple)):
            return None
        leading = [index for index in indices[:-1] if index is not None]
        if leading or not indices or indices[-1] is None:
            return None
        dimension, positions = len(indices) - 1, indices[-1]
    else:
        return None
    if not isinstance(tensor, Node) or not isinstance(positions, Node) or not isinstance(dimension, int):
        return None
    shape, index = _value(tensor), _value(positions)
    if shape is None or index is None or index.dim() != 1 or index.dtype != torch.int64:
        return None
    dimension = dimension + shape.dim() if dimension < 0 else dimension
    if not 1 <= dimension < shape.dim() or not all(isinstance(size, int) for size in shape.shape[:dimension]):
        return None
    return tensor, dimension, positions, values


def _value(node: Node) -> torch.Tensor | None:
    value = node.meta.get("val")
    return value if isinstance(value, torch.Tensor) else None


def _rewrite(graph: torch.fx.Graph, node: Node, tensor: Node, dimension: int, positions: Node, values: Any) -> None:
    """``node`` becomes ``index_put(tensor, [range of each leading dimension..., positions], values)``."""
    example = _value(tensor)
    assert example is not None
    fake_mode = detect_fake_mode([example])
    sizes = [int(size) for size in example.shape[:dimension]]
    indices: list[Node] = []
    with graph.inserting_before(node):
        for axis, size in enumerate(sizes):
            whole = [1] * (dimension + 1)
            whole[axis] = size
            span = _call(graph, fake_mode, _aten.arange.start_step, (0, size, 1), {"dtype": torch.int64})
            indices.append(_call(graph, fake_mode, _aten.view.default, (span, whole), {}))
        flat = [1] * dimension + [-1]
        indices.append(_call(graph, fake_mode, _aten.view.default, (positions, flat), {}))
    # The write keeps its node (its name, users and place in the signature), with its new indices.
    node.target = _aten.index_put.default
    node.args = (tensor, indices, values)
    node.kwargs = {}


def _call(graph: torch.fx.Graph, fake_mode: Any, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Node:
    """A new call node, with the value export would have recorded for it."""
    node = graph.call_function(target, args, kwargs)
    values = torch.fx.node.map_arg(args, lambda n: n.meta["val"])
    with fake_mode if fake_mode is not None else contextlib.nullcontext():
        node.meta["val"] = target(*values, **kwargs)
    return node
