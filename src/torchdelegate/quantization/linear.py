"""Quantized linear layers as torchao leaves them in an exported program, found in one pass, and
rewritten as one operator (``torchdelegate::linear_blockwise``) a backend translates into its own
integer kernel.

torchao's ``IntxUnpackedToInt8Tensor`` weights (8da4w, int4 and int8 weight-only) export as
``linear(x, dequantize_affine(qdata, [1, group], scale, zero_point, int8, qmin, qmax), bias)``:
``qdata`` holds the integers in int8 whatever their width, ``scale`` and ``zero_point`` one value
per group of each row. With dynamic int8 activations (the "8da" of 8da4w) ``x`` itself comes
through ``choose_qparams_affine`` (asymmetric, per token), ``quantize_affine`` and
``dequantize_affine``. The ops are torchao's (``torch.ops.torchao``): they exist once torchao is
imported, and nothing here needs them otherwise.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch.export import ExportedProgram
from torch.fx import Graph, Node

from torchdelegate.exported.debug_handles import stand_for
from torchdelegate.exported.structural_copy import copy_graph, copy_meta, keep_name, program_around

_aten = torch.ops.aten


def affine_ops() -> tuple[Any, Any, Any] | None:
    """torchao's ``choose_qparams_affine``, ``quantize_affine`` and ``dequantize_affine`` overloads,
    or None when torchao has not registered them in this process."""
    namespace = getattr(torch.ops, "torchao", None)
    try:
        return (
            namespace.choose_qparams_affine.default,  # type: ignore[union-attr]
            namespace.quantize_affine.default,  # type: ignore[union-attr]
            namespace.dequantize_affine.default,  # type: ignore[union-attr]
        )
    except AttributeError:
        return None


@dataclass(frozen=True)
class QuantizedLinear:
    """One linear layer over integer weights in groups along its input dimension.

    ``source`` is the float activation the layer reads (before its dynamic quantization, if
    ``activation`` holds that chain of nodes); ``group_size`` divides ``in_features``; the
    integers lie within int8 (int4's are within ``[-8, 7]``)."""

    linear: Node
    dequantize: Node
    source: Node
    qdata: Node
    scale: Node
    zero_point: Node | None
    bias: Node | None
    activation: tuple[Node, ...]
    group_size: int

    @property
    def nodes(self) -> tuple[Node, ...]:
        """The nodes the layer is made of: they go to one backend together, or not at all."""
        return (*self.activation, self.dequantize, self.linear)

    @property
    def in_features(self) -> int:
        return int(self.qdata.meta["val"].shape[1])


def quantized_linears(program: ExportedProgram) -> list[QuantizedLinear]:
    """Every quantized linear layer of the program's graph whose integers, scales and zero points
    are state it carries, in graph order."""
    return recognised(program, _aten.linear.default, _layer)


def recognised(
    program: ExportedProgram,
    target: Any,
    recognise: Callable[[Node, tuple[Any, Any, Any], Callable[[Node], bool]], Found | None],
) -> list[Found]:
    """What ``recognise(node, torchao's affine ops, is_state)`` makes of each call to ``target`` in
    ``program``'s graph, in graph order (nothing without torchao)."""
    ops = affine_ops()
    if ops is None:
        return []
    is_state = state_predicate(program)
    calls = (node for node in program.graph.nodes if is_call(node, target))
    return [found for found in (recognise(node, ops, is_state) for node in calls) if found is not None]


def state_predicate(program: ExportedProgram) -> Callable[[Node], bool]:
    """Whether a node of ``program``'s graph reads a tensor the program carries (a parameter,
    buffer or lifted constant, or a part torch.export reads from a tensor subclass weight)."""
    signature = program.graph_signature
    state = {*signature.inputs_to_parameters, *signature.inputs_to_buffers}
    state |= set(signature.inputs_to_lifted_tensor_constants)
    inner = torch.ops.export.access_subclass_inner_tensor.default

    def is_state(node: Node) -> bool:
        if is_call(node, inner) and isinstance(node.args[0], Node):
            node = node.args[0]
        return node.name in state

    return is_state


def layer_of(node: Node) -> QuantizedLinear | None:
    """The quantized linear layer ``node`` is part of, if any (its tensors read from placeholders
    or attributes: a partition does not know which placeholders are state)."""
    ops = affine_ops()
    if ops is None or node.op != "call_function":
        return None
    linear: Node | None = node
    for _ in range(4):  # from the start of an activation's chain, at most four steps to its layer
        if linear is None or linear.target is _aten.linear.default:
            break
        linear = _toward_layer(linear, ops)
    if linear is None or linear.target is not _aten.linear.default:
        return None
    layer = _layer(linear, ops, lambda n: n.op in ("placeholder", "get_attr"))
    return layer if layer is not None and node in layer.nodes else None


def _toward_layer(node: Node, ops: tuple[Any, Any, Any]) -> Node | None:
    """The user of ``node`` on the way to the layer it may be part of: the layer, else a dequantization,
    else a quantization, else its first user."""
    users = list(node.users)
    for target in (_aten.linear.default, ops[2], ops[1]):
        for user in users:
            if is_call(user, target):
                return user
    return users[0] if users else None


def _layer(linear: Node, ops: tuple[Any, Any, Any], is_state: Callable[[Node], bool]) -> QuantizedLinear | None:
    source, weight, bias = (*linear.args, None)[:3]
    if not (isinstance(source, Node) and isinstance(weight, Node) and is_call(weight, ops[2])):
        return None
    if len(weight.users) != 1 or (bias is not None and not isinstance(bias, Node)):
        return None
    grouped = grouped_integers(weight, is_state)
    if grouped is None:
        return None
    qdata, scale, zero_point, group, columns = grouped
    activation, source = _dynamic_activation(source, linear, ops, columns)
    if activation is None:
        return None
    return QuantizedLinear(linear, weight, source, qdata, scale, zero_point, bias, activation, group)


def grouped_integers(dequantize: Node, is_state: Callable[[Node], bool]) -> tuple[Any, ...] | None:
    """(integers, scales, zero points, group size, inputs) of a weight's
    ``dequantize_affine``: int8 integers [out, in] with float32 scales (and integer zero points)
    per group of the row, all state; None for any other dequantization."""
    qdata, block, scale, zero_point, input_dtype, quant_min, quant_max = _dequantize_args(dequantize)
    parts = [n for n in (qdata, scale, zero_point) if n is not None]
    if not all(isinstance(n, Node) and is_state(n) and _value(n) is not None for n in parts):
        return None
    data: Any = _value(qdata)
    scales: Any = _value(scale)
    if data.dtype != torch.int8 or data.dim() != 2 or input_dtype != torch.int8:
        return None
    if not isinstance(block, (list, tuple)) or len(block) != 2 or block[0] != 1:
        return None
    rows, columns = (int(n) for n in data.shape)
    group = int(block[1])
    if group <= 0 or columns % group or tuple(scales.shape) != (rows, columns // group):
        return None
    if scales.dtype != torch.float32 or _output_dtype(dequantize) != torch.float32:
        return None
    points: Any = None if zero_point is None else _value(zero_point)
    integer = (torch.int8, torch.int16, torch.int32, torch.int64)
    if points is not None and (points.dtype not in integer or tuple(points.shape) != tuple(scales.shape)):
        return None
    low, high = -128 if quant_min is None else quant_min, 127 if quant_max is None else quant_max
    if not (isinstance(low, int) and isinstance(high, int) and -128 <= low < high <= 127):
        return None
    return qdata, scale, zero_point, group, columns


def _dynamic_activation(
    source: Node, linear: Node, ops: tuple[Any, Any, Any], columns: int
) -> tuple[tuple[Node, ...] | None, Node]:
    """The chain that quantizes ``linear``'s activation per token to int8 and back, and the float
    activation it reads: ``()`` if there is no such chain; None if there is a chain of another kind."""
    choose, quantize, dequantize = ops
    if not is_call(source, dequantize):
        return (), source
    quantized, block, scale, zero_point, input_dtype, quant_min, quant_max = _dequantize_args(source)
    if not is_call(quantized, quantize) or not all(is_call(n, operator.getitem) for n in (scale, zero_point)):
        return None, source
    chosen = scale.args[0]
    float_source = quantized.args[0]
    per_token = [1] * (len(block) - 1) + [columns]
    if not is_call(chosen, choose) or chosen.args[0] is not float_source or zero_point.args[0] is not chosen:
        return None, source
    if (scale.args[1], zero_point.args[1]) != (0, 1) or list(block) != per_token:
        return None, source
    mapping, choose_block, target = chosen.args[1:4]
    bounds = (chosen.args[4:6], (input_dtype, quant_min, quant_max), tuple(quantized.args[4:7]))
    if mapping != "ASYMMETRIC" or list(choose_block) != per_token or target != torch.int8:
        return None, source
    if chosen.kwargs or not _torchao_choice_defaults(chosen.args[6:]):
        return None, source
    if bounds != ((-128, 127), (torch.int8, -128, 127), (torch.int8, -128, 127)):
        return None, source
    if list(quantized.args[1]) != per_token or quantized.args[2:4] != (scale, zero_point):
        return None, source
    chain = (chosen, scale, zero_point, quantized, source)
    inside = set(chain) | {linear}
    if any(user not in inside for n in chain for user in n.users):
        return None, source
    if not isinstance(float_source, Node) or _output_dtype(source) != torch.float32:
        return None, source
    return chain, float_source


def _torchao_choice_defaults(rest: tuple[Any, ...]) -> bool:
    """``choose_qparams_affine``'s eps, scale dtype, zero point dtype and keepdim as torchao's dynamic
    activations leave them (the kernel's own quantization stands in for that one only)."""
    eps, scale_dtype, point_dtype, keepdim = (*rest, None, None, None, False)[:4]
    return eps is None and scale_dtype in (None, torch.float32) and point_dtype in (None, torch.int8) and not keepdim


def is_call(value: Any, target: Any) -> bool:
    return isinstance(value, Node) and value.op == "call_function" and value.target is target


def _dequantize_args(node: Node) -> tuple[Any, ...]:
    """``dequantize_affine``'s (input, block_size, scale, zero_point, input_dtype, quant_min, quant_max)."""
    names = ("input", "block_size", "scale", "zero_point", "input_dtype", "quant_min", "quant_max")
    return tuple(node.args[i] if i < len(node.args) else node.kwargs.get(name) for i, name in enumerate(names))


def _output_dtype(node: Node) -> Any:
    if len(node.args) > 7:
        return node.args[7]
    return node.kwargs.get("output_dtype", torch.float32)


def _value(node: Any) -> torch.Tensor | None:
    value = node.meta.get("val") if isinstance(node, Node) else None
    return value if isinstance(value, torch.Tensor) else None


def _linear_blockwise(
    x: torch.Tensor,
    qdata: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    bias: torch.Tensor | None,
    group_size: int,
    dynamic_int8_activation: bool,
) -> torch.Tensor:
    """``linear(x, (qdata - zero_point) * scale, bias)``, scale and zero point per group of
    ``group_size`` along each row; with ``dynamic_int8_activation``, ``x`` quantized to int8
    per token (asymmetric) and back first."""
    if dynamic_int8_activation:
        x = _per_token_int8(x)
    weight = qdata.to(torch.float32)
    if zero_point is not None:
        weight = weight - zero_point.to(torch.float32).repeat_interleave(group_size, dim=1)
    weight = weight * scale.repeat_interleave(group_size, dim=1)
    return torch.nn.functional.linear(x, weight, bias)


def _linear_blockwise_shape(x: torch.Tensor, qdata: torch.Tensor, *_: Any) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], qdata.shape[0]))


