"""An exported model's initializers while it is optimized and before its weights are stored: nothing the
blob holds is computed from a weight, no weight is copied transposed, and no zeros are stored.

The weights that will be named data are made graph inputs while the optimizer and fusions run
(:func:`lift_weights`, put back by :func:`restore_weights`; :func:`state_by_size` says which: every float
parameter and persistent buffer a checkpoint holds, what the architecture computes from 1 KiB), so the
blob names each weight (``weights_by_reference``). A product by a transposed float weight reads the
weight as stored (:func:`read_weights_in_place`). Initializers of zeros the model computes become
``ConstantOfShape`` nodes (:func:`zeros_made_at_load`).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind

from torchdelegate.backends.onnxruntime.ir_edits import replace_node, take_place
from torchdelegate.backends.onnxruntime.settings import SMALLEST_SHARED
from torchdelegate.exported.programs import TENSOR_STATE_KINDS, state_value


def state_by_size(program: ExportedProgram) -> dict[str, int]:
    """Each state tensor's name, with the smallest size at which it becomes named data: any size
    for the float parameters and persistent buffers a checkpoint holds (so that a fine-tuned
    variant compiles to the same model), 1 KiB for what the architecture computes."""
    sizes = {}
    for spec in program.graph_signature.input_specs:
        if spec.target is None or spec.kind not in TENSOR_STATE_KINDS:
            continue
        checkpoint = spec.kind == InputKind.PARAMETER or (spec.kind == InputKind.BUFFER and spec.persistent)
        floating = state_value(program, spec.target).is_floating_point()
        sizes[spec.target] = 0 if checkpoint and floating else SMALLEST_SHARED
    return sizes


def lift_weights(model: Any, state: dict[str, int]) -> list[tuple[Any, Any]]:
    """The weights that will be named data (``state``: each one's smallest size), made graph inputs
    while the optimizer and fusions run, so that nothing they produce depends on a weight's
    values: the blob names each weight and holds nothing computed from one
    (``weights_by_reference``; ONNX Runtime folds what it can when it loads the model). Returns
    what :func:`restore_weights` puts back."""
    lifted = []
    for name, smallest in sorted(state.items()):
        value = model.graph.initializers.get(name)
        tensor = None if value is None else value.const_value
        if tensor is None or tensor.nbytes < smallest:
            continue
        model.graph.initializers.pop(name)
        value.const_value = None
        model.graph.inputs.append(value)
        lifted.append((value, tensor))
    return lifted


def restore_weights(model: Any, lifted: list[tuple[Any, Any]]) -> None:
    """The lifted weights initializers again (those the optimizer left in use)."""
    for value, tensor in lifted:
        model.graph.inputs.remove(value)
        if value.uses() or value in model.graph.outputs:
            value.const_value = tensor
            model.graph.register_initializer(value)


def read_weights_in_place(ir: ModuleType, model: Any) -> None:
    """Each product with a transposed float weight, ``MatMul(x, Transpose(w))``, becomes
    ``FusedMatMul(x, w, transB=1)``: the optimizer would fold the transpose into a transposed
    copy of ``w`` (ONNX Runtime too, at every session), where ONNX Runtime's kernel reads ``w``
    as it is.
    """
    for node in list(model.graph):
        transpose = _weight_transpose(ir, node)
        if transpose is None:
            continue
        attributes = {"transA": 0, "transB": 1, "alpha": 1.0}
        product = ir.node("FusedMatMul", [node.inputs[0], transpose.inputs[0]], attributes, domain="com.microsoft")
        replace_node(model, node, product)
        if not transpose.outputs[0].uses():
            model.graph.remove(transpose, safe=True)
        model.opset_imports.setdefault("com.microsoft", 1)


def _weight_transpose(ir: ModuleType, node: Any) -> Any:
    """The ``Transpose`` of a 2-D float weight (an initializer of 1 KiB or more) whose result
    ``node``, a ``MatMul``, multiplies by; None if it is not such a product."""
    standard = ("", "ai.onnx")
    if node.op_type != "MatMul" or node.domain not in standard or len(node.inputs) != 2 or node.inputs[1] is None:
        return None
    transpose = node.inputs[1].producer()
    if transpose is None or transpose.op_type != "Transpose" or transpose.domain not in standard:
        return None
    weight, perm = transpose.inputs[0], transpose.attributes.get("perm")
    tensor = weight.const_value if weight is not None and weight.is_initializer() else None
    if tensor is None or tensor.dtype != ir.DataType.FLOAT or len(tensor.shape) != 2:
        return None
    if tensor.nbytes < SMALLEST_SHARED or (perm is not None and list(perm.as_ints()) != [1, 0]):
        return None
    return transpose


def zeros_made_at_load(ir: ModuleType, model: Any, weights: set[str]) -> None:
    """Initializers of zeros the model computes (not ``weights``), of 1 KiB or more, become
    ``ConstantOfShape`` nodes: the file holds no zeros (a static KV cache's first values, masks),
    and ONNX Runtime makes them once when it loads the model."""
    for name, value in sorted(model.graph.initializers.items()):
        tensor = value.const_value
        if name in weights or tensor is None or tensor.nbytes < SMALLEST_SHARED or value in model.graph.outputs:
            continue
        array = tensor.numpy()
        if array.dtype.kind not in "biuf" or array.any():
            continue
        shape = ir.Value(name=f"{name}.shape", const_value=ir.tensor(np.array(array.shape, dtype=np.int64)))
        model.graph.register_initializer(shape)
        zeros = ir.node("ConstantOfShape", [shape], {"value": ir.tensor(np.zeros(1, dtype=array.dtype))})
        model.graph.insert_before(model.graph[0], zeros)
        model.graph.initializers.pop(name)
        take_place(model, value, zeros.outputs[0])
