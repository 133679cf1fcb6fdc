"""Quantized linear layers on ONNX Runtime's integer kernel, ``com.microsoft::MatMulNBits``.

torch's exporter has no translation for torchao's quantization ops, so a partition's quantized
layers become ``torchdelegate::linear_blockwise`` first (``quantization.linear``), which exports
as a private ``torchdelegate::LinearBlockwise`` node; once the model is optimized and its weights
are initializers again, each such node becomes ``MatMulNBits`` over its integers packed as the
kernel reads them (4 or 8 bits, low nibble first, offset by half the range) and the layer's own
scales. The private node never reaches ONNX Runtime.

Dynamic int8 activations (8da4w) run on the kernel's int8 arithmetic (``accuracy_level`` 4),
which quantizes each block of an activation row symmetrically where torchao quantizes each row
asymmetrically: outputs differ from torchao's by that rounding. Weight-only int4 layers compute in
float (``accuracy_level`` 1). Weight-only int8 layers run on the int8 arithmetic too: the kernel has
no float arithmetic for 8 bits, and dequantizes the whole weight at every call instead (0.3 s for a
49152 x 576 head against 4 ms). Scales are stored as float32, as the kernel packs them: a narrower
copy would need a float32 one made at load, which ONNX Runtime keeps beside the packed weights.

This module says which layers and embeddings the kernels hold (``runs_on_kernel``,
``lookup_runs_on_kernel``: the partitioner asks) and rewrites the private nodes into the kernels
(``kernel_products``); the private nodes and their schemas are ``blockwise_translation``'s, the
integers packed as the kernels read them ``nbits_packing``'s.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import numpy as np
import torch

from torchdelegate.backends.onnxruntime.blockwise_translation import DOMAIN, LINEAR_NODE, LOOKUP_NODE
from torchdelegate.backends.onnxruntime.ir_edits import replace_node, take_place
from torchdelegate.backends.onnxruntime.nbits_packing import kernel_bits, packed_integers, packed_points
from torchdelegate.exported.mapped_pages import release_buffer
from torchdelegate.exported.spilled_tensors import SpilledTensors
from torchdelegate.quantization.embedding import QuantizedEmbedding
from torchdelegate.quantization.linear import QuantizedLinear

_KERNEL_DOMAIN = "com.microsoft"
LARGEST_PACKED = 64 * 1024 * 1024
"""Bytes of packed integers one ``MatMulNBits`` holds at most: a larger weight runs as blocks of rows."""


def block_size(group_size: int, in_features: int) -> int | None:
    """The kernel's block for groups of ``group_size`` along ``in_features``: for one group per row
    (per-channel scales) 128, or the smallest power of two >= 16 that covers the row (the scale
    repeated for every block: the kernel is slower on longer blocks); else the group itself when
    it is a power of two of at least 16; None when the kernel cannot hold it."""
    if group_size == in_features:
        return min(128, max(16, 1 << (in_features - 1).bit_length()))
    if group_size >= 16 and group_size & (group_size - 1) == 0:
        return group_size
    return None


def lookup_block(group_size: int, columns: int) -> int | None:
    """``GatherBlockQuantized``'s block for an embedding in groups of ``group_size`` along rows of
    ``columns``: for one scale per row, the largest power of two from 128 to 16 that divides the row
    (the scale repeated for every block: a row of 576 takes blocks of 64); else :func:`block_size`'s,
    where it divides a row (the kernel does not pad); else None. Without it, ONNX Runtime would fold
    the dequantized table into a float copy, four times the int8 table's size, per branch."""
    if group_size == columns:
        return next((block for block in (128, 64, 32, 16) if columns % block == 0), None)
    block = block_size(group_size, columns)
    return block if block is not None and columns % block == 0 else None


def lookup_runs_on_kernel(lookup: QuantizedEmbedding) -> bool:
    """Whether ``GatherBlockQuantized`` holds this embedding's groups."""
    return lookup_block(lookup.group_size, lookup.columns) is not None


def runs_on_kernel(layer: QuantizedLinear) -> bool:
    """Whether ``MatMulNBits`` holds this layer's groups (its block, or one scale repeated per block)."""
    return block_size(layer.group_size, layer.in_features) is not None


