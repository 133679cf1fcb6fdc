"""``llm export`` reads a checkpoint without its weights: the programs equal those of the model
loaded whole, a checkpoint that cannot be read lazily is loaded whole with a note, and the
anonymous memory ``llm export`` adds stays far below the weights."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("onnxruntime")

from language_models import tiny_gpt2, tiny_llama, transformers_greedy  # noqa: E402

from torchdelegate.llm.checkpoint import export_methods, read_checkpoint  # noqa: E402


def _save(directory: Path, model: torch.nn.Module) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    model.save_pretrained(directory)
    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(64)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(directory / "tokenizer.json"))
    return directory


def _same_programs(
    first: dict[str, torch.export.ExportedProgram], second: dict[str, torch.export.ExportedProgram]
) -> None:
    assert list(first) == list(second)
    for method in first:
        a, b = first[method], second[method]
        assert a.graph_module.code == b.graph_module.code
        assert str(a.graph_signature) == str(b.graph_signature)
        for mine, theirs in ((a.state_dict, b.state_dict), (a.constants, b.constants)):
            assert list(mine) == list(theirs)
            assert all(torch.equal(mine[k], theirs[k]) and mine[k].dtype == theirs[k].dtype for k in mine)


@pytest.mark.parametrize("build", [tiny_llama, tiny_gpt2])
def test_programs_read_lazily_equal_those_of_the_model_loaded_whole(tmp_path: Path, build: object) -> None:
    directory = _save(tmp_path / "checkpoint", build())  # type: ignore[operator]
    lazy = read_checkpoint(directory)
    assert lazy.weights is not None and lazy.eager_reason is None
    whole = read_checkpoint(directory, lazily=False)
    assert whole.weights is None and lazy.stop_tokens == whole.stop_tokens
    _same_programs(lazy.bound(export_methods(lazy.model, 16, None)), export_methods(whole.model, 16, None))


def test_a_checkpoint_without_safetensors_is_loaded_whole_with_a_note(tmp_path: Path) -> None:
    model = tiny_llama()
    directory = _save(tmp_path / "checkpoint", model)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    (directory / "model.safetensors").unlink()
    torch.save(state, directory / "pytorch_model.bin")
    checkpoint = read_checkpoint(directory)
    assert checkpoint.weights is None
    assert checkpoint.eager_reason is not None and "no model.safetensors or" in checkpoint.eager_reason
    result = subprocess.run(
        [sys.executable, "-m", "torchdelegate", "llm", "export", str(directory), "-o", "m.tdp", "--max-cache", "16"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    assert "reading the weights whole (" in result.stdout and (tmp_path / "m.tdp").is_file()


def test_weights_under_names_the_model_does_not_use_are_refused_not_made_random(tmp_path: Path) -> None:
    """Neither read lazily nor by transformers (which would leave every weight random): refused, by name."""
    from safetensors.torch import load_file, save_file

    from torchdelegate.errors import CheckpointError

    directory = _save(tmp_path / "checkpoint", tiny_llama())
    state = load_file(directory / "model.safetensors")
    save_file({f"transformer.{k}": v for k, v in state.items()}, directory / "model.safetensors", {"format": "pt"})
    with pytest.raises(CheckpointError, match=r"its weights hold no tensor for lm_head.weight, model.embed_tokens"):
        read_checkpoint(directory)


def _export(directory: Path, output: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "torchdelegate", "llm", "export", str(directory), "-o", str(output), *flags]
    return subprocess.run(command, capture_output=True, text=True, timeout=600)


def _greedy(program: Path, prompt: list[int], new: int) -> list[int]:
    import torchdelegate as td
    from torchdelegate.llm import Generator

    with td.load(program) as loaded:
        return list(Generator(loaded).generate(prompt, new).tokens)


@pytest.mark.parametrize("quantize", [(), ("--quantize", "8da4w")])
def test_a_bfloat16_checkpoint_is_read_as_stored_and_lowered_whole_to_onnx_runtime(
    tmp_path: Path, quantize: tuple[str, ...]
) -> None:
    """Its weights are bound as bfloat16 and converted where the graph reads them: one ONNX Runtime
    partition per method, greedy tokens those of transformers computing in float32 over the bfloat16
    weights; quantized, each weight is converted one at a time."""
    import torchdelegate as td

    model = tiny_llama(hidden_size=512)  # MLP weights of 1 MiB: bound as stored, converted in the graph
    model.generation_config.eos_token_id = None
    directory = _save(tmp_path / "checkpoint", model.to(torch.bfloat16))
    assert json.loads((directory / "config.json").read_text())["dtype"] == "bfloat16"
    result = _export(directory, tmp_path / "m.tdp", "--max-cache", "24", *quantize)
    assert result.returncode == 0, result.stderr
    with td.load(tmp_path / "m.tdp") as loaded:
        assert [d.backend_id for d in loaded.delegates] == ["onnxruntime", "onnxruntime"]
    prompt = [5, 9, 17, 33, 2, 7]
    tokens = _greedy(tmp_path / "m.tdp", prompt, 8)
    if not quantize:
        assert tokens == transformers_greedy(model.to(torch.float32), prompt, 8)
        weights = (directory / "model.safetensors").stat().st_size
        assert (tmp_path / "m.tdp").stat().st_size < 1.5 * weights  # the large ones as stored (fp32: 2x)
        _each_conversion_is_made_once_for_both_methods(tmp_path / "m.tdp")
    else:
        assert len(tokens) == 8


def _each_conversion_is_made_once_for_both_methods(path: Path) -> None:
    """prefill and decode run one model: the Cast of each bfloat16 weight both read is made once in it,
    at its top level (ONNX Runtime folds a constant once per graph: were it in each branch of a model
    of several, a float copy of the weight per branch)."""
    import onnx

    import torchdelegate as td
    from torchdelegate.backends.onnxruntime.blob_header import model_of

    with td.load(path) as program:
        blobs = [program.file.data(d.blob, "blob") for d in program.delegates]
        models = {bytes(model_of(blob, program.named_data)[1]) for blob in blobs}
    assert len(models) == 1
    top = onnx.ModelProto.FromString(models.pop()).graph
    assert not any(node.op_type == "If" for node in top.node)  # one partition: the model itself, no branch
    casts = [node for node in top.node if node.op_type == "Cast"]
    assert casts and len({node.input[0] for node in casts}) == len(casts)


SAMPLED_EXPORT = """
import json, sys, threading, time
# imported before the baseline: the libraries' code is not memory the export holds
import onnx, onnxruntime, onnxscript, torch, torch._dynamo, transformers
import torchdelegate.backends.onnxruntime.backend, torchdelegate.lowering.edge_program_manager
from torchdelegate.cli.main import main

