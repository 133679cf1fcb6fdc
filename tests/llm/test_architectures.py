"""The zoo's decoder-only architectures through ``torchdelegate llm export`` and ``llm generate``:
greedy tokens equal to transformers' generate; those transformers' exportable wrapper cannot
export with a static cache refused in one line; mixtures of experts generated from in a fresh
process, which has not imported transformers. (Llama and Qwen2 are in test_llm_command.py.)"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
pytest.importorskip("onnxruntime")

from language_models import tiny_mixtral, tiny_qwen2_moe, transformers_greedy  # noqa: E402
from zoo.models import CAUSAL_LMS, VOCAB  # noqa: E402

from torchdelegate.cli.main import main  # noqa: E402

EXPORTED = ["gemma", "phi3", "gpt2", "mistral", "phi", "gpt-neox", "qwen3"]
REFUSED = {  # what the one line begins with
    "falcon": "FalconForCausalLM does not export with a static cache",  # transformers' wrapper fails
    # Exported, but its graph keeps an operator a saved file may not call: no file written
    "opt": "method 'prefill': the graph calls 'torch.ops.aten.sym_storage_offset.default'",
}
PROMPT = [5, 9, 17, 33, 2, 70, 101, 64, 12, 3]  # read by one prefill of dynamic length


MIXTURES: dict[str, tuple[Callable[[], torch.nn.Module], list[str]]] = {  # and how each is exported
    "qwen2-moe": (tiny_qwen2_moe, []),
    "mixtral": (tiny_mixtral, ["--prefill-chunk", "4"]),  # decode exported on its own
}


def _checkpoint(directory: Path, architecture: str) -> tuple[torch.nn.Module, Path]:
    """The zoo's model saved as save_pretrained does, beside a word-level tokenizer of its vocabulary."""
    torch.manual_seed(0)
    return _saved(CAUSAL_LMS[architecture](), directory)


def _saved(model: torch.nn.Module, directory: Path) -> tuple[torch.nn.Module, Path]:
    from tokenizers import Tokenizer, models, pre_tokenizers

    model.generation_config.eos_token_id = None  # random weights: no stop token, a full run to compare
    model.config.eos_token_id = None
    model.save_pretrained(directory)
    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(directory / "tokenizer.json"))
    return model, directory


@pytest.mark.parametrize("architecture", EXPORTED)
def test_export_then_generate_gives_transformers_greedy_tokens(
    tmp_path: Path, architecture: str, capsys: pytest.CaptureFixture[str]
) -> None:
    model, checkpoint = _checkpoint(tmp_path / "checkpoint", architecture)
    program = tmp_path / "m.tdp"
    assert main(["llm", "export", str(checkpoint), "-o", str(program), "--max-cache", "24"]) == 0
    prompt = " ".join(f"w{i}" for i in PROMPT)
    capsys.readouterr()
    assert main(["llm", "generate", str(program), "-p", prompt, "--max-new-tokens", "8", "--ids"]) == 0
    found = re.search(r"token ids: \[([0-9, ]*)\]", capsys.readouterr().out)
    assert found is not None
    assert [int(t) for t in found.group(1).split(", ")] == transformers_greedy(model, PROMPT, 8)


@pytest.mark.parametrize("architecture", sorted(REFUSED))
def test_an_architecture_that_cannot_be_exported_or_saved_is_refused_in_one_line(
    tmp_path: Path, architecture: str, capsys: pytest.CaptureFixture[str]
) -> None:
    model, checkpoint = _checkpoint(tmp_path / "checkpoint", architecture)
    capsys.readouterr()  # save_pretrained's progress bar
    assert main(["llm", "export", str(checkpoint), "-o", str(tmp_path / "m.tdp")]) == 1
    *progress, error = capsys.readouterr().err.splitlines()
    assert error.startswith(f"torchdelegate: error: {REFUSED[architecture]}"), error
    assert all(line.startswith("preprocess ") for line in progress), progress  # lowering's, where it got that far
    assert not list(tmp_path.glob("*.tdp")) and not list(tmp_path.glob(".*.partial"))
    assert json.loads((checkpoint / "config.json").read_text())["architectures"] == [type(model).__name__]


def test_a_failed_export_leaves_the_model_as_it_was() -> None:
    """The hook that keeps prefill's last logits is gone after the export failed, as after one that ran."""
    from torchdelegate.errors import CheckpointError
    from torchdelegate.llm.checkpoint import export_methods

    model = CAUSAL_LMS["falcon"]()
    with pytest.raises(CheckpointError, match="FalconForCausalLM does not export with a static cache"):
        export_methods(model, 24, None)
    assert not model._forward_pre_hooks and "forward" not in vars(model)


def _generated_in_a_fresh_process(program: Path) -> list[int]:
    """``llm generate``'s greedy token ids after PROMPT, in a process that imported nothing first."""
    prompt = " ".join(f"w{i}" for i in PROMPT)
    command = ["llm", "generate", str(program), "-p", prompt, "--max-new-tokens", "8", "--ids"]
    done = subprocess.run(
        [sys.executable, "-m", "torchdelegate", *command], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    found = re.search(r"token ids: \[([0-9, ]*)\]", done.stdout)
    assert found is not None, done.stdout
    return [int(t) for t in found.group(1).split(", ")]


@pytest.mark.parametrize("architecture", sorted(MIXTURES))
def test_a_mixture_of_experts_generates_transformers_greedy_tokens_in_a_fresh_process(
    tmp_path: Path, architecture: str
) -> None:
    """The experts are exported as core ATen, prefill and decode alike: the file calls no operator
    transformers registers."""
    made, flags = MIXTURES[architecture]
    model, checkpoint = _saved(made(), tmp_path / "checkpoint")
    program = tmp_path / "m.tdp"
    assert main(["llm", "export", str(checkpoint), "-o", str(program), "--max-cache", "24", *flags]) == 0
    assert _generated_in_a_fresh_process(program) == transformers_greedy(model, PROMPT, 8)
    assert model.get_experts_implementation()[""] == "grouped_mm"  # the model's own choice, given back


def test_an_export_that_calls_another_librarys_operator_writes_no_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Experts left on transformers' own path call an operator transformers registers: the file could not
    run in a fresh process, so none is written and the one line names the operator."""
    import contextlib

    from torchdelegate.llm import checkpoint as checkpoint_module

    monkeypatch.setattr(checkpoint_module, "exportable_experts", lambda model: contextlib.nullcontext())
    _, checkpoint = _saved(tiny_qwen2_moe(), tmp_path / "checkpoint")
    program = tmp_path / "m.tdp"
    assert main(["llm", "export", str(checkpoint), "-o", str(program), "--max-cache", "24"]) == 1
    error = capsys.readouterr().err.splitlines()[-1]  # (building the model here imported torchao, which logs)
    assert error.startswith("torchdelegate: error: Qwen2MoeForCausalLM's exported prefill calls "), error
    assert "transformers.grouped_mm_fallback.default, which another library registers" in error
    assert not program.exists()
