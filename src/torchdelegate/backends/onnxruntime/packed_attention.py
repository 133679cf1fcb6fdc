"""Attention that reads its query, key and value as one packed input.

Once the query, key and value projections of a layer are one ``MatMulNBits`` whose output a
``Split`` cuts in three (``blockwise.py`` joins them), ``GroupQueryAttention`` can read the
product as it is: its first input may hold ``[B, S, (heads + 2 * kv heads) * head size]``, with
no key and no value given. The ``Split`` leaves the model, and with it a node and three copies
per layer and token.
"""

from __future__ import annotations

from typing import Any

_STANDARD = ("", "ai.onnx")


def packed_attention_inputs(model: Any) -> int:
    """Make each ``GroupQueryAttention`` whose query, key and value are, in that order, the outputs
    of one ``Split`` of a rank-3 value along its last axis, into heads-wide parts only it reads,
    read that value packed instead; how many were."""
    count = 0
    for node in list(model.graph):
        if node.op_type != "GroupQueryAttention" or node.domain != "com.microsoft":
            continue
        split = _packing_split(model, node)
        if split is None:
            continue
        sizes = split.inputs[1]
        node.replace_input_with(0, split.inputs[0])
        node.replace_input_with(1, None)
        node.replace_input_with(2, None)
        model.graph.remove(split, safe=True)
        if sizes.is_initializer() and not sizes.uses():
            model.graph.initializers.pop(sizes.name)
        count += 1
    return count


def _packing_split(model: Any, attention: Any) -> Any:
    """The ``Split`` whose outputs are exactly ``attention``'s query, key and value; None if there is none."""
    query, key, value = [*attention.inputs, None, None, None][:3]
    split = None if query is None else query.producer()
    if split is None or split.op_type != "Split" or split.domain not in _STANDARD or len(split.inputs) != 2:
        return None
    if list(split.outputs) != [query, key, value]:
        return None
    if any(len(part.uses()) != 1 or part in model.graph.outputs for part in split.outputs):
        return None
    sizes = split.inputs[1]
    rank = None if query.shape is None else len(query.shape)  # a part's rank is the packed value's
    axis = split.attributes.get("axis")
    if rank != 3 or axis is None or axis.as_int() not in (-1, 2) or sizes.const_value is None:
        return None
    heads = attention.attributes["num_heads"].as_int()
    kv_heads = attention.attributes["kv_num_heads"].as_int()
    widths = [int(width) for width in sizes.const_value.numpy().reshape(-1)]
    if len(widths) != 3 or widths[0] % heads:
        return None
    head_size = widths[0] // heads
    return split if widths[1:] == [kv_heads * head_size] * 2 else None
