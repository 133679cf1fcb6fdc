"""The ONNX optimization a partition's model gets: onnxscript's ``optimize_ir`` and ONNX fusions, to the byte,
in time linear in the model's nodes."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import onnx
import pytest
import torch

pytest.importorskip("onnxruntime")
ir = pytest.importorskip("onnx_ir")
from onnxscript import optimizer  # noqa: E402
from onnxscript.rewriter import onnx_fusions  # noqa: E402

from torchdelegate.backends.onnxruntime import onnx_export  # noqa: E402


def _halves() -> bytes:
    """Two slices of ``x`` that split its last dimension in halves (rotary embedding's ``rotate_half``)."""
    ints = onnx.TensorProto.INT64
    constants = {"zero": [0], "half": [4], "middle": [4], "whole": [8], "last": [-1], "axis": [-1]}
    nodes = [
        onnx.helper.make_node("Constant", [], [name], value=onnx.helper.make_tensor(name, ints, [1], v))
        for name, v in constants.items()
    ]
    nodes += [
        onnx.helper.make_node("Slice", ["x", "zero", "half", "last"], ["first"]),
        onnx.helper.make_node("Slice", ["x", "middle", "whole", "axis"], ["second"]),
        onnx.helper.make_node("Neg", ["second"], ["negated"]),
        onnx.helper.make_node("Concat", ["negated", "first"], ["y"], axis=-1),
    ]
    floats = onnx.TensorProto.FLOAT
    graph = onnx.helper.make_graph(
        nodes, "halves", [onnx.helper.make_tensor_value_info("x", floats, [2, 8])],
        [onnx.helper.make_tensor_value_info("y", floats, [2, 8])],
    )  # fmt: skip
    return onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 18)]).SerializeToString()


class Several(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            first, second = x[..., :4], x[..., 4:]
            x = torch.relu(layer(torch.cat((-second, first), dim=-1))).reshape(2, 8).clip(-1, 1)
        return x


def _exported(module: torch.nn.Module) -> bytes:
    program = torch.export.export(module.eval(), (torch.randn(2, 8),)).run_decompositions({})
    with warnings.catch_warnings(), onnx_export.quiet_exporter():
        warnings.simplefilter("ignore")
        exported = torch.onnx.export(program, (), dynamo=True, optimize=False, verbose=False)
    assert exported is not None
    return ir.to_proto(exported.model).SerializeToString()


@pytest.mark.parametrize("made", [_halves, lambda: _exported(Several())], ids=["halves", "several"])
def test_the_partition_model_is_optimized_as_onnxscript_optimizes_it(made: Callable[[], bytes]) -> None:
    model = made()
    theirs, ours = (ir.from_proto(ir.serde.onnx.ModelProto.FromString(model)) for _ in range(2))
    optimizer.optimize_ir(theirs)
    onnx_fusions.fuse(theirs)
    onnx_export._optimize(ours)
    assert ir.to_proto(ours).SerializeToString() == ir.to_proto(theirs).SerializeToString()


def test_rules_of_several_output_nodes_are_not_tried_on_nodes_they_cannot_match() -> None:
    from onnxscript import rewriter

    rules = onnx_export._rewrite_rules(rewriter)
    assert [rule.name for rule in rules] == [rule.name for rule in rewriter._DEFAULT_REWRITE_RULES]
    filtered = [rule for rule in rules if isinstance(rule, onnx_export._FirstNodeFiltered)]
    assert filtered, "onnxscript's default rules no longer have a rule of several output nodes"
    model = ir.from_proto(onnx.ModelProto.FromString(_halves()))
    tried = []

    class Recording:
        _target_pattern = filtered[0]._rule._target_pattern

        def try_rewrite(self, model: Any, graph: Any, node: Any, **options: Any) -> None:
            tried.append(node.op_type)

    recording = onnx_export._FirstNodeFiltered(Recording())
    for node in model.graph:
        recording.try_rewrite(model, model.graph, node)
    assert tried == ["Slice", "Slice"]  # not the Constant, Neg and Concat nodes