@functools.cache
def linear_blockwise() -> Any:
    """``torch.ops.torchdelegate.linear_blockwise.default``: one operator for a backend to translate,
    its arithmetic (in torch) the reference. Registered on first use, not when torchdelegate is
    imported: with a custom operator registered, every program loaded leaves a few KiB behind
    in torch (torch 2.13)."""
    op = torch.library.custom_op("torchdelegate::linear_blockwise", mutates_args=())(_linear_blockwise)
    op.register_fake(_linear_blockwise_shape)
    return torch.ops.torchdelegate.linear_blockwise.default


def _per_token_int8(x: torch.Tensor) -> torch.Tensor:
    low = torch.clamp(x.amin(dim=-1, keepdim=True), max=0)
    high = torch.clamp(x.amax(dim=-1, keepdim=True), min=0)
    scale = torch.clamp((high - low) / 255, min=torch.finfo(x.dtype).smallest_normal)  # torchao's arithmetic
    zero = torch.clamp(-128 - torch.round(low / scale), -128, 127)
    return (torch.clamp(torch.round(x * (1.0 / scale)) + zero, -128, 127) - zero) * scale


def with_blockwise_linears(program: ExportedProgram) -> tuple[ExportedProgram, int]:
    """A copy of ``program`` whose quantized linear layers are each one ``linear_blockwise``
    (its tensors shared), and how many there were; ``program`` itself when there are none."""
    return rewritten(program, quantized_linears(program), _replace)


