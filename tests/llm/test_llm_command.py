"""`torchdelegate llm export DIR` then `llm generate FILE`: a checkpoint saved with save_pretrained,
beside a tokenizer trained here, to generated tokens equal to transformers' generate."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
pytest.importorskip("onnxruntime")

from language_models import tiny_llama, tiny_qwen2, transformers_greedy  # noqa: E402
from zoo.models import CAUSAL_LMS  # noqa: E402

TEXT = [
    "It was the best of times, it was the worst of times, it was the age of wisdom.",
    "Call me Ishmael. Some years ago, never mind how long precisely, having little money in my purse.",
    "The quick brown fox jumps over the lazy dog, and the dog sleeps on in the sun.",
]
CACHE = 48


def _tokenizer() -> object:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<unk>", "<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(TEXT, trainer)
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def _checkpoint(directory: Path, model: torch.nn.Module) -> Path:
    model.generation_config.eos_token_id = None  # random weights: no stop token, a full run to compare
    model.config.eos_token_id = None
    model.save_pretrained(directory)
    _tokenizer().save_pretrained(directory)  # type: ignore[attr-defined]
    return directory


def _prefix() -> list[str]:
    script = Path(sys.executable).parent / "torchdelegate"
    return [str(script)] if script.exists() else [sys.executable, "-m", "torchdelegate.cli"]


def _command(*args: str | Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*_prefix(), *map(str, args)], capture_output=True, text=True, cwd=cwd, timeout=600)


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
def test_export_then_generate_gives_transformers_greedy_tokens(tmp_path: Path, architecture: str) -> None:
    model = tiny_llama(vocab_size=512) if architecture == "llama" else tiny_qwen2()
    checkpoint = _checkpoint(tmp_path / "checkpoint", model)
    # Llama's prefill reads 8 tokens at a time (static shapes) and gives the last one's logits (the
    # default); Qwen2's reads a prompt of any length and gives every position's
    chunk = ("--prefill-chunk", "8") if architecture == "llama" else ("--prefill-logits", "all")
    exported = _in_process("llm", "export", checkpoint, "-o", "m.tdp", "--max-cache", str(CACHE), *chunk, cwd=tmp_path)
    assert exported.returncode == 0, exported.stderr
    assert "tokenizer and generation settings included" in exported.stdout
    static = architecture == "llama"
    assert ("8 tokens at a time" if static else f"prompts of 1 to {CACHE - 1} tokens") in exported.stdout
    # decode, exported as prefill is, is compiled once for both (the compile cache is off here)
    once = "of method 'decode', as partition 'onnxruntime_0' of method 'prefill'"
    assert (once not in exported.stderr) if static else (once in exported.stderr), exported.stderr
    import torchdelegate as td

    with td.load(tmp_path / "m.tdp") as program:
        assert program.method("prefill").input_shape("input_ids") == (1, 8 if static else None)
        assert program.method("decode").input_shape("input_ids") == (1, 1 if static else None)
        assert json.loads(program.asset("torchdelegate_llm.json"))["prefill_logits"] == ("last" if static else "all")
        logits = program.run("prefill", input_ids=torch.zeros(1, 8, dtype=torch.long), cache_position=torch.arange(8))
        assert logits.shape[1] == (1 if static else 8)
    prompt = "It was the best of times"
    generated = _command(
        "llm", "generate", "m.tdp", "--prompt", prompt, "--max-new-tokens", "10", "--ids", cwd=tmp_path
    )
    assert generated.returncode == 0, generated.stderr
    ids = _generated_ids(generated.stdout)
    prompt_ids = _tokenizer().encode(prompt)  # type: ignore[attr-defined]
    assert ids == transformers_greedy(model, prompt_ids, 10)
    assert re.search(
        r"time to first token [0-9.]+ ms; prompt [0-9]+ tokens/s, generation [0-9.]+ tokens/s", generated.stdout
    )


def _small_program(tmp_path: Path, checkpoint: str, program: str) -> None:
    """A tiny Llama's checkpoint in ``tmp_path / checkpoint``, exported to ``program``: a cache of 16, prefill 4."""
    _checkpoint(tmp_path / checkpoint, tiny_llama(vocab_size=512))
    export = ("llm", "export", checkpoint, "-o", program, "--max-cache", "16", "--prefill-chunk", "4")
    assert _in_process(*export, cwd=tmp_path).returncode == 0


def _generated_ids(stdout: str) -> list[int]:
    """The token ids ``llm generate --ids`` printed."""
    found = re.search(r"token ids: \[([0-9, ]*)\]", stdout)
    assert found is not None, stdout
    return [int(t) for t in found.group(1).split(", ")]


