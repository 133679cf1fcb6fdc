"""The commands on a file `llm export` wrote, in processes where torch cannot be imported (every
process started, the serve workers too, finds an import of torch or transformers refused, as where
neither is installed), and in one where torch is installed but never imported: `llm generate`,
`llm chat`, `llm serve`, `run` and `inspect` work, giving transformers' greedy tokens; `lower`,
`llm export` and `demo` say in one line that they need torch."""

from __future__ import annotations

import http.client
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
pytest.importorskip("onnxruntime")

from blocked_imports import blocked_environment, blocking_site  # noqa: E402
from language_models import tiny_llama, transformers_greedy  # noqa: E402
from test_llm_command import CHAT, _checkpoint, _command, _generated_ids, _prefix, _tokenizer  # noqa: E402

CACHE = 32
PROMPT = "It was the best of times"


class Exported:
    """The file the tests share, with the model and tokenizer it was exported from."""

    def __init__(self, place: Path, model: torch.nn.Module, tokenizer: Any) -> None:
        self.place, self.model, self.tokenizer = place, model, tokenizer
        self.site = place / "site"  # sitecustomize.py: every Python process started with it on the path blocks

    def without(
        self, *args: str, blocked: str = "torch,transformers", stdin: str | None = None, command: bool = True
    ) -> subprocess.CompletedProcess[str]:
        """``torchdelegate ARGS`` (``command``; else ARGS alone) run where the ``blocked`` libraries
        (comma-separated) cannot be imported."""
        line = [*_prefix(), *args] if command else list(args)
        environment = self.environment(blocked)
        return subprocess.run(
            line, input=stdin, capture_output=True, text=True, cwd=self.place, env=environment, timeout=300
        )

    def environment(self, blocked: str = "torch,transformers") -> dict[str, str]:
        """This process's environment, with the blocker on the path of every process started in it."""
        return blocked_environment(self.site, blocked)


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Exported:
    """A tiny Llama with a chat template, exported by ``llm export`` (a cache of 32), and the
    ``sitecustomize.py`` that blocks imports in the processes the tests start."""
    place = tmp_path_factory.mktemp("without_torch")
    model = tiny_llama(vocab_size=512)
    checkpoint = _checkpoint(place / "checkpoint", model)
    tokenizer = _tokenizer()
    tokenizer.chat_template = CHAT  # type: ignore[attr-defined]
    tokenizer.save_pretrained(checkpoint)  # type: ignore[attr-defined]
    result = _command("llm", "export", "checkpoint", "-o", "m.tdp", "--max-cache", str(CACHE), cwd=place)
    assert result.returncode == 0, result.stderr
    blocking_site(place / "site")
    np.save(place / "ids.npy", np.array([[5]], dtype=np.int64))
    np.save(place / "position.npy", np.array([0], dtype=np.int64))
    files = Exported(place, model, tokenizer)
    blocked = files.without(sys.executable, "-c", "import torch", command=False)
    assert "ModuleNotFoundError: No module named 'torch'" in blocked.stderr, blocked.stderr  # the blocker works
    return files


def _greedy(exported: Exported, text: str, new: int) -> list[int]:
    return transformers_greedy(exported.model, exported.tokenizer.encode(text), new)


def test_generate_without_torch_gives_the_tokens_torch_gives_on_the_file_and_transformers_gives(
    exported: Exported,
) -> None:
    generate = ("llm", "generate", "m.tdp", "--prompt", PROMPT, "--max-new-tokens", "8", "--ids")
    without = exported.without(*generate)
    assert without.returncode == 0 and "Traceback" not in without.stderr, without.stderr
    ids = _generated_ids(without.stdout)
    assert ids == _greedy(exported, PROMPT, 8)
    import torchdelegate as td
    from torchdelegate.llm.language_model import LanguageModel

    with td.load(exported.place / "m.tdp", engine="torch") as program:  # the same file run by torch
        model = LanguageModel(program)
        assert model.generator().generate(model.encode(PROMPT), 8).tokens == ids


def test_chat_without_torch_answers_as_transformers_does(exported: Exported) -> None:
    chat = exported.without("llm", "chat", "m.tdp", "--ids", "--max-new-tokens", "4", stdin="hello there\n")
    assert chat.returncode == 0 and "error" not in chat.stderr, chat.stderr
    (reply,) = re.findall(r"token ids: \[([0-9, ]*)\]", chat.stdout)
    messages = [{"role": "user", "content": "hello there"}]
    prompt = exported.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    assert [int(t) for t in reply.split(", ")] == transformers_greedy(exported.model, prompt, 4)