def rewritten(
    program: ExportedProgram, found: Sequence[Found], replace: Callable[[Graph, Found, dict[str, Node]], None]
) -> tuple[ExportedProgram, int]:
    """A copy of ``program`` (its tensors shared) with ``replace`` applied to each of ``found`` (read from
    ``program``'s graph; ``replace`` finds the copy's nodes by name), the nodes left unused removed; and
    how many; ``program`` itself when ``found`` is empty."""
    if not found:
        return program, 0
    graph, attrs = copy_graph(program.graph_module)
    by_name = {node.name: node for node in graph.nodes}
    for item in found:
        replace(graph, item, by_name)
    graph.eliminate_dead_code()
    graph.lint()
    return program_around(program, graph, attrs), len(found)


Found = TypeVar("Found")


def _replace(graph: Graph, layer: QuantizedLinear, by_name: dict[str, Node]) -> None:
    """The copy's nodes of ``layer`` replaced by one call, under the linear's name."""

    def mine(node: Node | None) -> Node | None:
        return None if node is None else by_name[node.name]

    linear = by_name[layer.linear.name]
    arguments = [mine(n) for n in (layer.source, layer.qdata, layer.scale, layer.zero_point, layer.bias)]
    with graph.inserting_before(linear):
        call = graph.call_function(
            linear_blockwise(),
            (*arguments, layer.group_size, bool(layer.activation)),
        )
    copy_meta(linear, call)
    stand_for(call, [by_name[node.name] for node in layer.nodes if node.name in by_name])
    linear.replace_all_uses_with(call)
    graph.erase_node(linear)
    keep_name(graph, call, layer.linear.name)
