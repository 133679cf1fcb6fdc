"""What the docs show is what the commands print: torchao's first import (transformers makes it
wherever torchao is installed) logs about kernels a CPU build cannot load and torch's pytree about a
deprecated registration; none of that reaches a command's output. Our llm and quantization modules
import torchao only to quantize."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
pytest.importorskip("onnxruntime")
pytest.importorskip("torchao")

from language_models import tiny_llama  # noqa: E402
from test_llm_command import _checkpoint  # noqa: E402

NOISE = ("Failed to load", "_C_mxfp8", "register_constant", "_pytree", "treespec", "Warning:")
MODULES = [
    "torchdelegate.llm.checkpoint",
    "torchdelegate.llm.checkpoint_code",
    "torchdelegate.llm.lazy_checkpoint",
    "torchdelegate.llm.language_model",
    "torchdelegate.quantization.recipes",
    "torchdelegate.quantization.experts",
    "torchdelegate.backends.onnxruntime.partitioner",
]


def _command(*args: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [sys.executable, "-m", "torchdelegate", *args], capture_output=True, text=True, timeout=180, check=False
    )
    assert done.returncode == 0, done.stderr
    return done


def _noise(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if any(marker in line for marker in NOISE)]


def test_importing_our_llm_and_quantization_modules_does_not_import_torchao() -> None:
    script = f"import importlib, sys\nfor m in {MODULES!r}: importlib.import_module(m)\nprint('torchao' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def test_llm_commands_print_no_third_party_noise(tmp_path: Path) -> None:
    """``llm export --quantize`` (torchao imported by transformers, then by quantizing) and ``llm
    generate`` on its file (which quantizes nothing) print their own lines only."""
    checkpoint, program = (
        _checkpoint(tmp_path / "checkpoint", tiny_llama(hidden_size=32, vocab_size=512)),
        tmp_path / "m.tdp",
    )
    exported = _command("llm", "export", str(checkpoint), "-o", str(program), "--max-cache", "16", "--quantize")
    assert "quantized with 8da4w-asym" in exported.stdout
    assert _noise(exported.stderr) == []
    generated = _command("llm", "generate", str(program), "-p", "It was", "--max-new-tokens", "2")
    assert _noise(generated.stderr) == []
    assert "tokens/s" in generated.stdout
