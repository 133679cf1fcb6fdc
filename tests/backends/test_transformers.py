"""Architectures no one here wrote: transformers models (tiny configs, random weights) through
each shipped backend, saved, loaded in the runtime, against eager."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import torchdelegate as td
from torchdelegate import Partitioner
from torchdelegate.backends.reference import ReferencePartitioner

transformers = pytest.importorskip("transformers")
from language_models import Logits, tiny_gpt2, tiny_llama  # noqa: E402
from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM  # noqa: E402

PROMPT_LENGTH, STEPS, CACHE = 8, 4, 16


def partitioners(backend: str) -> list[Partitioner]:
    if backend == "onnxruntime":
        from torchdelegate.backends.onnxruntime import OnnxRuntimePartitioner

        return [OnnxRuntimePartitioner(), ReferencePartitioner()]
    return [ReferencePartitioner()]


BACKENDS = [
    "reference",
    pytest.param(
        "onnxruntime",
        marks=pytest.mark.skipif(
            not td.get_backend("onnxruntime").is_available(), reason="onnxruntime is not installed"
        ),
    ),
]


def unique_weight_bytes(model: torch.nn.Module) -> int:
    seen = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    return sum(seen.values())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("build", [tiny_llama, tiny_gpt2], ids=["llama", "gpt2"])
def test_single_method_logits_match_eager_after_loading(build, backend: str, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    model = Logits(build())
    ids = torch.randint(0, 512, (1, 12))
    with torch.no_grad():
        program = torch.export.export(model, (ids,))
        expected = model(ids)
    lowered = td.to_edge(program).to_backend(partitioners(backend))
    assert {d.backend_id for d in lowered.delegates()["forward"]} >= {backend}
    lowered.save(tmp_path / "lm.tdp")
    with td.load(tmp_path / "lm.tdp") as loaded:
        torch.testing.assert_close(loaded.run("forward", ids), expected, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_llama_prefill_and_greedy_decode_match_eagers_full_sequence(backend: str, tmp_path: Path) -> None:
    model = tiny_llama()
    prompt = torch.randint(0, 512, (1, PROMPT_LENGTH))
    exporter = TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=CACHE)
    with torch.no_grad():
        programs = {
            "prefill": exporter.export(input_ids=prompt, cache_position=torch.arange(PROMPT_LENGTH)),
            "decode": exporter.export(input_ids=prompt[:, :1], cache_position=torch.tensor([PROMPT_LENGTH])),
        }
    lowered = td.to_edge(programs).to_backend(partitioners(backend))
    path = tmp_path / "llama.tdp"
    lowered.save(path)
    weights = unique_weight_bytes(model)
    assert path.stat().st_size <= 1.02 * weights + 256 * 1024, (path.stat().st_size, weights)

    with td.load(path) as loaded:
        logits = [loaded.run("prefill", input_ids=prompt, cache_position=torch.arange(PROMPT_LENGTH))[0, -1]]
        tokens = prompt[0].tolist()
        for step in range(STEPS):
            tokens.append(int(logits[-1].argmax()))
            position = torch.tensor([PROMPT_LENGTH + step])
            out = loaded.run("decode", input_ids=torch.tensor([[tokens[-1]]]), cache_position=position)
            logits.append(out[0, -1])
    with torch.no_grad():
        full = model(input_ids=torch.tensor([tokens]), use_cache=False).logits[0]
    expected = full[PROMPT_LENGTH - 1 :]
    torch.testing.assert_close(torch.stack(logits), expected, atol=1e-3, rtol=1e-3)
