"""Cycle-free grouping: claimed nodes on both sides of an unclaimed one never share a group."""

import torch

from torchdelegate.partition.grouping import cycle_free_levels


def test_a_node_after_an_unclaimed_one_is_in_a_later_group() -> None:
    class Model(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            a = x + 1  # claimed
            b = torch.sigmoid(a)  # unclaimed
            c = a * b  # claimed: reads a directly and through b
            d = x - 1  # claimed, independent of b: joins its user's later group
            return c + d  # claimed

    program = torch.export.export(Model(), (torch.randn(3),))
    levels = cycle_free_levels(program.graph, lambda n: n.target != torch.ops.aten.sigmoid.default)
    by_name = {n.name: level for n, level in levels.items()}
    assert by_name["add"] == 0  # sigmoid reads it
    assert by_name["sub"] == by_name["mul"] == by_name["add_1"] == 1
    assert "sigmoid" not in by_name


def test_getitems_follow_their_tuple() -> None:
    class Model(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            a, b = (x * 2).split(2)
            return torch.sigmoid(a) + b

    program = torch.export.export(Model(), (torch.randn(4),))
    levels = cycle_free_levels(program.graph, lambda n: n.target != torch.ops.aten.sigmoid.default)
    split = next(n for n in levels if n.target == torch.ops.aten.split.Tensor)
    for user in split.users:
        assert levels[user] == levels[split]


def test_a_weight_transposed_before_a_size_computation_joins_the_matmul_after_it() -> None:
    """Dynamic shapes put sym_size nodes (unclaimed) between permute(weight) and addmm."""
    layer = torch.nn.Linear(8, 8)
    batch = torch.export.Dim("batch", min=2, max=16)
    program = torch.export.export(
        torch.nn.Sequential(layer, torch.nn.ReLU()), (torch.randn(4, 8),), dynamic_shapes=({0: batch},)
    )
    program = program.run_decompositions()
    levels = cycle_free_levels(
        program.graph, lambda n: isinstance(n.target, torch._ops.OpOverload) and n.target != torch.ops.aten.sym_size.int
    )
    assert len(set(levels.values())) == 1
