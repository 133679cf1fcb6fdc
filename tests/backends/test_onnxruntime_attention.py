"""Attention over a static KV cache runs on ONNX Runtime's GroupQueryAttention: each layer's rotation,
cache write and grouped-query attention as one kernel, its keys and values written into the
program's cache, with the model's outputs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("onnxruntime")
from language_models import static_cache_module, tiny_llama, tiny_qwen2  # noqa: E402
from onnx_graphs import delegate_nodes  # noqa: E402

import torchdelegate as td  # noqa: E402
from torchdelegate import CompileSpec  # noqa: E402
from torchdelegate.backends.onnxruntime import OnnxRuntimePartitioner  # noqa: E402
from torchdelegate.backends.onnxruntime.blob_header import unpacked  # noqa: E402
from torchdelegate.llm.checkpoint import export_methods  # noqa: E402

CACHE = 24


def _saved(tmp_path: Path, model: torch.nn.Module, chunk: int | None, specs: list[CompileSpec]) -> Path:
    path = tmp_path / "model.tdp"
    programs = export_methods(model, CACHE, chunk)
    td.to_edge(programs).to_backend(OnnxRuntimePartitioner(compile_specs=specs)).save(path)
    return path


def _operators(program: td.Program, index: int) -> dict[str, int]:
    """How many nodes of each operator delegate ``index`` runs."""
    counts: dict[str, int] = {}
    for node in delegate_nodes(program, index):
        counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return counts


def _logits(module: torch.nn.Module, program: td.Program | None, prompt: list[int], steps: int) -> list[torch.Tensor]:
    """The logits of a prompt read in one call, then of ``steps`` greedy decode calls."""
    run = module if program is None else None
    outputs = []
    ids, positions = torch.tensor([prompt]), torch.arange(len(prompt))
    for step in range(steps + 1):
        if run is not None:
            logits = run(input_ids=ids, cache_position=positions)
        else:
            method = "prefill" if step == 0 else "decode"
            logits = program.run(method, input_ids=ids, cache_position=positions)  # type: ignore[union-attr]
        outputs.append(logits[0, -1])
        ids, positions = logits[:, -1:].argmax(-1), positions[-1:] + 1
    return outputs


@pytest.mark.parametrize(("architecture", "chunk"), [("llama", None), ("qwen2", 6)])
def test_each_layer_runs_one_kernel_with_the_models_logits(
    tmp_path: Path, chunk: int | None, architecture: str
) -> None:
    """A prefill of any length (or of a fixed chunk) and decode: one GroupQueryAttention per layer, no
    repeated cache heads, no softmax left; the cache written in place; logits as in eager."""
    model = (tiny_llama if architecture == "llama" else tiny_qwen2)(vocab_size=256)
    path = _saved(tmp_path, model, chunk, [])
    prompt = [3, 14, 15, 92, 65, 35]
    with torch.no_grad():
        expected = _logits(static_cache_module(model, CACHE), None, prompt, 6)
    layers = model.config.num_hidden_layers
    with td.load(path) as program, torch.no_grad():
        for index, record in enumerate(program.delegates):
            header, _ = unpacked(program.file.data(record.blob, "blob"))
            assert header["fusions"]["GroupQueryAttention"] == layers
            counts = _operators(program, index)
            assert counts.get("GroupQueryAttention") == layers
            assert "Softmax" not in counts and "Expand" not in counts and "ScatterND" not in counts
        program.initialize()
        assert [len(d._handle.written) for d in program._delegates] == [3 * layers, 3 * layers]  # caches, counters
        got = _logits(None, program, prompt, 6)  # type: ignore[arg-type]
    for step, (a, b) in enumerate(zip(got, expected, strict=True)):
        torch.testing.assert_close(a, b, atol=2e-4, rtol=2e-4, msg=lambda m, s=step: f"step {s}: {m}")


def test_without_fusions_the_attention_stays_as_exported(tmp_path: Path) -> None:
    """``fusions=0`` keeps the exporter's model: the cache written by a scatter (still in place)."""
    model = tiny_llama(vocab_size=256)
    path = _saved(tmp_path, model, None, [CompileSpec("fusions", b"0")])
    with td.load(path) as program:
        counts = _operators(program, 1)
        assert "GroupQueryAttention" not in counts and counts["Softmax"] == model.config.num_hidden_layers
        program.initialize()
        assert [len(d._handle.written) for d in program._delegates] == [6, 6]  # 2 layers' caches, counters


def test_a_head_size_the_kernel_does_not_take_keeps_the_exported_attention(tmp_path: Path) -> None:
    """ONNX Runtime's GroupQueryAttention runs head sizes that are multiples of 16 only: a Llama whose
    heads are 24 wide keeps the exported attention, says why, and gives eager's logits."""
    model = tiny_llama(hidden_size=96, vocab_size=256)  # 4 heads of 24
    path = _saved(tmp_path, model, None, [])
    prompt = [3, 14, 15, 92, 65]
    with torch.no_grad():
        expected = _logits(static_cache_module(model, CACHE), None, prompt, 3)
    why = "2 layers: the head size 24 is not a multiple of 16, as the kernel needs on CPU"
    with td.load(path) as program, torch.no_grad():
        assert [r.delegate_info["unfused"] for r in program.delegates] == [{"GroupQueryAttention": [why]}] * 2
        got = _logits(None, program, prompt, 3)  # type: ignore[arg-type]
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, atol=2e-4, rtol=2e-4)


def test_attention_left_unfused_says_why_in_the_report_and_keeps_the_models_logits(tmp_path: Path) -> None:
    """GPT-2 has no rotary embedding: its layers keep the exported attention, the report says why for
    each, and the file still gives eager's logits."""
    from language_models import tiny_gpt2

    from torchdelegate.partition.capability import CapabilityPartitioner
    from torchdelegate.report import render_text

    model = tiny_gpt2(vocab_size=256)
    programs = export_methods(model, CACHE, None)
    lowered = td.to_edge(programs).to_backend(CapabilityPartitioner([OnnxRuntimePartitioner().backends[0]]))
    report = lowered.report
    layers = model.config.n_layer
    why = (
        f"{layers} layers: queries and keys are not rotated by the half-split rotation (rotate_half) of one cos and sin"
    )
    for method in ("prefill", "decode"):
        (row,) = report.methods[method].partitions
        assert row.delegate_info is not None
        assert row.delegate_info["unfused"] == {"GroupQueryAttention": [why]}
        assert "GroupQueryAttention" not in row.delegate_info.get("fusions", {})
    assert f"unfused: GroupQueryAttention ({why})" in render_text(report)
    path = tmp_path / "gpt2.tdp"
    lowered.save(path, report=report.to_json())
    prompt = [3, 14, 15, 92, 65]
    with torch.no_grad():
        expected = _logits(static_cache_module(model, CACHE), None, prompt, 3)
    with td.load(path) as program, torch.no_grad():
        assert [r.delegate_info["unfused"] for r in program.delegates] == [{"GroupQueryAttention": [why]}] * 2
        got = _logits(None, program, prompt, 3)  # type: ignore[arg-type]
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, atol=2e-4, rtol=2e-4)
