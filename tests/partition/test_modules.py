"""The module calls a node was made in, read from export's ``nn_module_stack``."""

from __future__ import annotations

import torch

from torchdelegate.partition.modules import NO_MODULE, module_calls, module_path


class _Outer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.nn.Sequential(torch.nn.Linear(2, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x).relu()


def test_a_node_torch_adds_outside_any_module_is_in_no_module_call() -> None:
    program = torch.export.export(_Outer(), (torch.randn(1, 2),))
    linear = next(n for n in program.graph.nodes if n.target is torch.ops.aten.linear.default)
    assert [c.name for c in module_calls(linear)] == ["inner", "inner.0"] and module_path(linear) == "inner.0"
    linear.meta["nn_module_stack"] = {NO_MODULE: (NO_MODULE, NO_MODULE)}  # as torch's metadata hook writes it
    assert module_calls(linear) == [] and module_path(linear) == ""