def kernel_products(ir: ModuleType, model: Any) -> dict[str, int]:
    """Rewrite every ``LinearBlockwise`` node of ``model`` (weights as initializers) into
    ``MatMulNBits`` and every ``EmbeddingBlockwise`` into ``GatherBlockQuantized``; how many of each
    there were (kernels with none left out). Integers and zero points it no longer reads leave the model."""
    rewrite = _Rewrite(ir, model)
    readers: dict[Any, list[Any]] = {}
    lookups = []
    for node in list(model.graph):
        if node.op_type == LINEAR_NODE and node.domain == DOMAIN:
            readers.setdefault(node.inputs[0], []).append(node)
        elif node.op_type == LOOKUP_NODE and node.domain == DOMAIN:
            lookups.append(node)
    count = 0
    for layers in readers.values():
        for bits, alike in _alike(layers):
            if len(alike) < 2 or not rewrite.joined(alike, bits):
                for node in alike:
                    rewrite.layer(node, bits)
        count += len(layers)
    for node in lookups:
        rewrite.lookup(node)
    if count or lookups:
        model.opset_imports.setdefault(_KERNEL_DOMAIN, 1)
        model.opset_imports.pop(DOMAIN, None)
        for value in list(model.graph.initializers.values()):
            if not value.uses() and value not in model.graph.outputs:
                model.graph.initializers.pop(value.name)
    made = {"MatMulNBits": count, "GatherBlockQuantized": len(lookups)}
    return {kernel: number for kernel, number in made.items() if number}


def _alike(layers: list[Any]) -> list[tuple[int | None, list[Any]]]:
    """``layers`` (which read one input) in groups of one kernel setting each, in graph order, with
    their bits (None when a layer's integers are not a weight): a decoder layer's query and key
    projections in int4 and its value projection in int8 are two. Each weight's integers are scanned
    for their bits here, once."""
    groups: dict[tuple[Any, ...], list[Any]] = {}
    for node in layers:
        _, qdata, _, zero_point, bias = [*node.inputs, None, None][:5]
        points = None if zero_point is None or zero_point.const_value is None else _constant(zero_point, "points")
        bits = None if qdata.const_value is None else kernel_bits(_constant(qdata, "integers"), points)
        group, activation = node.attributes["group_size"].as_int(), node.attributes["dynamic_int8_activation"].as_int()
        groups.setdefault((bits, group, activation, bias is None), []).append(node)
    return [(key[0], members) for key, members in groups.items()]


