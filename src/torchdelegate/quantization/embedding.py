"""Quantized token embeddings as an exported program holds them, found in one pass, and rewritten as
one operator (``torchdelegate::embedding_blockwise``) a backend translates into its own gather of
integers (ONNX Runtime's ``GatherBlockQuantized``).

A quantized embedding table exports as ``embedding(dequantize_affine(qdata, [1, group], scale,
zero_point, int8, qmin, qmax), indices)``, the form ``quantization.recipes`` writes and torchao's
weight-only configs leave: read that way, every call dequantizes the whole table, where a gather
of the integers dequantizes only the rows it reads.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.fx import Graph, Node

from torchdelegate.exported.debug_handles import stand_for
from torchdelegate.exported.structural_copy import copy_meta, keep_name
from torchdelegate.quantization.linear import affine_ops, grouped_integers, is_call, recognised, rewritten

_aten = torch.ops.aten


@dataclass(frozen=True)
class QuantizedEmbedding:
    """One embedding table of integers in groups along each row, read by ``indices``."""

    embedding: Node
    dequantize: Node
    indices: Node
    qdata: Node
    scale: Node
    zero_point: Node | None
    group_size: int

    @property
    def nodes(self) -> tuple[Node, ...]:
        """The nodes the lookup is made of: they go to one backend together, or not at all."""
        return (self.dequantize, self.embedding)

    @property
    def columns(self) -> int:
        return int(self.qdata.meta["val"].shape[1])


def quantized_embeddings(program: ExportedProgram) -> list[QuantizedEmbedding]:
    """Every quantized embedding of the program's graph whose tensors are state it carries, in graph order."""
    return recognised(program, _aten.embedding.default, lambda node, ops, is_state: _lookup(node, ops[2], is_state))


def embedding_of(node: Node) -> QuantizedEmbedding | None:
    """The quantized embedding ``node`` is part of (its dequantization or its lookup), if any."""
    ops = affine_ops()
    if ops is None or node.op != "call_function":
        return None
    lookup = node
    if is_call(node, ops[2]) and len(node.users) == 1:
        lookup = next(iter(node.users))
    if not is_call(lookup, _aten.embedding.default):
        return None
    found = _lookup(lookup, ops[2], lambda n: n.op in ("placeholder", "get_attr"))
    return found if found is not None and node in found.nodes else None


def _lookup(embedding: Node, dequantize: Any, is_state: Callable[[Node], bool]) -> QuantizedEmbedding | None:
    weight, indices = embedding.args[:2]
    if not (isinstance(weight, Node) and is_call(weight, dequantize) and isinstance(indices, Node)):
        return None
    if len(weight.users) != 1:
        return None
    grouped = grouped_integers(weight, is_state)
    if grouped is None:
        return None
    qdata, scale, zero_point, group, _ = grouped
    return QuantizedEmbedding(embedding, weight, indices, qdata, scale, zero_point, group)


def _embedding_blockwise(
    indices: torch.Tensor,
    qdata: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    group_size: int,
) -> torch.Tensor:
    """The rows ``indices`` reads of ``(qdata - zero_point) * scale``, scale and zero point per group
    of ``group_size`` along each row: only those rows are dequantized."""
    rows = qdata[indices].to(torch.float32)
    scales = scale[indices].repeat_interleave(group_size, dim=-1)
    if zero_point is not None:
        rows = rows - zero_point[indices].to(torch.float32).repeat_interleave(group_size, dim=-1)
    return rows * scales


def _embedding_blockwise_shape(indices: torch.Tensor, qdata: torch.Tensor, *_: Any) -> torch.Tensor:
    return indices.new_empty((*indices.shape, qdata.shape[1]), dtype=torch.float32)


@functools.cache
def embedding_blockwise() -> Any:
    """``torch.ops.torchdelegate.embedding_blockwise.default``: one operator for a backend to
    translate, its arithmetic (in torch) the reference; registered on first use."""
    op = torch.library.custom_op("torchdelegate::embedding_blockwise", mutates_args=())(_embedding_blockwise)
    op.register_fake(_embedding_blockwise_shape)
    return torch.ops.torchdelegate.embedding_blockwise.default


def with_blockwise_embeddings(program: ExportedProgram) -> tuple[ExportedProgram, int]:
    """A copy of ``program`` whose quantized embeddings are each one ``embedding_blockwise`` (its
    tensors shared), and how many there were; ``program`` itself when there are none."""
    return rewritten(program, quantized_embeddings(program), _replace)


def _replace(graph: Graph, lookup: QuantizedEmbedding, by_name: dict[str, Node]) -> None:
    embedding = by_name[lookup.embedding.name]
    point = None if lookup.zero_point is None else by_name[lookup.zero_point.name]
    arguments = (by_name[lookup.indices.name], by_name[lookup.qdata.name], by_name[lookup.scale.name], point)
    with graph.inserting_before(embedding):
        call = graph.call_function(embedding_blockwise(), (*arguments, lookup.group_size))
    copy_meta(embedding, call)
    stand_for(call, [by_name[node.name] for node in lookup.nodes])
    embedding.replace_all_uses_with(call)
    graph.erase_node(embedding)
    keep_name(graph, call, lookup.embedding.name)
