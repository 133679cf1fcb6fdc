"""Quantized linear layers on ONNX Runtime's integer kernel, ``com.microsoft::MatMulNBits``.

torch's exporter has no translation for torchao's quantization ops, so a partition's quantized
layers become ``torchdelegate::linear_blockwise`` first (``quantization.linear``), which exports
as a private ``torchdelegate::LinearBlockwise`` node; once the model is optimized and its weights
are initializers again, each such node becomes ``MatMulNBits`` over its integers packed as the
kernel reads them (4 or 8 bits, low nibble first, offset by half the range) and the layer's own
scales. The private node never reaches ONNX Runtime.

Dynamic int8 activations (8da4w) run on the kernel's int8 arithmetic (``accuracy_level`` 4),
which quantizes each block of an activation row symmetrically where torchao quantizes each row
asymmetrically: outputs differ from torchao's by that rounding. Weight-only layers compute in
float (``accuracy_level`` 1): outputs equal torchao's up to float rounding.
"""

from __future__ import annotations

from functools import cache
from types import ModuleType
from typing import Any

import numpy as np

from torchdelegate.quantization.linear import QuantizedLinear, linear_blockwise

DOMAIN = "torchdelegate"
_NODE = "LinearBlockwise"
_KERNEL_DOMAIN = "com.microsoft"
_ROWS_PER_STEP = 4096  # rows packed at a time: the temporaries stay a slice of a weight


def block_size(group_size: int, in_features: int) -> int | None:
    """The kernel's block for groups of ``group_size`` along ``in_features``: the group itself when
    it is a power of two of at least 16; for one group per row (per-channel scales) 128, or the
    smallest power of two >= 16 that covers the row; None when the kernel cannot hold it."""
    if group_size >= 16 and group_size & (group_size - 1) == 0:
        return group_size
    if group_size == in_features:
        return min(128, max(16, 1 << (in_features - 1).bit_length()))
    return None


def runs_on_kernel(layer: QuantizedLinear) -> bool:
    """Whether ``MatMulNBits`` computes this layer exactly as it is quantized."""
    rows, columns = layer.shape
    return block_size(layer.group_size, columns) is not None


@cache
def translations() -> dict[Any, Any]:
    """The exporter's translation of ``linear_blockwise``: one private node, rewritten later."""
    onnx = __import__("onnx")
    values = __import__("onnxscript.values", fromlist=["Op", "Opset"])
    schema = onnx.defs.OpSchema
    optional = schema.FormalParameterOption.Optional
    onnx.defs.register_schema(
        schema(
            _NODE,
            DOMAIN,
            1,
            doc="torchdelegate's quantized linear layer, rewritten to MatMulNBits before a model is stored",
            inputs=[
                schema.FormalParameter("x", "T"),
                schema.FormalParameter("qdata", "Q"),
                schema.FormalParameter("scale", "T"),
                schema.FormalParameter("zero_point", "Z", param_option=optional),
                schema.FormalParameter("bias", "T", param_option=optional),
            ],
            outputs=[schema.FormalParameter("y", "T")],
            type_constraints=[
                ("T", ["tensor(float)"], "float activations, scales and bias"),
                ("Q", ["tensor(int8)"], "the integers, one per int8"),
                ("Z", ["tensor(int8)", "tensor(int16)", "tensor(int32)", "tensor(int64)"], "integer zero points"),
            ],
            attributes=[
                schema.Attribute("group_size", schema.AttrType.INT, "values per scale along a row"),
                schema.Attribute("dynamic_int8_activation", schema.AttrType.INT, "1: activations quantized to int8"),
            ],
        )
    )
    node = values.Op(values.Opset(DOMAIN, 1), _NODE)

    def translate(
        x: Any,
        qdata: Any,
        scale: Any,
        zero_point: Any = None,
        bias: Any = None,
        group_size: int = 32,
        dynamic_int8_activation: bool = False,
    ) -> Any:
        activation = int(dynamic_int8_activation)
        return node(x, qdata, scale, zero_point, bias, group_size=group_size, dynamic_int8_activation=activation)

    return {linear_blockwise(): translate}


def kernel_products(ir: ModuleType, model: Any) -> int:
    """Rewrite every ``LinearBlockwise`` node of ``model`` (weights as initializers) into
    ``MatMulNBits``; how many there were. Integers and zero points it no longer reads leave the model."""
    count = 0
    for node in list(model.graph):
        if node.op_type != _NODE or node.domain != DOMAIN:
            continue
        _rewrite(ir, model, node)
        count += 1
    if count:
        model.opset_imports.setdefault(_KERNEL_DOMAIN, 1)
        model.opset_imports.pop(DOMAIN, None)
        for value in list(model.graph.initializers.values()):
            if not value.uses() and value not in model.graph.outputs:
                model.graph.initializers.pop(value.name)
    return count