def _in_process(*args: str | Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``torchdelegate ARGS`` run by this process's ``main`` in ``cwd``: what a fresh process prints and
    returns, without starting one (an export that fails early fails in a fraction of torch's import)."""
    import contextlib
    import io
    import os

    from torchdelegate.cli import main

    out, err = io.StringIO(), io.StringIO()
    here = Path.cwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main([str(a) for a in args])
    finally:
        os.chdir(here)
    return subprocess.CompletedProcess(["torchdelegate", *map(str, args)], code, out.getvalue(), err.getvalue())


def _refused(result: subprocess.CompletedProcess[str], message: str) -> None:
    assert result.returncode == 1, result.stderr
    assert result.stderr.startswith(f"torchdelegate: error: {message}") and result.stderr.count("\n") == 1, (
        result.stderr
    )


def test_a_checkpoint_that_cannot_be_exported_is_one_line_and_leaves_no_file(tmp_path: Path) -> None:
    """Each CheckpointError: unreadable or missing weights, no tokenizer, an architecture that does not export."""
    checkpoint = _checkpoint(tmp_path / "checkpoint", tiny_llama(vocab_size=512))
    weights = checkpoint / "model.safetensors"
    good = weights.read_bytes()
    weights.write_bytes(good[: len(good) // 3])
    _refused(_in_process("llm", "export", checkpoint, "-o", "m.tdp", cwd=tmp_path), f"{checkpoint}: its weights cannot")
    weights.unlink()
    _refused(_in_process("llm", "export", checkpoint, "-o", "m.tdp", cwd=tmp_path), f"{checkpoint}: its weights cannot")
    bert = tmp_path / "bert"
    shape = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64}
    transformers.BertModel(transformers.BertConfig(**shape)).save_pretrained(bert)
    _tokenizer().save_pretrained(bert)  # type: ignore[attr-defined]
    _refused(  # a base model: no head, which transformers would make random
        _in_process("llm", "export", bert, "-o", "m.tdp", cwd=tmp_path),
        f"{bert}: its weights hold no tensor for cls.predictions.bias",
    )
    falcon = tmp_path / "falcon"
    CAUSAL_LMS["falcon"]().save_pretrained(falcon)
    _tokenizer().save_pretrained(falcon)  # type: ignore[attr-defined]
    _refused(
        _in_process("llm", "export", falcon, "-o", "m.tdp", cwd=tmp_path),
        "FalconForCausalLM does not export with a static cache",
    )
    weights.write_bytes(good)
    _refused(
        _in_process("llm", "export", checkpoint, "-o", "m.tdp", "--max-cache", "65", cwd=tmp_path),
        "a cache of 65 positions: LlamaForCausalLM has positions for 64 tokens (its config); give --max-cache 64",
    )
    (checkpoint / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }")
    _refused(
        _in_process("llm", "export", checkpoint, "-o", "m.tdp", cwd=tmp_path),
        f"{checkpoint}/chat_template.jinja is not a template jinja2 reads",
    )
    (checkpoint / "chat_template.jinja").unlink()
    tokenizer = (checkpoint / "tokenizer.json").read_text()
    (checkpoint / "tokenizer.json").write_text(tokenizer[: len(tokenizer) // 2])
    _refused(
        _in_process("llm", "export", checkpoint, "-o", "m.tdp", cwd=tmp_path),
        f"{checkpoint}/tokenizer.json cannot be read by the tokenizers library",
    )
    (checkpoint / "tokenizer.json").unlink()
    _refused(
        _in_process("llm", "export", checkpoint, "-o", "m.tdp", cwd=tmp_path), f"{checkpoint}: no tokenizer.json ("
    )
    assert not list(tmp_path.glob("*.tdp*")) and not list(tmp_path.glob(".*partial"))


def test_inductor_without_a_prefill_chunk_says_to_give_one_before_compiling(tmp_path: Path) -> None:
    """AOTInductor fails on a prefill of any length deep in its compiler; the command says what to give instead."""
    checkpoint = _checkpoint(tmp_path / "checkpoint", tiny_llama(vocab_size=512))
    refused = _in_process("llm", "export", checkpoint, "-o", "m.tdp", "-b", "inductor", cwd=tmp_path)
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    assert "--backend inductor needs --prefill-chunk N" in refused.stderr
    assert "give --prefill-chunk 16" in refused.stderr
    assert not list(tmp_path.glob("*.tdp*"))


def test_a_prompt_longer_than_the_cache_is_refused(tmp_path: Path) -> None:
    _small_program(tmp_path, "checkpoint", "m.tdp")
    long = " ".join(TEXT)
    result = _in_process("llm", "generate", "m.tdp", "--prompt", long, cwd=tmp_path)
    _refused(result, "the prompt is")
    assert "shorten it, or export with a larger --max-cache" in result.stderr
    huge = _in_process("llm", "generate", "m.tdp", "-p", "hi", "--temperature", "1", "--seed", str(2**70), cwd=tmp_path)
    assert huge.returncode == 2 and "seed 1180591620717411303424: give an integer from 0" in huge.stderr


CHAT = (
    "{% for m in messages %}{{ bos_token }}{{ m['role'] }}: {{ m['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}{{ bos_token }}assistant:{% endif %}"
)


def test_chat_applies_the_checkpoints_template_as_transformers_does(tmp_path: Path) -> None:
    model = tiny_llama(vocab_size=512)
    checkpoint = _checkpoint(tmp_path / "checkpoint", model)
    tokenizer = _tokenizer()
    tokenizer.chat_template = CHAT  # type: ignore[attr-defined]
    tokenizer.save_pretrained(checkpoint)  # type: ignore[attr-defined]
    assert (
        _in_process("llm", "export", checkpoint, "-o", "m.tdp", "--max-cache", str(CACHE), cwd=tmp_path).returncode == 0
    )
    generated = _command(
        "llm", "generate", "m.tdp", "-p", "hello there", "--chat", "--max-new-tokens", "6", "--ids", cwd=tmp_path
    )
    assert generated.returncode == 0, generated.stderr
    ids = _generated_ids(generated.stdout)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hello there"}], add_generation_prompt=True)  # type: ignore[attr-defined]
    prompt = prompt["input_ids"] if isinstance(prompt, dict) or hasattr(prompt, "keys") else prompt
    assert ids == transformers_greedy(model, prompt, 6)
    _chat_continues_from_the_cache_as_transformers_reads_the_whole_conversation(tmp_path, model, tokenizer)
    _small_program(tmp_path, "plain", "p.tdp")
    _refused(_command("llm", "generate", "p.tdp", "-p", "hi", "--chat", cwd=tmp_path), "p.tdp carries no chat template")
    _refused(_command("llm", "chat", "p.tdp", cwd=tmp_path), "p.tdp carries no chat template")
    assert "use llm generate without --chat" in _command("llm", "chat", "p.tdp", cwd=tmp_path).stderr


def _chat_continues_from_the_cache_as_transformers_reads_the_whole_conversation(
    tmp_path: Path, model: torch.nn.Module, tokenizer: object
) -> None:
    """Turns of ``llm chat``: each reads only what the cache lacks and answers as transformers does from the
    whole conversation; a message too long for the cache is refused and the chat goes on; a conversation
    that would leave a reply no room forgets its earliest exchanges first; /reset starts over. Piped
    input is echoed as the terminal shows it, each message after its ``> ``."""
    lines = ["hello there", " ".join(TEXT * 2), "and then", "ok", "/reset", "hello there"]
    chat = _chat(tmp_path, lines, "--ids", "--max-new-tokens", "5")
    assert chat.returncode == 0, chat.stderr
    assert chat.stderr.startswith("torchdelegate: error: the prompt is") and chat.stderr.count("\n") == 1
    assert "replies of at most 5 tokens" in chat.stdout and "> and then\n" in chat.stdout
    replies = [[int(t) for t in ids.split(", ")] for ids in re.findall(r"token ids: \[([0-9, ]*)\]", chat.stdout)]
    assert len(replies) == 4 and "(a new conversation)" in chat.stdout and "cut short" not in chat.stdout
    messages: list[dict[str, str]] = []
    forgotten = 0
    for message, reply in zip(["hello there", "and then", "ok"], replies, strict=False):
        messages.append({"role": "user", "content": message})
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)  # type: ignore[attr-defined]
        while len(messages) > 1 and len(prompt) + 5 > CACHE:  # what the chat did: forget the earliest exchange
            messages, forgotten = messages[2:], forgotten + 1
            prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)  # type: ignore[attr-defined]
        assert reply == transformers_greedy(model, prompt, 5)
        messages.append({"role": "assistant", "content": tokenizer.decode(reply, skip_special_tokens=True)})  # type: ignore[attr-defined]
    assert forgotten > 0 and "the conversation outgrew the cache: its earliest" in chat.stdout
    assert replies[3] == replies[0]
    by_default = _chat(tmp_path, ["hello there", "and then"])  # a reply leaves room for the next turn's prompt
    assert f"replies of at most {CACHE // 4} tokens" in by_default.stdout and "cut short" not in by_default.stdout


def _chat(tmp_path: Path, lines: list[str], *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*_prefix(), "llm", "chat", "m.tdp", *flags],
        input="\n".join(lines) + "\n",
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=600,
    )


def test_the_demo_model_as_a_checkpoint_speaks_through_llm_export_and_generate(tmp_path: Path) -> None:
    """``demo --checkpoint`` writes the trained demo model as a GPT-2 checkpoint: ``llm generate`` prints
    the text the demo model generates in eager torch."""
    from torchdelegate.demo import generate, trained_demo_model

    written = _command("demo", "--checkpoint", "ck", cwd=tmp_path)
    assert written.returncode == 0 and "next: torchdelegate llm export ck" in written.stdout, written.stderr
    exported = _in_process("llm", "export", "ck", "-o", "d.tdp", "--max-cache", "128", cwd=tmp_path)
    assert exported.returncode == 0, exported.stderr
    assert "the checkpoint has no chat template: the file continues text" in exported.stdout  # said before it is used
    generated = _command(
        "llm", "generate", "d.tdp", "-p", "The teacher said", "--max-new-tokens", "40", "--ids", cwd=tmp_path
    )
    assert generated.returncode == 0, generated.stderr
    model = trained_demo_model()
    expected = generate(model.prefill, model.decode, torch.tensor([list(b"The teacher said")]), 40, max_len=128)
    assert _generated_ids(generated.stdout) == expected
    assert generated.stdout.startswith(bytes(expected).decode())