class _Rewrite:
    """The kernel's tensors of one model, each made once: layers that read one weight (a module
    called twice) share its packed integers, scales and zero points."""

    def __init__(self, ir: ModuleType, model: Any) -> None:
        self.ir, self.model = ir, model
        self.made: dict[tuple[str, str], Any] = {}
        self.spilled = SpilledTensors()

    def _initializer(self, name: str, array: np.ndarray, spilled: bool = False) -> Any:
        """A new initializer of ``array``'s values, spilled to a file when large (unless ``spilled``
        already): the packed forms of a model's weights are never all in memory at once."""
        return _initializer(self.ir, self.model, name, array if spilled else self.spilled.array(array))

    def _packed(self, integers: np.ndarray, block: int, bits: int) -> np.ndarray:
        """:func:`packed_integers` into a spilled array: a weight's packed form is never whole in memory."""
        rows, columns = integers.shape
        shape = (rows, -(-columns // block), block * bits // 8)
        return packed_integers(integers, block, bits, self.spilled.empty(shape, torch.uint8).numpy())

    def layer(self, node: Any, bits: int | None) -> None:
        """``node`` as one ``MatMulNBits`` (or blocks of rows) of ``bits`` as ``_alike`` found them (None
        only where the integers are not a weight, which reading them refuses)."""
        x, qdata, scale, zero_point, bias = [*node.inputs, None, None][:5]
        group = node.attributes["group_size"].as_int()
        integers = _constant(qdata, "integers")
        rows, columns = integers.shape
        block = block_size(group, columns)
        if block is None:
            raise ValueError(
                f"groups of {group} along {columns} inputs: MatMulNBits takes blocks of a power of two >= 16; "
                "quantize with such a group size, or keep this layer in float"
            )
        points = None if zero_point is None else _constant(zero_point, "zero points")
        assert bits is not None  # the integers are a weight: _alike scanned them
        blocks = -(-columns // block)
        key = f"{qdata.name}/{block}/{bits}"
        inputs = [x, self._made(key, "packed", lambda: self._packed(integers, block, bits), spilled=True)]
        release_buffer(integers)
        inputs.append(self._scales(node, scale, rows, blocks, block != group))
        if points is not None and points.any():
            repeated = points if block == group else np.repeat(points.reshape(rows, 1), blocks, axis=1)
            inputs.append(self._made(f"{zero_point.name}/{key}", "zero_points", lambda: packed_points(repeated, bits)))
        elif bias is not None:
            inputs.append(None)
        if bias is not None:
            inputs += [None, bias]  # g_idx, then bias
        activation = node.attributes["dynamic_int8_activation"].as_int()
        replace_node(self.model, node, self._products(node, inputs, columns, rows, bits, block, activation))
        release_buffer(_constant(scale, "scales"))
        if points is not None:
            release_buffer(points)

    def lookup(self, node: Any) -> None:
        """An ``EmbeddingBlockwise`` node as ``GatherBlockQuantized`` over the table's integers packed
        as the kernel reads them (MatMulNBits's layout: 4 or 8 bits, offset by half the range, with
        zero points), its scales per block: only the rows read are dequantized."""
        indices, qdata, scale, zero_point = [*node.inputs, None][:4]
        group = node.attributes["group_size"].as_int()
        integers = _constant(qdata, "integers")
        rows, columns = integers.shape
        block = lookup_block(group, columns)
        if block is None:
            raise ValueError(
                f"an embedding in groups of {group} along {columns} values: GatherBlockQuantized takes blocks of a "
                "power of two >= 16 that divide a row; quantize it with such a group size, or keep it in float"
            )
        points = np.zeros((rows, columns // group), np.int8) if zero_point is None else _constant(zero_point, "points")
        bits = kernel_bits(integers, points)
        blocks = columns // block
        packed = self._packed(integers, block, bits).reshape(rows, blocks * block * bits // 8)
        release_buffer(integers)
        scales = _constant(scale, "scales").reshape(rows, -1)
        if block != group:
            scales = np.repeat(scales, blocks, axis=1)
            points = np.repeat(points.reshape(rows, 1), blocks, axis=1)
        inputs = [
            self._initializer(f"{qdata.name}/{block}/{bits}.rows", packed, spilled=True),
            indices,
            self._initializer(f"{scale.name}/{block}.row_scales", np.ascontiguousarray(scales, dtype=np.float32)),
            self._initializer(f"{qdata.name}/{block}/{bits}.row_points", packed_points(points, bits)),
        ]
        attributes = {"gather_axis": 0, "quantize_axis": 1, "block_size": block, "bits": bits}
        gather = self.ir.node("GatherBlockQuantized", inputs, attributes, domain=_KERNEL_DOMAIN)
        replace_node(self.model, node, gather)
        for read in (_constant(scale, "scales"), points if zero_point is None else _constant(zero_point, "points")):
            release_buffer(read)

    def joined(self, layers: list[Any], bits: int | None) -> bool:
        """Layers that read one input with one kernel setting (a decoder layer's query, key and value
        projections; its gate and up projections) as one ``MatMulNBits`` over their rows stacked, its
        output split back: one call instead of several small ones. False, with nothing changed, when
        their settings differ or one reads a weight another layer reads too. Zero points, where any
        layer has them, are stacked as the rows are (zeros for a layer without)."""
        if bits is None:
            return False
        parts, settings = [], set()
        for node in layers:
            _, qdata, scale, zero_point, bias = [*node.inputs, None, None][:5]
            if len(qdata.uses()) != 1:
                return False
            points = None if zero_point is None else _constant(zero_point, "zero points")
            integers = _constant(qdata, "integers")
            group = node.attributes["group_size"].as_int()
            if block_size(group, integers.shape[1]) != group:
                return False
            activation = node.attributes["dynamic_int8_activation"].as_int()
            settings.add((integers.shape[1], group, bits, activation, bias is None))
            scales = _constant(scale, "scales").reshape(integers.shape[0], -1)
            points = None if points is None or not points.any() else points.reshape(scales.shape)
            parts.append((integers, scales, points, None if bias is None else _constant(bias, "bias")))
        if len(settings) != 1:
            return False
        columns, block, bits, activation, unbiased = settings.pop()
        first, name = layers[0], "+".join(node.inputs[1].name for node in layers)
        total = sum(integers.shape[0] for integers, *_ in parts)
        packed = self.spilled.empty((total, columns // block, block * bits // 8), torch.uint8).numpy()
        start = 0
        for integers, scales, _, _ in parts:
            packed_integers(integers, block, bits, packed[start : start + integers.shape[0]])
            start += integers.shape[0]
            release_buffer(scales)
        inputs = [first.inputs[0], self._initializer(f"{name}/{block}/{bits}.packed", packed, spilled=True)]
        scales = np.concatenate([scales for _, scales, _, _ in parts])
        inputs.append(self._initializer(f"{name}.scales", scales))
        if any(points is not None for _, _, points, _ in parts):
            stacked = np.concatenate([np.zeros(s.shape, np.int8) if p is None else p for _, s, p, _ in parts])
            inputs.append(self._initializer(f"{name}/{bits}.zero_points", packed_points(stacked, bits)))
        elif not unbiased:
            inputs.append(None)
        if not unbiased:
            biases = np.concatenate([bias for *_, bias in parts if bias is not None])
            inputs += [None, self._initializer(f"{name}.bias", biases)]
        rows = [integers.shape[0] for integers, *_ in parts]
        product = self._product(inputs, columns, sum(rows), bits, block, activation)
        sizes = self._initializer(f"{name}.rows", np.array(rows, dtype=np.int64))
        split = self.ir.node("Split", [product.outputs[0], sizes], {"axis": -1}, num_outputs=len(layers))
        self.model.graph.insert_before(first, product)
        self.model.graph.insert_before(first, split)
        for node, output in zip(layers, split.outputs, strict=True):
            take_place(self.model, node.outputs[0], output)
            self.model.graph.remove(node, safe=True)
        return True

    def _products(
        self, node: Any, inputs: list[Any], columns: int, rows: int, bits: int, block: int, activation: int
    ) -> Any:
        """The layer's ``MatMulNBits``; for a weight whose packed integers pass ``LARGEST_PACKED`` (an
        LLM's head), one per block of rows, their outputs joined by a ``Concat``.

        ONNX Runtime packs a weight once for each branch that reads it (prefill's and decode's) and
        lets the second copy go only once the first is found: a load's peak passes its end by the
        largest packed weight, which blocks of rows keep small."""
        per_row = -(-columns // block) * block * bits // 8
        count = -(-rows * per_row // LARGEST_PACKED)
        if count <= 1:
            return self._product(inputs, columns, rows, bits, block, activation)
        step = -(-rows // count)
        outputs = []
        for start in range(0, rows, step):
            stop = min(start + step, rows)
            part = [inputs[0], *(None if v is None else self._rows(v, rows, start, stop) for v in inputs[1:])]
            product = self._product(part, columns, stop - start, bits, block, activation)
            self.model.graph.insert_before(node, product)
            outputs.append(product.outputs[0])
        return self.ir.node("Concat", outputs, {"axis": -1})

    def _rows(self, value: Any, rows: int, start: int, stop: int) -> Any:
        """Rows ``start:stop`` of the initializer ``value`` (``rows`` rows, however it is shaped), a view
        of its array, made once."""

        def view() -> np.ndarray:
            array = _constant(value, "rows")
            return (array if array.shape[0] == rows else array.reshape(rows, -1))[start:stop]

        return self._made(value.name, f"rows{start}-{stop}", view, True)

    def _product(self, inputs: list[Any], columns: int, rows: int, bits: int, block: int, activation: int) -> Any:
        """The ``MatMulNBits`` node: int8 arithmetic (``accuracy_level`` 4) for dynamic int8 activations
        and for 8-bit weights, float otherwise."""
        attributes = {"K": int(columns), "N": int(rows), "bits": bits, "block_size": block}
        attributes["accuracy_level"] = 4 if activation or bits == 8 else 1
        return self.ir.node("MatMulNBits", inputs, attributes, domain=_KERNEL_DOMAIN)

    def _made(self, key: str, kind: str, array: Callable[[], np.ndarray], spilled: bool = False) -> Any:
        value = self.made.get((key, kind))
        if value is None:
            value = self.made[(key, kind)] = self._initializer(f"{key}.{kind}", array(), spilled)
        return value

    def _scales(self, node: Any, scale: Any, rows: int, blocks: int, repeated: bool) -> Any:
        """The kernel's float scales ``[N, blocks]``: the layer's own, or one per row repeated for
        every block when ``repeated``."""
        made = self.made.get((scale.name, f"scales/{blocks}"))
        if made is None:
            made = scale
            if repeated:
                scales = _constant(scale, "scales").reshape(rows, -1)
                made = self._initializer(f"{scale.name}.blocks", np.repeat(scales, blocks, axis=1))
            self.made[(scale.name, f"scales/{blocks}")] = made
        return made


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