def _rewrite(ir: ModuleType, model: Any, node: Any) -> None:
    x, qdata, scale, zero_point, bias = [*node.inputs, None, None][:5]
    group = node.attributes["group_size"].as_int()
    dynamic = node.attributes["dynamic_int8_activation"].as_int()
    integers = _constant(qdata, "integers")
    rows, columns = integers.shape
    block = block_size(group, columns)
    if block is None:
        raise ValueError(f"groups of {group} along {columns} inputs: MatMulNBits takes blocks of a power of two >= 16")
    points = None if zero_point is None else _constant(zero_point, "zero points")
    narrow = all(-8 <= a.min(initial=0) and a.max(initial=0) <= 7 for a in (integers, points) if a is not None)
    bits = 4 if narrow else 8
    blocks = -(-columns // block)
    scales = _constant(scale, "scales").reshape(rows, -1)
    if block != group:  # one scale per row, repeated for every block
        scales = np.repeat(scales, blocks, axis=1)
        if points is not None:
            points = np.repeat(points.reshape(rows, 1), blocks, axis=1)
    scales_value = _stored_scales(ir, model, node, scale, scales, block != group)
    inputs = [x, _initializer(ir, model, f"{qdata.name}.packed", _packed(integers, block, bits)), scales_value]
    if points is not None and points.any():
        inputs.append(_initializer(ir, model, f"{qdata.name}.zero_points", _packed_points(points, bits)))
    elif bias is not None:
        inputs.append(None)
    if bias is not None:
        inputs += [None, bias]  # g_idx, then bias
    attributes = {
        "K": int(columns),
        "N": int(rows),
        "bits": bits,
        "block_size": block,
        "accuracy_level": 4 if dynamic else 1,
    }
    product = ir.node("MatMulNBits", inputs, attributes, domain=_KERNEL_DOMAIN)
    model.graph.insert_before(node, product)
    old, new = node.outputs[0], product.outputs[0]
    old.replace_all_uses_with(new, replace_graph_outputs=True)
    name, old.name = old.name, None
    new.name, new.shape, new.type = name, old.shape, old.type
    model.graph.remove(node, safe=True)


def _stored_scales(ir: ModuleType, model: Any, node: Any, scale: Any, scales: np.ndarray, derived: bool) -> Any:
    """The kernel's float scales: stored as float16 and cast back when every one survives the trip
    (the file holds half the bytes; each scale moves by at most 2^-11 of itself), else as they are."""
    halves = scales.astype(np.float16)
    tiny = np.finfo(np.float16).tiny
    exact_enough = np.all(np.isfinite(halves)) and np.all((np.abs(scales) >= tiny) | (scales == 0))
    if not exact_enough:
        return _initializer(ir, model, f"{scale.name}.blocks", scales) if derived else scale
    stored = _initializer(ir, model, f"{scale.name}.float16", halves)
    cast = ir.node("Cast", [stored], {"to": ir.DataType.FLOAT})
    model.graph.insert_before(node, cast)
    return cast.outputs[0]


def _constant(value: Any, what: str) -> np.ndarray:
    tensor = None if value is None else value.const_value
    if tensor is None:
        raise ValueError(f"the quantized layer's {what} ({getattr(value, 'name', None)}) are not a weight of the model")
    return np.asarray(tensor.numpy())


def _initializer(ir: ModuleType, model: Any, name: str, array: np.ndarray) -> Any:
    value = ir.Value(name=name, shape=ir.Shape(array.shape), type=ir.TensorType(ir.DataType.from_numpy(array.dtype)))
    value.const_value = ir.Tensor(array, name=name)
    model.graph.register_initializer(value)
    return value


def _packed(integers: np.ndarray, block: int, bits: int) -> np.ndarray:
    """``[N, blocks, block * bits / 8]`` uint8: each value plus half the range (so int4's -8 is 0),
    two per byte low nibble first at 4 bits; a row's last block padded with zeros of the layer."""
    rows, columns = integers.shape
    blocks = -(-columns // block)
    offset = 1 << (bits - 1)
    packed = np.empty((rows, blocks, block * bits // 8), dtype=np.uint8)
    for start in range(0, rows, _ROWS_PER_STEP):
        stop = min(rows, start + _ROWS_PER_STEP)
        unsigned = np.full((stop - start, blocks * block), offset, dtype=np.uint8)
        np.add(integers[start:stop].view(np.uint8), offset, out=unsigned[:, :columns], casting="unsafe")
        if bits == 4:
            unsigned &= 0x0F
            unsigned = unsigned[:, 0::2] | (unsigned[:, 1::2] << 4)
        packed[start:stop] = unsigned.reshape(stop - start, blocks, -1)
    return packed


def _packed_points(points: np.ndarray, bits: int) -> np.ndarray:
    """Zero points as the kernel reads them: ``[N, ceil(blocks * bits / 8)]`` uint8, offset as the values are."""
    offset = 1 << (bits - 1)
    unsigned = (points.astype(np.int16) + offset).astype(np.uint8)
    if bits == 8:
        return unsigned
    if unsigned.shape[1] % 2:
        unsigned = np.concatenate([unsigned, np.full((unsigned.shape[0], 1), offset, np.uint8)], axis=1)
    return (unsigned[:, 0::2] & 0x0F) | (unsigned[:, 1::2] << 4)
