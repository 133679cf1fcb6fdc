"""A checkpoint's own code (the Python files its ``auto_map`` names) never runs unless asked:
``llm export`` never asks on standard input, refuses such a checkpoint naming what it would run, and
with ``--trust-remote-code`` says which files run before running them. A file it wrote never runs
code when its tokenizer is read, whatever its assets' ``auto_map`` says."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
pytest.importorskip("onnxruntime")

from language_models import tiny_llama  # noqa: E402
from test_llm_command import _checkpoint, _prefix, _refused  # noqa: E402

from torchdelegate.errors import CheckpointError  # noqa: E402
from torchdelegate.llm.checkpoint import read_checkpoint  # noqa: E402

AUTO_MAP = {"AutoConfig": "configuration_own.OwnConfig", "AutoModelForCausalLM": "modeling_own.OwnForCausalLM"}
TOKENIZER_AUTO_MAP = {"AutoTokenizer": ["tokenization_own.OwnTokenizer", None]}


def _marking(name: str, marker: Path) -> str:
    """Python that leaves ``marker`` when it runs."""
    return f"from pathlib import Path\nPath({str(marker)!r}).write_text({name!r})\n"


def _checkpoint_with_code(directory: Path, model_type: str) -> Path:
    """A tiny Llama's checkpoint whose config.json names code of its own (a Llama under ``model_type``) and
    whose tokenizer_config.json names a tokenizer class of its own; each file leaves a marker when it runs."""
    _checkpoint(directory, tiny_llama(vocab_size=512))
    markers = directory.parent / "markers"
    markers.mkdir()
    (directory / "configuration_own.py").write_text(
        _marking("configuration", markers / "configuration")
        + f"from transformers import LlamaConfig\n\nclass OwnConfig(LlamaConfig):\n    model_type = {model_type!r}\n"
    )
    (directory / "modeling_own.py").write_text(
        _marking("modeling", markers / "modeling")
        + "from transformers import LlamaForCausalLM\nfrom .configuration_own import OwnConfig\n\n"
        "class OwnForCausalLM(LlamaForCausalLM):\n    config_class = OwnConfig\n"
    )
    (directory / "tokenization_own.py").write_text(_marking("tokenization", markers / "tokenization"))
    config = json.loads((directory / "config.json").read_text())
    config.update(model_type=model_type, auto_map=AUTO_MAP, architectures=["OwnForCausalLM"])
    (directory / "config.json").write_text(json.dumps(config))
    tokenizer_config = json.loads((directory / "tokenizer_config.json").read_text())
    tokenizer_config.update(auto_map=TOKENIZER_AUTO_MAP, tokenizer_class="OwnTokenizer")
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return directory


def _run(*args: str | Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    """The command with standard input answering yes to any question, and its own transformers module cache."""
    environment = {**os.environ, "HF_MODULES_CACHE": str(cwd / "modules"), "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [*_prefix(), *map(str, args)],
        input="yes\n" * 100,
        capture_output=True,
        text=True,
        cwd=cwd,
        env=environment,
        timeout=600,
    )


def _ran(tmp_path: Path) -> set[str]:
    return {marker.name for marker in (tmp_path / "markers").iterdir()}


def test_a_checkpoint_with_code_of_its_own_is_refused_without_asking(tmp_path: Path) -> None:
    """The attack: an unknown model_type with auto_map, and "yes" on standard input. Nothing runs; the one
    line names the directory, every auto_map entry of both files, and the flag."""
    checkpoint = _checkpoint_with_code(tmp_path / "checkpoint", "own_lm")
    result = _run("llm", "export", checkpoint, "-o", "m.tdp", "--max-cache", "16", cwd=tmp_path)
    assert _ran(tmp_path) == set()
    _refused(result, f"{checkpoint} holds code of its own")
    for entry in (
        "config.json's auto_map: AutoConfig: configuration_own.OwnConfig, "
        "AutoModelForCausalLM: modeling_own.OwnForCausalLM",
        "tokenizer_config.json's auto_map: AutoTokenizer: tokenization_own.OwnTokenizer",
        "give --trust-remote-code",
    ):
        assert entry in result.stderr
    assert not list(tmp_path.glob("*.tdp*")) and not (tmp_path / "modules").exists()


def test_a_checkpoint_transformers_knows_is_read_by_transformers_own_classes(tmp_path: Path) -> None:
    """auto_map beside a model_type transformers has (llama): its own classes read it, the checkpoint's code
    is not run, and the reader says so first."""
    checkpoint = _checkpoint_with_code(tmp_path / "checkpoint", "llama")
    told: list[str] = []
    read = read_checkpoint(checkpoint, notify=told.append)
    assert type(read.model).__name__ == "LlamaForCausalLM" and _ran(tmp_path) == set()
    assert told[0] == (
        "the checkpoint's own code is not run (config.json's auto_map: AutoConfig: configuration_own.OwnConfig, "
        "AutoModelForCausalLM: modeling_own.OwnForCausalLM): transformers' own LlamaForCausalLM reads it "
        "(--trust-remote-code would run the checkpoint's instead)"
    )


def test_trust_remote_code_says_which_files_run_and_runs_only_those(tmp_path: Path) -> None:
    """--trust-remote-code: the configuration and model files are named, then run, and the file is written;
    the tokenizer's code is not run (the file's tokenizer is tokenizer.json). The file carries the
    tokenizer_config.json naming that code, and generating from it runs none."""
    checkpoint = _checkpoint_with_code(tmp_path / "checkpoint", "own_lm")
    small = ("--max-cache", "16", "-b", "reference")
    exported = _run("llm", "export", checkpoint, "-o", "m.tdp", *small, "--trust-remote-code", cwd=tmp_path)
    assert exported.returncode == 0, exported.stderr
    assert _ran(tmp_path) == {"configuration", "modeling"}
    assert exported.stdout.startswith(
        f"running the checkpoint's own code (--trust-remote-code): {checkpoint}/configuration_own.py "
        f"(AutoConfig: OwnConfig), {checkpoint}/modeling_own.py (AutoModelForCausalLM: OwnForCausalLM)\n"
    ), exported.stdout
    assert (
        "not run: tokenizer_config.json's auto_map: AutoTokenizer: tokenization_own.OwnTokenizer (llm export reads "
        "the model as AutoModelForCausalLM, and the tokenizer from tokenizer.json with the tokenizers library)"
    ) in exported.stdout
    for marker in (tmp_path / "markers").iterdir():
        marker.unlink()
    import torchdelegate as td
    from torchdelegate.llm import Sampling
    from torchdelegate.llm.language_model import LanguageModel

    with td.load(tmp_path / "m.tdp") as program:
        assert json.loads(program.asset("tokenizer_config.json"))["auto_map"] == TOKENIZER_AUTO_MAP
        model = LanguageModel(program)
        generation = model.generator().generate(model.encode("It was"), 3, Sampling())
        assert len(generation.tokens) == 3 and model.decode(generation.tokens)
    assert _ran(tmp_path) == set()


def test_code_outside_the_directory_or_missing_from_it_is_refused_before_anything_runs(tmp_path: Path) -> None:
    """Trusted or not, auto_map naming a file the directory lacks, or another repository's code, is refused."""
    checkpoint = _checkpoint_with_code(tmp_path / "checkpoint", "own_lm")
    (checkpoint / "modeling_own.py").unlink()
    with pytest.raises(CheckpointError, match=r"names modeling_own.OwnForCausalLM, and there is no modeling_own.py"):
        read_checkpoint(checkpoint, trust_remote_code=True)
    config = json.loads((checkpoint / "config.json").read_text())
    config["auto_map"]["AutoModelForCausalLM"] = "someone/else--modeling_own.OwnForCausalLM"
    (checkpoint / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"llm export runs no code from elsewhere"):
        read_checkpoint(checkpoint, trust_remote_code=True)
    (checkpoint / "config.json").write_text("{")
    with pytest.raises(CheckpointError, match=r"config.json cannot be read \(JsonLimitError: not JSON"):
        read_checkpoint(checkpoint)
    assert _ran(tmp_path) == set()


def test_a_hostile_config_is_a_checkpoint_error_not_a_hang_or_a_traceback(tmp_path: Path) -> None:
    """config.json nested 100,000 deep raised RecursionError; a FIFO in its place hung llm export."""
    from torchdelegate.llm.checkpoint_code import checkpoint_code

    (tmp_path / "deep").mkdir()
    (tmp_path / "deep" / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(CheckpointError, match=r"config\.json cannot be read \(JsonLimitError: JSON nesting deeper"):
        checkpoint_code(tmp_path / "deep")
    (tmp_path / "fifo").mkdir()
    os.mkfifo(tmp_path / "fifo" / "config.json")
    with pytest.raises(CheckpointError, match=r"config\.json is not a JSON file of at most"):
        checkpoint_code(tmp_path / "fifo")
