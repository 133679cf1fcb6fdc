"""A large float weight's product as products over blocks of its rows, each block a range of the one
named data that holds the weight.

ONNX Runtime packs a weight once for each branch that reads it (prefill's and decode's) and lets the
second copy go only once both exist; the float head of a language model (an embedding table tied to
it, say) is the largest, and its second copy passed the end of a load by its whole size. As blocks,
at most one block's copy is ever extra. The file keeps the weight once: each block's initializer
reads ``ROW_BLOCK`` bytes or fewer of it from an offset (its header entry's ``offset``; ``session.py``
hands ONNX Runtime that range of the mapped file as a file of its own), so nothing is copied when
lowering either.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any

from torchdelegate.backends.onnxruntime.blockwise import LARGEST_PACKED
from torchdelegate.backends.onnxruntime.ir_edits import replace_node

ROW_BLOCK = 16 * 1024 * 1024
"""Bytes of a float weight one product reads at most, for weights past ``LARGEST_PACKED``."""
_ROW_MULTIPLE = 16  # rows per block a multiple of this: each block's offset stays 64-byte aligned
_TRANSPOSED = {"transA": 0, "transB": 1, "alpha": 1.0}
_DEFAULTS = {"transA": 0, "transB": 0, "alpha": 1.0, "transBatchA": 0, "transBatchB": 0}  # FusedMatMul's


@dataclass(frozen=True)
class RowBlock:
    """A block's initializer: rows of the weight named ``weight`` (its tensor: ``tensor``) from byte ``offset``."""

    weight: str
    tensor: Any
    offset: int


def row_block_products(ir: ModuleType, model: Any) -> dict[str, RowBlock]:
    """Rewrite each ``FusedMatMul(x, w, transB=1)`` whose float weight (an initializer ``[N, K]``) is past
    ``LARGEST_PACKED`` into one product per block of ``w``'s rows, joined by a ``Concat``; each block's
    initializer name, with the weight it is part of."""
    blocks: dict[str, RowBlock] = {}
    made: dict[str, list[Any]] = {}  # each weight's block initializers, shared by every product of it
    for node in list(model.graph):
        weight = _large_weight(ir, node)
        if weight is None:
            continue
        if weight.name not in made:
            made[weight.name] = _blocks(ir, model, weight, blocks)
        outputs = []
        for block in made[weight.name]:
            product = ir.node("FusedMatMul", [node.inputs[0], block], _TRANSPOSED, domain="com.microsoft")
            model.graph.insert_before(node, product)
            outputs.append(product.outputs[0])
        replace_node(model, node, ir.node("Concat", outputs, {"axis": -1}))
        if not weight.uses() and weight not in model.graph.outputs:
            model.graph.initializers.pop(weight.name)
    return blocks


def _blocks(ir: ModuleType, model: Any, weight: Any, blocks: dict[str, RowBlock]) -> list[Any]:
    """``weight``'s blocks of rows as initializers (views of its array), recorded in ``blocks``."""
    tensor = weight.const_value
    rows, columns = (int(d) for d in tensor.shape)
    row_bytes = columns * int(tensor.dtype.itemsize)
    step = max(_ROW_MULTIPLE, ROW_BLOCK // row_bytes // _ROW_MULTIPLE * _ROW_MULTIPLE)
    array = tensor.numpy()
    values = []
    for start in range(0, rows, step):
        name = f"{weight.name}.rows{start}"
        block = ir.Value(name=name, const_value=ir.tensor(array[start : start + step], name=name))
        model.graph.register_initializer(block)
        blocks[name] = RowBlock(weight.name, tensor, start * row_bytes)
        values.append(block)
    return values


def _large_weight(ir: ModuleType, node: Any) -> Any:
    """The weight of ``node`` if it is a ``FusedMatMul`` reading a 2-D float initializer past
    ``LARGEST_PACKED`` transposed (as ``initializers.read_weights_in_place`` makes them); None otherwise."""
    if node.op_type != "FusedMatMul" or node.domain != "com.microsoft" or len(node.inputs) != 2:
        return None
    attributes = {key: attribute.value for key, attribute in node.attributes.items()}
    if {**_DEFAULTS, **attributes} != {**_DEFAULTS, **_TRANSPOSED}:
        return None
    weight = node.inputs[1]
    tensor = weight.const_value if weight is not None and weight.is_initializer() else None
    if tensor is None or tensor.dtype != ir.DataType.FLOAT or len(tensor.shape) != 2:
        return None
    return weight if tensor.nbytes > LARGEST_PACKED else None
