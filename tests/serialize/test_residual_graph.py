"""Saved graphs read without torch.export's deserializer: the same graph, inputs and outputs as
torch's reader gives, and a process that only loads and runs a file never imports torch._dynamo."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch._export.serde import serialize as torch_serde

import torchdelegate as td
from torchdelegate.backends.onnxruntime import OnnxRuntimePartitioner
from torchdelegate.exported.programs import state_value
from torchdelegate.serialize import residual_graph as reader
from torchdelegate.serialize.graph import program_from_json, program_to_json


class Mixed(torch.nn.Module):
    """Keyword arguments, -inf, an op with several outputs, a dynamic size and a buffer it writes."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
        self.register_buffer("seen", torch.zeros(8))

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.proj(x) + bias
        masked = h.masked_fill(h < 0, float("-inf")).softmax(-1)
        values, indices = masked.topk(3, dim=-1)
        normed = torch.nn.functional.layer_norm(h, (8,), eps=1e-5)
        self.seen.add_(normed.mean(0))
        return values * x.shape[0], indices


def _document_and_state() -> tuple[dict, dict[str, torch.Tensor], torch.export.ExportedProgram]:
    batch = torch.export.Dim("batch", min=2, max=64)
    exported = torch.export.export(
        Mixed(), (torch.randn(4, 8), torch.randn(8)), dynamic_shapes=({0: batch}, None), strict=True
    )
    program = td.to_edge(exported).exported_program()
    document = program_to_json(program, "test")
    state = {s.target: state_value(program, s.target) for s in program.graph_signature.input_specs if s.target}
    return document, state, program


def test_the_serialized_enums_are_torch_exports() -> None:
    assert reader._DTYPES == dict(torch_serde._SERIALIZE_TO_TORCH_DTYPE)
    assert reader._LAYOUTS == dict(torch_serde._SERIALIZE_TO_TORCH_LAYOUT)
    assert reader._MEMORY_FORMATS == dict(torch_serde._SERIALIZE_TO_TORCH_MEMORY_FORMAT)


def test_a_graph_read_directly_is_the_graph_torch_reads() -> None:
    document, state, _ = _document_and_state()
    direct = reader.residual_graph(document, state, "test")
    through_torch = reader.described(program_from_json(document, state, "test"), "test")
    assert direct.inputs == through_torch.inputs
    assert direct.outputs == through_torch.outputs
    assert direct.ranges == through_torch.ranges
    assert sorted(direct.ranges.values()) == [(2, 64)]
    assert (direct.in_spec, direct.out_spec, direct.arg_names) == (
        through_torch.in_spec,
        through_torch.out_spec,
        through_torch.arg_names,
    )
    x, bias = torch.randn(5, 8), torch.randn(8)
    arguments = [state[i.target] if i.target else {"x": x, "bias": bias}[i.name] for i in direct.inputs]
    ours = direct.graph_module(*[a.clone() for a in arguments])
    torchs = through_torch.graph_module(*[a.clone() for a in arguments])
    assert len(ours) == len(torchs) == 3
    for mine, theirs in zip(ours, torchs, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0)


def test_the_direct_reader_leaves_to_torch_what_it_does_not_read() -> None:
    document, state, _ = _document_and_state()
    changed = json.loads(json.dumps(document))
    for node in changed["graph_module"]["graph"]["nodes"]:
        for named in node["inputs"]:
            named["kind"] = 0  # an older writer: argument kinds unknown, the schema decides
    with pytest.raises(reader._Unsupported):
        reader._read(changed)
    graph = reader.residual_graph(changed, state, "test")
    x, bias = torch.randn(3, 8), torch.randn(8)
    arguments = [state[i.target].clone() if i.target else {"x": x, "bias": bias}[i.name] for i in graph.inputs]
    assert len(graph.graph_module(*arguments)) == 3


def test_loading_and_running_a_file_imports_neither_dynamo_nor_sympy(tmp_path: Path) -> None:
    path = tmp_path / "linear.tdp"
    exported = torch.export.export(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()), (torch.randn(2, 4),))
    td.to_edge(exported).to_backend({"forward": OnnxRuntimePartitioner()}).save(path)
    script = f"""
import sys, torch, torchdelegate
with torchdelegate.load({str(path)!r}) as program:
    program.run("forward", torch.randn(2, 4))
heavy = sorted(m for m in ("torch._dynamo", "sympy", "torch._export.serde.serialize") if m in sys.modules)
print(",".join(heavy) or "none")
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "none", result.stdout