def test_run_and_inspect_without_torch(exported: Exported) -> None:
    """``run`` reads .npy inputs and prints and saves the outputs as arrays, equal to what the file
    gives torch tensors in this process; ``inspect`` describes the file, and says that reading its
    saved partition report needs torch (an error in one line where the report is asked for)."""
    run = ("run", "m.tdp", "-m", "decode", "-i", "input_ids=ids.npy", "-i", "cache_position=position.npy")
    ran = exported.without(*run, "--save", "out.npz")
    assert ran.returncode == 0 and "Traceback" not in ran.stderr, ran.stderr
    assert "decode: 1 output(s) in" in ran.stdout and "output_0: float32[1, 1, 512] [" in ran.stdout, ran.stdout
    import torchdelegate as td

    with td.load(exported.place / "m.tdp") as program:
        expected = program.run("decode", input_ids=torch.tensor([[5]]), cache_position=torch.tensor([0]))
    np.testing.assert_allclose(np.load(exported.place / "out.npz")["output_0"], expected.numpy(), rtol=1e-5, atol=1e-6)
    inspected = exported.without("inspect", "m.tdp")
    assert inspected.returncode == 0 and "Traceback" not in inspected.stderr, inspected.stderr
    # decode is exported as prefill is: a prompt of any length, one token at a time when generating
    signature = r"decode\(input_ids: int64\[1, (s[0-9]+)\], cache_position: int64\[\1\]\)  delegates: [^\n]*\n"
    assert re.search(signature + rf"    sizes: \1 from 1 to {CACHE - 1}\n", inspected.stdout), inspected.stdout
    assert "onnxruntime: " in inspected.stdout and "assets: chat_template.jinja" in inspected.stdout
    needs = "reading the saved partition report needs torch (No module named 'torch'): pip install torchdelegate"
    assert f"report: saved; {needs}" in inspected.stdout
    in_full = exported.without("inspect", "m.tdp", "--report")
    assert in_full.returncode == 1 and in_full.stderr.startswith(f"torchdelegate: error: m.tdp: {needs}"), (
        in_full.stderr
    )


def test_generating_where_torch_is_installed_never_imports_it(exported: Exported) -> None:
    """generate and run in one process that has torch and transformers to import: neither is. (inspect
    reads the saved partition report with lowering's classes, which import torch.)"""
    script = (
        "import sys\nfrom torchdelegate.cli.main import main\n"
        "for argv in (['llm', 'generate', 'm.tdp', '-p', 'It was', '--max-new-tokens', '3', '--ids'],\n"
        "             ['run', 'm.tdp', '-m', 'decode', '-i', 'ids.npy', '-i', 'position.npy']):\n"
        "    assert main(argv) == 0, argv\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=exported.place, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "[]", result.stdout
    assert _generated_ids(result.stdout) == _greedy(exported, "It was", 3)


def test_lowering_without_torch_says_so_in_one_line(exported: Exported) -> None:
    """lower, llm export and demo need torch: one line naming it and the install that has it; --help
    needs none; llm export where transformers alone is missing names it and its extra."""
    install = "pip install torchdelegate (the full distribution; torchdelegate-runtime only runs files)"
    for args, what in (
        (("lower", "forward=x.pt2", "-b", "onnxruntime", "-o", "x.tdp"), "lowering"),
        (("llm", "export", "checkpoint", "-o", "x.tdp"), "lowering"),
        (("demo",), "the demo"),
    ):
        result = exported.without(*args)
        assert result.returncode == 1 and result.stderr.count("\n") == 1, result.stderr
        assert result.stderr == (
            f"torchdelegate: error: {what} needs torch, which cannot be imported here "
            f"(No module named 'torch'): {install}\n"
        )
    helped = exported.without("lower", "--help")
    assert helped.returncode == 0 and "METHOD=FILE.pt2" in helped.stdout, helped.stderr
    exporting = exported.without("llm", "export", "checkpoint", "-o", "x.tdp", blocked="transformers")
    assert exporting.returncode == 1 and exporting.stderr.count("\n") == 1, exporting.stderr
    assert exporting.stderr.startswith("torchdelegate: error: this needs transformers, which cannot be imported here")
    assert exporting.stderr.endswith("pip install 'torchdelegate[llm]'\n")
    assert not (exported.place / "x.tdp").exists()


def test_serve_without_torch_answers_from_workers_that_hold_only_the_runtime(exported: Exported) -> None:
    """``llm serve`` and its worker (a process of its own, which would fail to start had it to import
    torch) answer a completion with transformers' greedy text; SIGTERM stops it."""
    environment = {**exported.environment(), "TORCHDELEGATE_CACHE": str(exported.place / "cache")}
    process = subprocess.Popen(
        [*_prefix(), "llm", "serve", "m.tdp", "--port", "0", "--workers", "1"],
        cwd=exported.place,
        env=environment,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        address = _serving_address(process)
        body = json.dumps({"model": "m", "prompt": PROMPT, "max_tokens": 6, "temperature": 0})
        connection = http.client.HTTPConnection(*address, timeout=60)
        connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        reply = json.loads(connection.getresponse().read())
        connection.close()
        expected = exported.tokenizer.decode(_greedy(exported, PROMPT, 6), skip_special_tokens=True)
        assert reply["choices"][0]["text"] == expected, reply
    finally:
        process.send_signal(signal.SIGTERM)
        stdout, stderr = process.communicate(timeout=60)
    assert process.returncode == 0 and "Traceback" not in stderr, stderr


def _serving_address(process: subprocess.Popen[str]) -> tuple[str, int]:
    """The host and port the server says it serves at, once it says so."""
    assert process.stdout is not None
    lines = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (line := process.stdout.readline()):
        lines.append(line)
        found = re.search(r"at http://(127\.0\.0\.1):(\d+)/v1", line)
        if line.startswith("serving ") and found:
            return found.group(1), int(found.group(2))
    process.kill()
    pytest.fail(f"the server did not start: {''.join(lines)}{process.communicate(timeout=30)[1]}")
