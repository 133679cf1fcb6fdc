"""``llm generate``, ``llm chat`` and ``llm serve`` load a file as ``run`` does: ``--import`` for the
module that defines a backend or operator, ``--trust`` for a backend that runs native code (the flags
their own errors name), ``--external-data`` and ``--backend-option``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
pytest.importorskip("onnxruntime")

from language_models import tiny_llama  # noqa: E402
from test_llm_command import _checkpoint  # noqa: E402

import torchdelegate as td  # noqa: E402
from torchdelegate.cli import main  # noqa: E402
from torchdelegate.cli.main import command_line  # noqa: E402
from torchdelegate.delegate import backend_details  # noqa: E402

BACKEND = '''
from torchdelegate.backends.reference import ReferenceBackend


class NativeLike(ReferenceBackend):
    """The reference backend declaring native code, as AOTInductor does: a loader must trust it."""

    backend_id = "test_llm_native"
    runs_native_code = True
'''


def test_generate_takes_the_import_and_trust_its_errors_ask_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A file lowered to a backend defined in the user's module, which runs native code: without
    --import, the error asks for it; with it, for --trust; with both, text is generated."""
    monkeypatch.delenv(td.TRUSTED_BACKENDS_VARIABLE, raising=False)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "llm_native_backend.py").write_text(BACKEND)
    _checkpoint(tmp_path / "checkpoint", tiny_llama(vocab_size=512))
    export = ["llm", "export", "checkpoint", "-o", "n.tdp", "--max-cache", "16", "-b", "test_llm_native"]
    assert main([*export, "--import", "llm_native_backend"]) == 0, capsys.readouterr().err
    monkeypatch.delitem(backend_details._REGISTRY, "test_llm_native")  # a fresh process: the module not imported
    monkeypatch.delitem(sys.modules, "llm_native_backend")
    generate = ["llm", "generate", "n.tdp", "-p", "It was", "--max-new-tokens", "2"]
    capsys.readouterr()
    assert main(generate) == 1
    assert capsys.readouterr().err.endswith("(with this command: --import MODULE)\n")
    assert main([*generate, "--import", "llm_native_backend"]) == 1
    refused = capsys.readouterr().err
    assert "backend 'test_llm_native' runs native code from the file" in refused and "--trust" in refused
    assert main([*generate, "--import", "llm_native_backend", "--trust", "test_llm_native"]) == 0
    assert "prompt 2 tokens, 2 generated" in capsys.readouterr().out


@pytest.mark.parametrize("command", ["generate", "chat", "serve"])
def test_every_llm_command_that_loads_a_file_takes_runs_loading_flags(command: str) -> None:
    given = ["--trust", "inductor", "--backend-option", "onnxruntime.intra_op_num_threads=2"]
    if command != "serve":  # a server's workers load the file themselves: see the report
        given += ["--import", "json", "--external-data", "m.tdd"]
    args = command_line().parse_args(["llm", command, "m.tdp", *given, *(["-p", "x"] if command == "generate" else [])])
    assert args.trust == ["inductor"] and args.backend_options == ["onnxruntime.intra_op_num_threads=2"]
    if command != "serve":
        assert args.imports == ["json"] and args.external_data == Path("m.tdd")
