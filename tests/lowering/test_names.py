"""Names survive every step: inputs and state named after builtins, keywords and our own generated names."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import torchdelegate as td
from torchdelegate.backends.onnxruntime import OnnxRuntimePartitioner
from torchdelegate.backends.reference import ReferencePartitioner

BACKEND_LISTS = {
    "reference": lambda: [ReferencePartitioner()],
    "onnxruntime+reference": lambda: [OnnxRuntimePartitioner(), ReferencePartitioner()],
}


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_parameter("lambda", torch.nn.Parameter(torch.randn(16, 16)))  # a keyword
        self.register_buffer("input", torch.randn(16))


class AwkwardNames(torch.nn.Module):
    """Inputs and state named like Python builtins and keywords, like lowering's own nodes, with dots and unicode."""

    def __init__(self) -> None:
        super().__init__()
        self.lowered_module_0 = Block()
        self.register_parameter("getitem", torch.nn.Parameter(torch.randn(16)))
        self.register_buffer("call_delegate", torch.zeros(16))
        self.register_buffer("poids_é", torch.randn(16))

    def forward(
        self,
        input: torch.Tensor,
        list: torch.Tensor,
        type: torch.Tensor,
        id: torch.Tensor,
        output: torch.Tensor,
        lowered_module_0: torch.Tensor,
        é: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        a = torch.relu(input + list) @ getattr(self.lowered_module_0, "lambda")
        b = torch.sigmoid(type * id) + self.lowered_module_0.input + self.poids_é
        self.call_delegate.add_(1.0)
        c = output * self.getitem - lowered_module_0 * é + self.call_delegate
        return a, b, c


def _inputs() -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(3)
    return tuple(torch.randn(16, generator=generator) for _ in range(7))


@pytest.mark.parametrize("backends", list(BACKEND_LISTS))
@pytest.mark.parametrize("strict", [False, True])
def test_awkward_names_lower_save_load_and_run_like_eager(backends: str, strict: bool, tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = AwkwardNames().eval()
    program = torch.export.export(model, _inputs(), strict=strict)
    names = [n.name for n in program.graph.nodes if n.op == "placeholder"]
    assert {"input", "list", "type", "id", "output", "lowered_module_0"} <= set(names)
    lowered = td.to_edge_transform_and_lower(program, partitioner=BACKEND_LISTS[backends]())
    signature = lowered.exported_program().graph_signature
    assert [s.arg.name for s in signature.input_specs if s.kind.name == "USER_INPUT"] == names[-7:]
    assert "lowered_module_0.lambda" in {s.target for s in signature.input_specs} | {
        s.target for d in lowered.delegates()["forward"] for s in d.original_module.graph_signature.input_specs
    }
    lowered.save(tmp_path / "awkward.tdp")
    with torch.no_grad():
        expected = [AwkwardNames.forward(model, *_inputs()) for _ in range(2)]  # the buffer update shows twice
    with td.load(tmp_path / "awkward.tdp") as loaded:
        torch.testing.assert_close([loaded.run("forward", *_inputs()) for _ in range(2)], expected)


@pytest.mark.parametrize(
    "module",
    [
        torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)),
        torch.nn.Linear(8, 4),
    ],
    ids=["Sequential", "Linear"],
)
@pytest.mark.parametrize("backends", list(BACKEND_LISTS))
def test_a_module_whose_input_is_named_input_lowers_and_runs_in_a_fresh_process(
    module: torch.nn.Module, backends: str, tmp_path: Path
) -> None:
    x = torch.randn(3, 8)
    program = torch.export.export(module, (x,))
    assert [n.name for n in program.graph.nodes if n.op == "placeholder"][-1] == "input"
    lowered = td.to_edge_transform_and_lower(program, partitioner=BACKEND_LISTS[backends]())
    assert lowered.delegates()["forward"], "nothing was delegated"
    lowered.save(tmp_path / "model.tdp")
    torch.save({"x": x, "expected": module(x).detach()}, tmp_path / "io.pt")
    script = (
        "import sys, torch, torchdelegate\n"
        "io = torch.load(sys.argv[2])\n"
        "with torchdelegate.load(sys.argv[1]) as program:\n"
        "    torch.testing.assert_close(program.run('forward', input=io['x']), io['expected'])\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "model.tdp"), str(tmp_path / "io.pt")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