def anonymous():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("RssAnon"))

peak = [anonymous()]
done = threading.Event()
def sample():
    while not done.wait(0.005):
        peak[0] = max(peak[0], anonymous())
baseline = anonymous()
threading.Thread(target=sample, daemon=True).start()
code = main(["llm", "export", sys.argv[1], "-o", sys.argv[2], "--max-cache", "32"])
done.set()
print(json.dumps({"code": code, "baseline": baseline, "peak": max(peak[0], anonymous())}))
"""


def _export_growth(directory: Path, vocabulary: int) -> tuple[int, int]:
    """(the checkpoint's bytes, the peak growth of anonymous memory while ``llm export`` runs) for a
    2-layer Llama of ``vocabulary`` tokens: the vocabulary sets the size of the weights, not the graph."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=vocabulary,
        max_position_embeddings=64,
    )
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(std=0.02)
    _save(directory, model)
    del model
    measured = subprocess.run(
        [sys.executable, "-c", SAMPLED_EXPORT, str(directory), str(directory / "m.tdp")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert measured.returncode == 0, measured.stderr
    result = json.loads(measured.stdout.strip().splitlines()[-1])
    assert result["code"] == 0
    return (directory / "model.safetensors").stat().st_size, result["peak"] - result["baseline"]


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc/self/status")
def test_the_anonymous_memory_llm_export_adds_does_not_grow_with_the_weights(tmp_path: Path) -> None:
    """Two Llamas whose weights differ by 220 MB (their vocabularies): the peak growth of anonymous
    memory during the whole ``llm export`` (read, export, decomposition, lowering, save) differs by
    a small fraction of that. The weights are the file's pages, let go as they are hashed and written,
    never a copy; what grows is the graphs'."""
    small_weights, small = _export_growth(tmp_path / "small", 8000)
    large_weights, large = _export_growth(tmp_path / "large", 64000)
    assert large_weights - small_weights > 200e6
    assert large - small < 0.1 * (large_weights - small_weights), (
        f"anonymous memory grew {small / 1e6:.0f} MB for {small_weights / 1e6:.0f} MB of weights, "
        f"{large / 1e6:.0f} MB for {large_weights / 1e6:.0f} MB"
    )
