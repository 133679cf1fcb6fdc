"""What code written for ExecuTorch's delegation API reads from a lowering, it finds here too.

The delegate calls ``to_backend`` makes carry a debug handle, numbered as ExecuTorch numbers
them; a partitioner built on ``generate_partitions_from_list_of_nodes`` whose support accepts a
constant gets that constant inside its delegate; and a delegate's ``meta`` answers to ExecuTorch's
``_delegate_info_meta`` with the value it keeps as ``delegate_info``.
"""

from __future__ import annotations

import torch
from backends_for_tests import FunctionPartitioner, describing_partitioner
from models import Cond, TwoLinears, aten, export
from torch.export.graph_signature import InputKind
from torch.fx import GraphModule, Node
from torch.fx.passes.operator_support import OperatorSupportBase

import torchdelegate as td
from torchdelegate import (
    DELEGATION_TAG,
    CapabilityPartitioner,
    DelegationSpec,
    Partitioner,
    PartitionResult,
    call_delegate,
    generate_partitions_from_list_of_nodes,
)


class _MatmulsAndAdds(torch.nn.Module):
    """``mm, add`` then an unsupported ``sub``, then ``mm, add`` again: two delegates."""

    def forward(self, a: torch.Tensor, x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        z = a @ x + b
        return (z - a) @ x + b


def _handles(gm: GraphModule) -> list[int]:
    """Every debug handle the graphs of ``gm`` hold, its sub-graphs' included."""
    return [
        node.meta["debug_handle"]
        for module in gm.modules()
        if isinstance(module, GraphModule)
        for node in module.graph.nodes
        if isinstance(node.meta.get("debug_handle"), int)
    ]


def _delegate_calls(gm: GraphModule) -> list[Node]:
    return [
        node
        for _, m in sorted(gm.named_modules())
        if isinstance(m, GraphModule)
        for node in m.graph.nodes
        if node.target is call_delegate
    ]


def test_each_delegate_call_gets_the_debug_handle_after_the_largest_of_its_program() -> None:
    inputs = (torch.randn(2, 2), torch.randn(2, 2), torch.randn(2, 2))
    edge = td.to_edge(export(_MatmulsAndAdds(), *inputs))
    largest = max(_handles(edge.exported_program().graph_module))
    partitioner = CapabilityPartitioner({aten.mm.default, aten.add.Tensor}, DelegationSpec("reference"))
    lowered = edge.to_backend(partitioner).exported_program()
    calls = _delegate_calls(lowered.graph_module)
    assert [call.meta["debug_handle"] for call in calls] == [largest + 1, largest + 2]  # in graph order
    again = _delegate_calls(edge.to_backend(partitioner).exported_program().graph_module)
    assert [call.meta["debug_handle"] for call in again] == [largest + 1, largest + 2]  # the same every time
    torch.testing.assert_close(lowered.module()(*inputs), _MatmulsAndAdds()(*inputs))


def test_delegate_calls_inside_control_flow_get_handles_no_other_node_of_the_program_has() -> None:
    edge = td.to_edge(export(Cond(), torch.randn(3, 4)))
    before = _handles(edge.exported_program().graph_module)

    def tagger(node: Node) -> str | None:
        return "t" if node.target in (aten.mm.default, aten.sub.Tensor) else None

    lowered = edge.to_backend(FunctionPartitioner(tagger)).exported_program().graph_module
    numbers = [call.meta["debug_handle"] for call in _delegate_calls(lowered)]
    assert len(numbers) == 2 and min(numbers) > max(before)  # one delegate in each branch
    assert len(set(numbers)) == 2


class _SequentialConstant(torch.nn.Module):
    """A constant read by an unsupported ``mul`` and by the adds of one delegate."""

    def __init__(self) -> None:
        super().__init__()
        self.const = torch.full((1,), 0.5)

    def forward(self, x: torch.Tensor, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        a = x * y * z * self.const
        return y + a + (z + a + (x + self.const + a))


class _AddsAndTheirConstants(OperatorSupportBase):
    """ExecuTorch's way to lower constants with a delegate: the support accepts the adds and the state
    placeholders an add reads."""

    def __init__(self, program: torch.export.ExportedProgram) -> None:
        super().__init__()
        self.state = {s.arg.name for s in program.graph_signature.input_specs if s.kind != InputKind.USER_INPUT}

    def is_node_supported(self, submodules: dict[str, torch.nn.Module], node: Node) -> bool:
        if node.op == "placeholder":
            return node.name in self.state and any(user.target is aten.add.Tensor for user in node.users)
        return node.op == "call_function" and node.target is aten.add.Tensor


class _ListsPartitioner(Partitioner):
    """A partitioner written as ExecuTorch's are: partitions from the helper, every node of each tagged."""

    def __init__(self) -> None:
        super().__init__(DelegationSpec("reference"))

    def partition(self, exported_program: torch.export.ExportedProgram) -> PartitionResult:
        support = _AddsAndTheirConstants(exported_program)
        tags = {}
        for partition in generate_partitions_from_list_of_nodes(exported_program.graph_module, op_support=support):
            for node in partition.nodes:
                node.meta[DELEGATION_TAG] = f"adds_{partition.id}"
            tags[f"adds_{partition.id}"] = self.spec
        return PartitionResult(exported_program, tags)


def test_a_constant_the_support_accepts_lowers_inside_its_delegate() -> None:
    model = _SequentialConstant()
    inputs = (torch.randn(1), torch.randn(1), torch.randn(1))
    lowered = td.to_edge(export(model, *inputs)).to_backend(_ListsPartitioner())
    (delegate,) = lowered.delegates()["forward"]
    kinds = {spec.target: spec.kind for spec in delegate.original_module.graph_signature.input_specs}
    assert kinds.get("const") == InputKind.CONSTANT_TENSOR  # carried inside, not passed in
    torch.testing.assert_close(lowered.exported_program().module()(*inputs), model(*inputs))


def test_executorchs_delegate_info_key_reads_and_writes_the_one_delegate_info() -> None:
    lowered = td.to_edge(export(TwoLinears(), torch.randn(2, 4))).to_backend(describing_partitioner())
    (delegate,) = lowered.delegates()["forward"]
    meta = delegate.meta
    assert meta["_delegate_info_meta"] is meta["delegate_info"] and "_delegate_info_meta" in meta
    meta["_delegate_info_meta"] = {"fused": True}
    assert meta["delegate_info"] == {"fused": True} == meta.get("_delegate_info_meta")
    assert list(meta).count("delegate_info") == 1 and "_delegate_info_meta" not in list(meta)  # stored once
    delegate.meta = {"delegate_info": "replaced"}
    assert delegate.meta["_delegate_info_meta"] == "replaced"
    del delegate.meta["_delegate_info_meta"]
    assert "delegate_info" not in delegate.meta
