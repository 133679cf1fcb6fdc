"""Cycle-free levels, as the capability partitioner uses them (and so every shipped partitioner):
claimed nodes on both sides of an unclaimed one never share a partition."""

import torch
from torch.fx import Node

from torchdelegate import CapabilityPartitioner, DelegationSpec

SPEC = DelegationSpec("reference")


def _partition_of(program: torch.export.ExportedProgram, support) -> dict[str, str]:  # type: ignore[no-untyped-def]
    """Each delegated node's tag, by node name, from the partitioner's plan."""
    plan = CapabilityPartitioner(support, SPEC).plan(program)
    return {name: p.tag for p in plan.partitions for name in p.nodes}


def _all_but_sigmoid(node: Node) -> bool:
    return node.target != torch.ops.aten.sigmoid.default


def test_a_node_after_an_unclaimed_one_is_in_a_later_group() -> None:
    class Model(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            a = x + 1  # claimed
            b = torch.sigmoid(a)  # unclaimed
            c = a * b  # claimed: reads a directly and through b
            d = x - 1  # claimed, independent of b: joins its user's later group
            return c + d  # claimed

    program = torch.export.export(Model(), (torch.randn(3),))
    by_name = _partition_of(program, _all_but_sigmoid)
    assert by_name["add"] != by_name["mul"]  # sigmoid reads add and feeds mul
    assert by_name["sub"] == by_name["mul"] == by_name["add_1"]
    assert "sigmoid" not in by_name


def test_getitems_follow_their_tuple() -> None:
    class Model(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            a, b = (x * 2).split(2)
            return torch.sigmoid(a) + b

    program = torch.export.export(Model(), (torch.randn(4),))
    by_name = _partition_of(program, _all_but_sigmoid)
    split = next(n for n in program.graph.nodes if n.target == torch.ops.aten.split.Tensor)
    for user in split.users:
        assert by_name[user.name] == by_name[split.name]


def test_a_weight_transposed_before_a_size_computation_joins_the_matmul_after_it() -> None:
    """Dynamic shapes put sym_size nodes (unclaimed) between permute(weight) and addmm."""
    layer = torch.nn.Linear(8, 8)
    batch = torch.export.Dim("batch", min=2, max=16)
    program = torch.export.export(
        torch.nn.Sequential(layer, torch.nn.ReLU()), (torch.randn(4, 8),), dynamic_shapes=({0: batch},)
    )
    program = program.run_decompositions()
    by_name = _partition_of(
        program, lambda n: isinstance(n.target, torch._ops.OpOverload) and n.target != torch.ops.aten.sym_size.int
    )
    assert len(set(by_name.values())) == 1
