"""Attention over a static KV cache as ONNX Runtime's ``GroupQueryAttention``.

torch's exporter writes a decoder layer's attention as the model computes it: query, key and
value reshaped to heads and transposed, rotary embeddings as slices, negations and products,
the new keys and values scattered into the cache (``cache_writes``), the cache's key-value heads
repeated for every query head (``Expand``: a copy of the whole cache per layer and token),
scaled products, a mask, a softmax and a guard for rows the mask hides whole. ONNX Runtime's
``com.microsoft::GroupQueryAttention`` does all of it in one kernel: it rotates the query and the
new keys from cos and sin tables, writes the new keys and values into the cache at the
positions after those it holds, and attends to the cache's key-value heads in place.

:func:`fused_attention` finds that computation in a model and replaces it by the kernel when
every part is as expected: the cache ``[1, kv heads, positions, head size]`` is a model input
that only the scatter reads, the rotation is the half-split one (``rotate_half``) from one cos
and sin of ``positions * inv_freq``, the positions are those the cache is written at, the mask
adds to the scores, and the output goes back to ``[batch, tokens, hidden]``. The model's positions
are ``cache_position[0] + arange(tokens)`` (transformers' static cache), so the kernel's own
(the cache's length so far, then the new tokens in order) are the same. Whatever differs is left
as it is: the count of layers fused is recorded with the other fusions, and for each layer left, why.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

from torchdelegate.backends.onnxruntime.ir_edits import take_place
from torchdelegate.backends.onnxruntime.settings import require

_STANDARD = ("", "ai.onnx")
_HEAD_SIZE_MULTIPLE = 16
"""ONNX Runtime's CPU ``GroupQueryAttention`` refuses other head sizes when it runs (not when it loads)."""
_HEADS_FIRST = [0, 2, 1, 3]


@dataclass(frozen=True)
class _Layer:
    """One layer's attention as found: what the kernel reads, and the values it replaces."""

    query: Any  # [B, S, H * D], before the rotation
    key: Any  # [B, S, KVH * D]
    value: Any
    past_key: Any  # model inputs [B, KVH, max, D]
    past_value: Any
    inverse_frequencies: Any  # [D / 2] (any shape of that many values)
    positions: Any  # int64 [S]
    heads: int
    kv_heads: int
    scale: float
    output: Any  # [B, S, H * D]
    present_key: Any  # the scatters' results
    present_value: Any


def fused_attention(ir: ModuleType, model: Any) -> tuple[int, list[str]]:
    """Rewrite each layer's attention over a static KV cache into ``GroupQueryAttention``: how many
    layers, and why the others were left as they are (``"2 layers: <reason>"``, one per reason)."""
    found = list(_layers(model))
    layers = [layer for layer in found if isinstance(layer, _Layer)]
    reasons = Counter(reason for reason in found if isinstance(reason, str))
    tables: dict[tuple[Any, int], tuple[Any, Any]] = {}
    lengths: dict[Any, tuple[Any, Any]] = {}
    for layer in layers:
        key = (layer.inverse_frequencies, int(layer.past_key.shape[2]))
        if key not in tables:
            tables[key] = _cos_sin(ir, model, *key)
        if layer.positions not in lengths:
            lengths[layer.positions] = _lengths(ir, model, layer.positions)
        cos, sin = tables[key]
        seen, total = lengths[layer.positions]
        attention = ir.node(
            "GroupQueryAttention",
            [layer.query, layer.key, layer.value, layer.past_key, layer.past_value, seen, total, cos, sin],
            {
                "num_heads": layer.heads,
                "kv_num_heads": layer.kv_heads,
                "scale": layer.scale,
                "do_rotary": 1,
                "rotary_interleaved": 0,
            },
            domain="com.microsoft",
            num_outputs=3,
        )
        model.graph.insert_before(layer.output.producer(), attention)
        for old, new in zip((layer.output, layer.present_key, layer.present_value), attention.outputs, strict=True):
            take_place(model, old, new)
    if layers:
        model.opset_imports.setdefault("com.microsoft", 1)
        require("onnx_ir.passes.common").RemoveUnusedNodesPass()(model)  # what the kernel replaced, its constants
    return len(layers), [f"{n} layer{'s' * (n > 1)}: {reason}" for reason, n in sorted(reasons.items())]


