"""Graph-structure equality: the same ops wired the same way, whatever the nodes are called."""

from __future__ import annotations

import pytest
import torch
from backends_for_tests import OpSetPartitioner
from models import LINEAR_OPS, Cond, TwoLinears, export

import torchdelegate as td
from torchdelegate import graph_structure_difference, same_graph_structure, to_backend
from torchdelegate.exported.structural_copy import copy_program


class Scaled(torch.nn.Module):
    def __init__(self, op: str = "mul", constant: float = 2.0, swap: bool = False) -> None:
        super().__init__()
        self.op, self.swap = op, swap
        self.scale = torch.tensor([constant, 1.0])  # a plain attribute: a lifted tensor constant

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        a, b = (y, x) if self.swap else (x, y)
        z = a * b if self.op == "mul" else a - b
        return (z + 1) * self.scale


def _program(**kwargs: object) -> torch.export.ExportedProgram:
    return export(Scaled(**kwargs), torch.randn(2), torch.randn(2))  # type: ignore[arg-type]


def test_two_exports_of_one_architecture_have_the_same_structure() -> None:
    left, right = export(TwoLinears(), torch.randn(2, 4)), export(TwoLinears(), torch.randn(2, 4))
    assert not torch.equal(left.state_dict["l1.weight"], right.state_dict["l1.weight"])  # weights are data
    assert same_graph_structure(left, right)
    assert same_graph_structure(left.graph_module, right.graph_module)
    assert same_graph_structure(left.graph, right.graph)
    assert graph_structure_difference(left, right) is None


def test_node_names_are_ignored_unless_asked_for() -> None:
    left = _program()
    right = copy_program(left)
    node = next(n for n in right.graph.nodes if n.name == "add")
    node.name = "plus_one"  # a pass renaming a node nothing refers to by name
    assert same_graph_structure(left, right)
    assert graph_structure_difference(left, right, node_names=True) == (
        "the program: node 4 is named 'add' on the left, 'plus_one' on the right"
    )


def test_another_op_is_named_with_its_position() -> None:
    assert graph_structure_difference(_program(), _program(op="sub")) == (
        "the program: node 3 is call_function aten.mul.Tensor ('mul') on the left, "
        "call_function aten.sub.Tensor ('sub') on the right"
    )


def test_arguments_wired_the_other_way_round_differ() -> None:
    assert graph_structure_difference(_program(), _program(swap=True)) == (
        "the program: node 3 (call_function aten.mul.Tensor ('mul')): its arguments differ: "
        "((%1, %2), {}) on the left, ((%2, %1), {}) on the right"
    )


def test_tensor_constants_are_compared_by_value() -> None:
    assert graph_structure_difference(_program(), _program(constant=3.0)) == (
        "the program: constant_tensor 'scale': its elements differ"
    )


def test_control_flow_sub_graphs_are_compared_recursively() -> None:
    left, right = export(Cond(), torch.randn(3, 4)), export(Cond(), torch.randn(3, 4))
    assert same_graph_structure(left, right)
    changed = copy_program(right)
    branch = changed.graph_module.true_graph_0
    relu = next(n for n in branch.graph.nodes if n.target is torch.ops.aten.relu.default)
    relu.target = torch.ops.aten.sigmoid.default
    found = graph_structure_difference(left, changed)
    assert found is not None and found.startswith(
        "the program: node 4 (true_graph_0), sub-graph: node 3 is call_function"
    )


def test_lowered_programs_compare_their_delegates_sub_programs() -> None:
    def lowered(supported: set[object]) -> torch.export.ExportedProgram:
        return to_backend(export(TwoLinears(), torch.randn(2, 4)), OpSetPartitioner(supported))

    assert same_graph_structure(lowered(LINEAR_OPS), lowered(LINEAR_OPS))
    fewer = LINEAR_OPS - {torch.ops.aten.relu.default}
    assert not same_graph_structure(lowered(LINEAR_OPS), lowered(fewer))
    other = to_backend(export(TwoLinears(), torch.randn(2, 4)), OpSetPartitioner(LINEAR_OPS, "TestCompileOnly"))
    found = graph_structure_difference(lowered(LINEAR_OPS), other)
    assert found == (
        "the program: node 1 (lowered_module_0): a delegate for 'TestTorchExport' [test=b'1'] on the left, "
        "for 'TestCompileOnly' [test=b'1'] on the right"
    )


def test_managers_compare_method_by_method() -> None:
    def manager(*names: str) -> td.EdgeProgramManager:
        return td.to_edge({name: torch.export.export(TwoLinears(), (torch.randn(2, 4),)) for name in names})

    assert same_graph_structure(manager("a", "b"), manager("a", "b"))
    assert graph_structure_difference(manager("a", "b"), manager("a", "c")) == (
        "the methods are ['a', 'b'] on the left, ['a', 'c'] on the right"
    )


def test_things_of_different_kinds_differ_and_others_are_refused() -> None:
    program = _program()
    assert graph_structure_difference(program, program.graph_module) == (
        "an ExportedProgram on the left, a GraphModule on the right"
    )
    with pytest.raises(
        TypeError, match=r"same_graph_structure compares Graphs, GraphModules, ExportedPrograms or Edge"
    ):
        same_graph_structure("a", "b")  # type: ignore[arg-type]
