"""``torchdelegate llm export DIR`` and ``torchdelegate llm generate FILE``: a transformers
checkpoint lowered to one file that carries its tokenizer, and text generated from that file."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any, TextIO

from torchdelegate.cli.command import EXIT_OK, CommandError, UsageError
from torchdelegate.cli.lower import chosen_partitioners, lowered_with_report, start_preprocessing
from torchdelegate.report.terminal import human_bytes


def llm_export_command(args: argparse.Namespace, out: TextIO) -> int:
    from torchdelegate.errors import CheckpointError
    from torchdelegate.llm.checkpoint import SETTINGS, export_methods, read_checkpoint, settings_asset

    if args.max_cache < 2:
        raise UsageError(f"--max-cache {args.max_cache}: give at least 2 positions")
    partitioners = chosen_partitioners(args, args.backends or ["onnxruntime", "reference"], {})
    started = time.perf_counter()
    with contextlib.ExitStack() as stack:
        start_preprocessing(args, stack)
        try:
            checkpoint = read_checkpoint(args.directory)
            chunk = min(args.prefill_chunk, args.max_cache - 1)
            programs = export_methods(checkpoint.model, args.max_cache, chunk)
        except CheckpointError as error:
            raise CommandError(str(error)) from error
        print(f"exported prefill ({chunk} tokens) and decode from {args.directory}", file=out)
        lowered, report = lowered_with_report(programs, partitioners, args, out)
    assets = {**checkpoint.assets, SETTINGS: settings_asset(args.max_cache, chunk, checkpoint.stop_tokens)}
    _save_whole(lowered, args.output, report.without_cache_answers().to_json(), assets)
    seconds = time.perf_counter() - started
    size = human_bytes(args.output.stat().st_size)
    print(f"wrote {args.output}: {size} in {seconds:.1f} s (tokenizer and generation settings included)", file=out)
    return EXIT_OK


def _save_whole(lowered: Any, path: Path, report: dict[str, Any], assets: dict[str, bytes]) -> None:
    """Save to a file beside ``path``, then move it there: a failure leaves no partial file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    try:
        lowered.save(partial, report=report, assets=assets)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


def llm_generate_command(args: argparse.Namespace, out: TextIO) -> int:
    import torchdelegate as td
    from torchdelegate.llm import Generator, Sampling
    from torchdelegate.llm.checkpoint import SETTINGS

    try:
        sampling = Sampling(args.temperature, args.top_k, args.top_p, args.seed)
    except ValueError as error:
        raise UsageError(str(error)) from error
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens {args.max_new_tokens}: give 1 or more")
    with td.load(args.file) as program:
        if SETTINGS not in program.asset_names or "tokenizer.json" not in program.asset_names:
            raise CommandError(f"{args.file} carries no tokenizer: make it with torchdelegate llm export")
        settings = json.loads(program.asset(SETTINGS))
        tokenizer = _tokenizer(program.asset("tokenizer.json"))
        if args.chat:
            prompt = tokenizer.encode(_chat_prompt(program, args.prompt), add_special_tokens=False).ids
        else:
            prompt = tokenizer.encode(args.prompt).ids
        generator = Generator(program, stop_tokens=settings["stop_tokens"], max_positions=settings["max_cache"])
        if len(prompt) >= settings["max_cache"]:
            raise CommandError(
                f"the prompt is {len(prompt)} tokens and the program's cache holds {settings['max_cache']}; "
                "shorten it, or export with a larger --max-cache"
            )
        shown = _Stream(tokenizer, out)
        generation = generator.generate(prompt, args.max_new_tokens, sampling, on_token=shown)
    print("", file=out)
    if args.ids:
        print(f"token ids: {generation.tokens}", file=out)
    stats = generation.stats
    print(
        f"prompt {stats.prompt_tokens} tokens, {generation.stats.new_tokens} generated ({generation.finish}); "
        f"time to first token {stats.time_to_first_token * 1e3:.1f} ms; prompt {stats.prompt_tokens_per_second:.0f} "
        f"tokens/s, generation {stats.decode_tokens_per_second:.1f} tokens/s",
        file=out,
    )
    return EXIT_OK


def _chat_prompt(program: Any, message: str) -> str:
    """``message`` as the checkpoint's chat template renders one user turn, ready for the reply.

    The template comes from the file: it is rendered in jinja2's immutable sandbox, which gives it
    no access to Python beyond the values passed."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    names = program.asset_names
    config = json.loads(program.asset("tokenizer_config.json")) if "tokenizer_config.json" in names else {}
    template = program.asset("chat_template.jinja").decode() if "chat_template.jinja" in names else None
    template = template or config.get("chat_template")
    if not isinstance(template, str):
        raise CommandError(f"{program.path} carries no chat template: generate without --chat")
    special = {name: _token_text(config.get(name)) for name in ("bos_token", "eos_token")}
    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    try:
        return environment.from_string(template).render(
            messages=[{"role": "user", "content": message}], add_generation_prompt=True, **special
        )
    except Exception as e:
        raise CommandError(f"{program.path}: its chat template cannot be rendered ({type(e).__name__}: {e})") from e


def _token_text(value: Any) -> str:
    """A special token's text as tokenizer_config.json gives it (a string, or an object with ``content``)."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


def _tokenizer(data: bytes) -> Any:
    try:
        from tokenizers import Tokenizer
    except ImportError as e:
        raise CommandError("generating text needs the tokenizers library: pip install tokenizers") from e
    return Tokenizer.from_str(data.decode("utf-8"))


class _Stream:
    """Prints each token's text as it comes: the decoded text so far, less what was printed."""

    def __init__(self, tokenizer: Any, out: TextIO) -> None:
        self.tokenizer, self.out = tokenizer, out
        self.tokens: list[int] = []
        self.printed = ""

    def __call__(self, token: int) -> None:
        self.tokens.append(token)
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if text.startswith(self.printed) and not text.endswith("\ufffd"):  # a character still being spelled
            self.out.write(text[len(self.printed) :])
            self.out.flush()
            self.printed = text