def _cos_sin(ir: ModuleType, model: Any, inverse_frequencies: Any, rows: int) -> tuple[Any, Any]:
    """``cos`` and ``sin`` of ``position * inv_freq`` for every position of the cache: ``[rows, D / 2]``
    (ONNX Runtime folds them once, when it loads the model)."""
    column = _constant(ir, model, np.arange(rows, dtype=np.float32).reshape(rows, 1), "positions")
    shape = _constant(ir, model, np.array([1, -1], dtype=np.int64), "row")
    row = ir.node("Reshape", [inverse_frequencies, shape])
    angles = ir.node("Mul", [column, row.outputs[0]])
    cos, sin = ir.node("Cos", [angles.outputs[0]]), ir.node("Sin", [angles.outputs[0]])
    _insert_after(model, inverse_frequencies, [row, angles, cos, sin])
    return cos.outputs[0], sin.outputs[0]


def _lengths(ir: ModuleType, model: Any, positions: Any) -> tuple[Any, Any]:
    """The kernel's ``seqlens_k`` (the last position, int32 ``[1]``) and total length (int32 scalar)."""
    one = _constant(ir, model, np.array([1], dtype=np.int64), "one")
    last = ir.node("ReduceMax", [positions], {"keepdims": 1})
    seen = ir.node("Cast", [last.outputs[0]], {"to": ir.DataType.INT32})
    count = ir.node("Add", [last.outputs[0], one])
    scalar = ir.node("Squeeze", [count.outputs[0]])
    total = ir.node("Cast", [scalar.outputs[0]], {"to": ir.DataType.INT32})
    _insert_after(model, positions, [last, seen, count, scalar, total])
    return seen.outputs[0], total.outputs[0]


def _insert_after(model: Any, value: Any, nodes: list[Any]) -> None:
    """``nodes``, in order, right after the node that makes ``value`` (first in the graph for an input)."""
    producer = value.producer()
    for node in nodes:
        if producer is None:
            model.graph.insert_before(model.graph[0], node)
        else:
            model.graph.insert_after(producer, node)
        producer = node


def _constant(ir: ModuleType, model: Any, array: np.ndarray, what: str) -> Any:
    name = f"torchdelegate.attention.{what}.{len(model.graph.initializers)}"
    value = ir.Value(name=name, shape=ir.Shape(array.shape), type=ir.TensorType(ir.DataType.from_numpy(array.dtype)))
    value.const_value = ir.Tensor(array, name=name)
    model.graph.register_initializer(value)
    return value


# Matching: each helper returns None when the graph is not as expected.


def _layers(model: Any) -> Iterator[_Layer | str]:
    """Each write of keys into a cache the model takes as input: the layer that reads them, or why it
    does not fuse. (A write whose result the scores' product reads as values is its layer's value write.)"""
    inputs = set(model.graph.inputs)
    for node in list(model.graph):
        if _is(node, "ScatterND") and node.inputs[0] in inputs and not _read_as_values(node):
            yield _layer(node)


def _read_as_values(write: Any) -> bool:
    repeated = _forward(write.outputs[0], _REPEAT)
    product = _user(repeated, "MatMul")
    return product is not None and product.inputs[1] is repeated


def _is(node: Any, op: str) -> bool:
    return node is not None and node.op_type == op and node.domain in _STANDARD


def _producer(value: Any, op: str) -> Any:
    node = value.producer() if value is not None else None
    return node if _is(node, op) else None


