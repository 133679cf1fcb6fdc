"""Quantizing a mixture of experts: the experts' 3-D weight stacks, which no recipe rewrites, stay
float, and ``quantize`` says so in a warning (``llm export --quantize`` prints it)."""

from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("torchao.quantization")

import torchdelegate as td  # noqa: E402


class Experts(torch.nn.Module):
    """Each token's expert chosen by ``ids``: its rows of the stack gathered, then one batched product."""

    def __init__(self) -> None:
        super().__init__()
        self.router = torch.nn.Linear(32, 4)
        self.stack = torch.nn.Parameter(torch.randn(4, 16, 32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids = self.router(x).argmax(-1)
        return torch.bmm(self.stack[ids], x.unsqueeze(-1)).squeeze(-1)


def _program(module: torch.nn.Module) -> torch.export.ExportedProgram:
    torch.manual_seed(0)
    return torch.export.export(module.eval(), (torch.randn(3, 32),))


def test_the_experts_stay_float_and_quantize_says_so() -> None:
    program = _program(Experts())
    with pytest.warns(UserWarning) as caught:
        quantized = td.quantize({"prefill": program, "decode": program}, "int8")
    assert [str(w.message) for w in caught] == [
        "quantized with int8: the experts' weights are left in float (1 stack: stack); the recipes quantize linear "
        "layers and embedding tables, and a mixture of experts keeps its experts as 3-D stacks"
    ]
    for method in ("prefill", "decode"):
        assert quantized[method].state_dict["stack"] is program.state_dict["stack"]  # shared, not copied
        assert "router.weight" not in quantized[method].state_dict  # the linear layer is quantized


def test_a_program_without_experts_quantizes_without_a_word() -> None:
    program = _program(torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.ReLU()))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        td.quantize(program, "int8")
