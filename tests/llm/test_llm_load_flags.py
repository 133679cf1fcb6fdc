"""``llm generate``, ``llm chat`` and ``llm serve`` load a file as ``run`` does: ``--import`` for the
module that defines a backend or operator, ``--trust`` for a backend that runs native code (the flags
their own errors name), ``--external-data`` and ``--backend-option``."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
pytest.importorskip("onnxruntime")

from backends_for_tests import installed_distribution  # noqa: E402
from language_models import tiny_llama  # noqa: E402
from test_llm_command import _checkpoint, _prefix  # noqa: E402

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


@pytest.mark.parametrize("command", ["run", "inspect", "prepare", "llm generate", "llm chat", "llm serve"])
def test_every_command_that_loads_a_file_takes_the_same_loading_flags(command: str) -> None:
    given = ["--trust", "inductor", "--backend-option", "onnxruntime.intra_op_num_threads=2"]
    given += ["--import", "json", "--external-data", "m.tdd"]
    extra = {"llm generate": ["-p", "x"]}.get(command, [])
    args = command_line().parse_args([*command.split(), "m.tdp", *given, *extra])
    assert args.trust == ["inductor"] and args.backend_options == ["onnxruntime.intra_op_num_threads=2"]
    assert args.imports == ["json"] and args.external_data == Path("m.tdd")


def test_serve_imports_what_the_file_needs_in_every_process_that_loads_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--import reaches the processes that prepare and serve the file (spawned, they import nothing of
    the command's by themselves): a backend defined in a module of the current directory serves."""
    monkeypatch.delenv(td.TRUSTED_BACKENDS_VARIABLE, raising=False)
    monkeypatch.delenv("TORCHDELEGATE_API_KEY", raising=False)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "llm_native_backend.py").write_text(BACKEND)
    _checkpoint(tmp_path / "checkpoint", tiny_llama(vocab_size=512))
    export = ["llm", "export", "checkpoint", "-o", "n.tdp", "--max-cache", "16", "-b", "test_llm_native"]
    assert main([*export, "--import", "llm_native_backend"]) == 0
    serve = [*_prefix(), "llm", "serve", "n.tdp", "--port", "0", "--trust", "test_llm_native"]
    refused = subprocess.run(serve, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 1 and "(with this command: --import MODULE)" in refused.stderr, refused.stderr
    _completes_two_tokens([*serve, "--import", "llm_native_backend"], os.environ.copy(), tmp_path / "stderr.txt")


def _completes_two_tokens(serve: list[str], environment: dict[str, str], stderr: Path) -> None:
    """Starts the server, asks it for two tokens, and stops it."""
    with subprocess.Popen(serve, env=environment, stdout=subprocess.PIPE, stderr=stderr.open("w"), text=True) as server:
        try:
            url = _served_at(server)
            assert url is not None, stderr.read_text()
            body = json.dumps({"model": "n", "prompt": "It was", "max_tokens": 2, "temperature": 0}).encode()
            request = urllib.request.Request(f"{url}/completions", body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=60) as reply:
                assert reply.status == 200 and json.loads(reply.read())["usage"]["completion_tokens"] == 2
        finally:
            server.terminate()
            server.wait(timeout=60)


INSTALLED = BACKEND.replace("test_llm_native", "installed_llm_native")


def _installed(site: Path) -> Path:
    """A distribution in ``site`` whose entry point names a backend that runs native code."""
    return installed_distribution(site, "installed_llm_native", INSTALLED, "installed_llm_native", "NativeLike")


def test_serve_trusts_a_native_backend_in_the_processes_that_load_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server loads the file in its own process, prepares it in another and runs it in workers:
    --trust reaches all three (without it, the one line asks for it)."""
    monkeypatch.delenv(td.TRUSTED_BACKENDS_VARIABLE, raising=False)
    monkeypatch.delenv("TORCHDELEGATE_API_KEY", raising=False)
    monkeypatch.chdir(tmp_path)
    site = _installed(tmp_path / "site")
    monkeypatch.syspath_prepend(str(site))
    _checkpoint(tmp_path / "checkpoint", tiny_llama(vocab_size=512))
    export = ["llm", "export", "checkpoint", "-o", "n.tdp", "--max-cache", "16", "-b", "installed_llm_native"]
    assert main([*export, "--import", "installed_llm_native"]) == 0
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    serve = [*_prefix(), "llm", "serve", "n.tdp", "--port", "0"]
    refused = subprocess.run(serve, capture_output=True, text=True, env=environment, timeout=120)
    assert refused.returncode == 1 and "--trust" in refused.stderr, refused.stderr
    _completes_two_tokens([*serve, "--trust", "installed_llm_native"], environment, tmp_path / "stderr.txt")


def _served_at(server: subprocess.Popen[str]) -> str | None:
    """The URL the server prints once its workers are ready; None if it stops first."""
    assert server.stdout is not None
    for line in server.stdout:
        if line.startswith("serving "):
            found = re.search(r"at (http://127\.0\.0\.1:\d+/v1)", line)
            return found.group(1) if found else None
    return None