def _layer(key_write: Any) -> _Layer | str:
    """The attention that reads the keys ``key_write`` scatters, if it is the expected one; else why not."""
    past_key, indices, written_keys = key_write.inputs
    if len(past_key.uses()) != 1 or past_key.shape is None or len(past_key.shape) != 4:
        return "the key cache is read by more than its write, or is not [batch, kv heads, positions, head size]"
    batch, kv_heads, rows, size = (past_key.shape[i] for i in range(4))
    if batch != 1 or not all(isinstance(d, int) for d in (kv_heads, rows, size)):
        return "the key cache's batch is not 1, or its sizes are not static"
    if size % _HEAD_SIZE_MULTIPLE:
        return f"the head size {size} is not a multiple of {_HEAD_SIZE_MULTIPLE}, as the kernel needs on CPU"
    transposed = _user(_forward(key_write.outputs[0], _REPEAT), "Transpose")
    if transposed is None or list(transposed.attributes["perm"].as_ints()) != [0, 1, 3, 2]:
        return "the cached keys are not transposed for the product with the queries"
    key_scale = _user(transposed.outputs[0], "Mul")
    scaled_keys = _forward(key_scale.outputs[0]) if key_scale is not None else None
    product = _user(scaled_keys, "MatMul") if scaled_keys is not None else None
    if product is None or product.inputs[1] is not scaled_keys:
        return "the keys are not scaled by a constant before their product with the queries"
    query_scale = _producer(_back(product.inputs[0]), "Mul")
    scales = _scale(key_scale, transposed.outputs[0]), _scale(query_scale)
    if query_scale is None or scales[0] is None or scales[1] is None:
        return "the queries are not scaled by a constant"
    rotated_query = next((v for v in query_scale.inputs if _scalar_of(v) is None), None)
    rotation, key_rotation = _rotation(rotated_query), _rotation(_back(written_keys))
    if rotation is None or key_rotation is None or rotation[1:] != key_rotation[1:]:
        return "queries and keys are not rotated by the half-split rotation (rotate_half) of one cos and sin"
    query, _, _, frequencies, positions = rotation
    attended = _attended(product.outputs[0])
    if attended is None:
        return "the scores are not masked by an addition, a softmax, a product with the values, heads joined"
    if not _writes_at(indices, positions):
        return "the cache is not written at the positions the rotation uses"
    output, repeated_values = attended
    value_write = _producer(_back(repeated_values, _REPEAT), "ScatterND")
    query_flat, key_flat = _heads_of(query), _heads_of(key_rotation[0])
    if value_write is None or value_write.inputs[1] is not indices or query_flat is None or key_flat is None:
        return "the values are not written into their cache where the keys are, or heads are not split by reshape"
    if _forward(value_write.outputs[0], _REPEAT) is not repeated_values:
        return "the product reads other values than those written into the value cache"
    value_flat = _heads_of(_back(value_write.inputs[2]))
    past_value = value_write.inputs[0]
    if value_flat is None or len(past_value.uses()) != 1 or past_value.shape != past_key.shape:
        return "the value cache is read by more than its write, or differs from the key cache in shape"
    heads = query.shape[1] if query.shape is not None else None
    if not isinstance(heads, int) or heads % kv_heads:
        return "the query heads are not a static multiple of the key-value heads"
    return _Layer(
        query_flat, key_flat, value_flat, past_key, past_value, frequencies, positions,
        heads, kv_heads, scales[0] * scales[1], output, key_write.outputs[0], value_write.outputs[0],
    )  # fmt: skip


_VIEWS = ("Reshape", "Expand", "Identity")
"""Nodes that only reshape or broadcast: the exporter puts them between the steps of a layer, more of
them where the number of tokens is dynamic (a product of 4-D tensors as a batched one of 3-D)."""
_REPEAT = ("Unsqueeze", "Expand", "Reshape")
"""The cache's key-value heads repeated for every query head (``repeat_kv``)."""


def _back(value: Any, ops: tuple[str, ...] = _VIEWS) -> Any:
    """What ``value`` is made from through ``ops`` (their first input)."""
    for _ in range(8):
        node = value.producer() if value is not None else None
        if node is None or node.op_type not in ops or node.domain not in _STANDARD:
            break
        value = node.inputs[0]
    return value


def _forward(value: Any, ops: tuple[str, ...] = _VIEWS) -> Any:
    """What ``value`` becomes through ``ops``, each the one node that reads it (as its first input)."""
    for _ in range(8):
        users = [use.node for use in value.uses()]
        if len(users) != 1 or users[0].op_type not in ops or users[0].domain not in _STANDARD:
            break
        if users[0].inputs[0] is not value:
            break
        value = users[0].outputs[0]
    return value


def _user(value: Any, op: str) -> Any:
    """The one node reading ``value``, if it is an ``op``."""
    users = [use.node for use in value.uses()]
    return users[0] if len(users) == 1 and _is(users[0], op) else None


def _scalar_of(value: Any) -> float | None:
    tensor = value.const_value if value is not None else None
    if tensor is None:
        return None
    array = np.asarray(tensor.numpy())
    return float(array.reshape(-1)[0]) if array.size == 1 else None


def _scale(node: Any, operand: Any = None) -> float | None:
    """The scalar ``node`` (a Mul) multiplies ``operand`` (or its other input) by."""
    if node is None:
        return None
    first, second = node.inputs
    if operand is not None:
        return _scalar_of(second if first is operand else first)
    found = _scalar_of(second)
    return found if found is not None else _scalar_of(first)


def _rotation(rotated: Any) -> tuple[Any, Any, Any, Any, Any] | None:
    """``(x, cos, sin, inv_freq, positions)`` when ``rotated`` is ``x * cos + rotate_half(x) * sin``."""
    add = _producer(rotated, "Add")
    if add is None:
        return None
    for straight, turned in (add.inputs, reversed(add.inputs)):
        first, second = _producer(straight, "Mul"), _producer(turned, "Mul")
        if first is None or second is None:
            continue
        for x, cos in (first.inputs, reversed(first.inputs)):
            halves = next((h for h in second.inputs if _rotated_half(h, x)), None)
            if halves is None:
                continue
            sin = second.inputs[1] if second.inputs[0] is halves else second.inputs[0]
            tables = _tables(cos, sin)
            if tables is not None:
                return (x, cos, sin, *tables)
    return None


def _rotated_half(value: Any, x: Any) -> bool:
    """``Concat(-x[..., D/2:], x[..., :D/2])`` along the last axis."""
    concat = _producer(value, "Concat")
    if concat is None or len(concat.inputs) != 2 or concat.attributes["axis"].as_int() not in (-1, 3):
        return False
    negated = _producer(concat.inputs[0], "Neg")
    upper, lower = _producer(negated.inputs[0], "Slice") if negated else None, _producer(concat.inputs[1], "Slice")
    return upper is not None and lower is not None and upper.inputs[0] is x and lower.inputs[0] is x


def _tables(cos: Any, sin: Any) -> tuple[Any, Any] | None:
    """``(inv_freq, positions)`` when ``cos`` and ``sin`` are ``Unsqueeze(Cos|Sin(Concat(f, f)), 1)`` with
    ``f = Cast(positions) * inv_freq``."""
    cos_node, sin_node = _producer(cos, "Unsqueeze"), _producer(sin, "Unsqueeze")
    if cos_node is None or sin_node is None:
        return None
    cosine, sine = _producer(cos_node.inputs[0], "Cos"), _producer(sin_node.inputs[0], "Sin")
    if cosine is None or sine is None or cosine.inputs[0] is not sine.inputs[0]:
        return None
    doubled = _producer(cosine.inputs[0], "Concat")
    if doubled is None or len(doubled.inputs) != 2 or doubled.inputs[0] is not doubled.inputs[1]:
        return None
    angles = _producer(doubled.inputs[0], "Mul")
    if angles is None:
        return None
    for positions, frequencies in (angles.inputs, reversed(angles.inputs)):
        source = _integer_positions(positions)
        if source is not None and frequencies.const_value is not None:
            return frequencies, source
    return None


def _integer_positions(value: Any) -> Any:
    """The int64 ``[S]`` positions ``value`` is made from by ``Cast`` and ``Unsqueeze``."""
    for _ in range(4):
        node = value.producer()
        if not (_is(node, "Cast") or _is(node, "Unsqueeze")):
            break
        value = node.inputs[0]
    shape = value.shape
    dtype = value.dtype
    if shape is None or len(shape) != 1 or dtype is None or dtype.name != "INT64":
        return None
    return value


def _writes_at(indices: Any, positions: Any) -> bool:
    """Whether the scatter's indices end with ``positions`` (``cache_writes``' full indices)."""
    concat = _producer(indices, "Concat")
    if concat is None:
        return False
    value = concat.inputs[-1]
    for _ in range(6):
        if value is positions:
            return True
        node = value.producer()
        if node is None or node.op_type not in ("Unsqueeze", "Expand", "Reshape") or node.domain not in _STANDARD:
            return False
        value = node.inputs[0]
    return value is positions


def _heads_of(value: Any) -> Any:
    """``x`` when ``value`` is ``Transpose(Reshape(x), [0, 2, 1, 3])``: ``[B, S, heads * D]`` split in heads."""
    transpose = _producer(value, "Transpose")
    if transpose is None or list(transpose.attributes["perm"].as_ints()) != _HEADS_FIRST:
        return None
    reshape = _producer(transpose.inputs[0], "Reshape")
    if reshape is None:
        return None
    flat = reshape.inputs[0]
    return flat if flat.shape is not None and len(flat.shape) == 3 else None


def _attended(scores: Any) -> tuple[Any, Any] | None:
    """The layer's attention output ``[B, S, H * D]`` from ``scores`` (a mask added, softmax with or
    without the guard for rows hidden whole, the product with the values, heads joined), and the
    repeated values it reads."""
    masked = _user(_forward(scores), "Add")
    if masked is None:
        return None
    users = [use.node for use in masked.outputs[0].uses()]
    softmax = next((n for n in users if _is(n, "Softmax")), None)
    if softmax is None or softmax.attributes["axis"].as_int() not in (-1, 3):
        return None
    probabilities = softmax.outputs[0]
    guard = [use.node for use in probabilities.uses() if _is(use.node, "Where")]
    others = [use.node for use in probabilities.uses() if not _is(use.node, "Where") and not _is(use.node, "Shape")]
    if len(guard) == 1 and not others and guard[0].inputs[2] is probabilities:
        probabilities = guard[0].outputs[0]
    weights = _forward(probabilities)
    product = _user(weights, "MatMul")
    if product is None or product.inputs[0] is not weights:
        return None
    transpose = _user(_forward(product.outputs[0]), "Transpose")
    if transpose is None or list(transpose.attributes["perm"].as_ints()) != _HEADS_FIRST:
        return None
    joined = _forward(transpose.outputs[0])
    if joined is transpose.outputs[0] or joined.shape is None or len(joined.shape) != 3:
        return None
    return joined, product.inputs[1]
