"""``torchdelegate llm export DIR``, ``llm generate FILE``, ``llm chat FILE`` and ``llm serve FILE``: a
transformers checkpoint lowered to one file that carries its tokenizer, and text generated from that
file, at the terminal or over HTTP."""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

from torchdelegate.cli.command import (
    EXIT_OK,
    CommandError,
    CommandParser,
    UsageError,
    add_backend_options,
    add_file_options,
    add_imports,
    add_verbose,
    directory_for,
    loaded,
    output_file,
    require_torch,
)
from torchdelegate.cli.generated_text import WITHOUT_CHAT, TextOut, language_model, read_as_text, sampling_of
from torchdelegate.cli.llm_chat import llm_chat_command
from torchdelegate.cli.llm_serve import llm_serve_command
from torchdelegate.cli.lower import add_lowering_options

HELP = "a transformers checkpoint to one program file, and text generated from it"
DESCRIPTION = (
    "Deploy a decoder-only language model: export a local transformers checkpoint (nothing is "
    "downloaded) as prefill + decode over a static KV cache, lower it and save one file that carries its "
    "tokenizer; then generate text from that file."
)


def define(parser: argparse.ArgumentParser) -> None:
    commands = parser.add_subparsers(dest="llm_command", required=True, metavar="COMMAND", parser_class=CommandParser)
    export = commands.add_parser(
        "export",
        help="a checkpoint directory to one program file",
        description="Load the checkpoint in DIR (config.json, safetensors weights, tokenizer.json), export prefill "
        "(the prompt) and decode (one token) over a static KV cache, lower them to the backends in "
        "priority order, and save one file with the tokenizer and generation settings.",
    )
    export.add_argument("directory", type=Path, metavar="DIR", help="the checkpoint directory save_pretrained wrote")
    export.add_argument("-o", "--output", required=True, type=Path, help="the program file to write")
    export.add_argument(
        "--backend",
        "-b",
        action="append",
        dest="backends",
        metavar="ID",
        help="a backend, highest priority first (repeat; default: onnxruntime, then reference)",
    )
    export.add_argument(
        "--max-cache",
        type=int,
        metavar="N",
        help="KV cache positions: prompt and generated tokens (default 256, or fewer if the model has fewer positions)",
    )
    export.add_argument(
        "--prefill-chunk",
        type=int,
        metavar="N",
        help="export prefill for exactly N tokens, read a prompt N at a time (for backends that need static "
        "shapes); default: prefill takes a prompt of any length up to the cache",
    )
    export.add_argument(
        "--prefill-logits",
        choices=("last", "all"),
        default="last",
        help="what prefill returns: the logits after the prompt's last token (default: all generating needs, "
        "and the head runs for one position), or after each of its tokens (to score prompts)",
    )
    export.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="run the checkpoint's own Python files its config.json's auto_map names (its configuration and "
        "model classes; each file named before it runs). Without it such a checkpoint is refused, unless "
        "transformers has classes of its own for its model type",
    )
    add_lowering_options(export)
    add_imports(export)  # as lower: the module defining a backend or operator
    add_verbose(export)
    export.set_defaults(handler=llm_export_command)
    generate = commands.add_parser(
        "generate",
        help="generate text from a program llm export wrote",
        description="Generate text after a prompt, printing it as it comes, then the time to first token and the "
        "speeds.",
    )
    generate.add_argument("file", type=Path)
    generate.add_argument("--prompt", "-p", required=True, help="the text to continue")
    generate.add_argument(
        "--chat", action="store_true", help="the prompt is a user's message: apply the checkpoint's chat template"
    )
    _add_sampling(generate, 64)
    generate.set_defaults(handler=llm_generate_command)
    chat = commands.add_parser(
        "chat",
        help="talk with a program llm export wrote",
        description="An interactive conversation: each line read is a user's message, answered through the "
        "checkpoint's chat template. The conversation stays in the KV cache; earlier turns are dropped when it "
        "outgrows it. /reset starts over; /exit or the end of input ends.",
    )
    chat.add_argument("file", type=Path)
    chat.add_argument("--system", metavar="TEXT", help="a system message opening the conversation")
    _add_sampling(chat, None)
    chat.set_defaults(handler=llm_chat_command)
    serve = commands.add_parser(
        "serve",
        help="an OpenAI-compatible HTTP server for a program llm export wrote",
        description="Serve OpenAI's /v1/chat/completions, /v1/completions and /v1/models (and /health) over HTTP. "
        "Worker processes each run one request at a time, sharing one copy of the prepared weights; more "
        "requests wait in a bounded queue. Needs the serve extra: pip install 'torchdelegate[serve]'.",
    )
    serve.add_argument("file", type=Path)
    serve.add_argument("--host", default="127.0.0.1", help="the address to listen on (default 127.0.0.1: this machine)")
    serve.add_argument("--port", type=int, default=8000, help="the port (default 8000; 0: any free port)")
    serve.add_argument(
        "--workers",
        type=int,
        default=1,
        metavar="N",
        help="worker processes (default 1: every core for each request; N share the cores out)",
    )
    serve.add_argument(
        "--queue", type=int, default=16, metavar="N", help="requests that may wait for a worker (default 16; more: 429)"
    )
    serve.add_argument(
        "--api-key",
        metavar="KEY",
        help="refuse (401) every request without 'Authorization: Bearer KEY' (default: $TORCHDELEGATE_API_KEY, "
        "which keeps the key out of the process list)",
    )
    add_verbose(serve)
    add_file_options(serve)
    add_backend_options(serve)
    add_imports(serve)
    serve.set_defaults(handler=llm_serve_command)


def _add_sampling(parser: argparse.ArgumentParser, tokens: int | None) -> None:
    """What generate and chat share: how many tokens, how they are sampled, and the file's load options
    (those of run: --external-data, --trust, --backend-option, --import). ``tokens`` None: a reply's
    default is ``_CHAT_REPLY``'s share of the file's cache."""
    default = f"default {tokens}" if tokens else "default: a quarter of the file's cache, at most 256"
    parser.add_argument("--max-new-tokens", type=int, default=tokens, metavar="N", help=f"at most N tokens ({default})")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy; else sample")
    parser.add_argument("--top-k", type=int, metavar="K", help="sample among the K most likely tokens")
    parser.add_argument("--top-p", type=float, metavar="P", help="sample among the most likely tokens up to P")
    parser.add_argument("--seed", type=int, metavar="S", help="the seed of the sampling")
    parser.add_argument("--ids", action="store_true", help="also print the generated token ids")
    add_verbose(parser)
    add_file_options(parser)
    add_backend_options(parser)
    add_imports(parser)


def llm_export_command(args: argparse.Namespace, out: TextIO) -> int:
    require_torch()
    # Imported here: generating from a file needs none of the lowering machinery.
    from torchdelegate.cli.lower import chosen_partitioners, lowered_programs, start_preprocessing
    from torchdelegate.errors import CheckpointError
    from torchdelegate.llm.assets import SETTINGS, chat_template_text, settings_asset
    from torchdelegate.llm.checkpoint import export_methods, logits_given, read_checkpoint

    if args.max_cache is not None and args.max_cache < 3:
        raise UsageError(f"--max-cache {args.max_cache}: give at least 3 positions")
    if args.prefill_chunk is not None and args.prefill_chunk < 1:
        raise UsageError(f"--prefill-chunk {args.prefill_chunk}: give 1 or more tokens")
    if "inductor" in (args.backends or []) and args.prefill_chunk is None:
        raise UsageError(
            "--backend inductor needs --prefill-chunk N: AOTInductor does not compile a prefill over prompts of "
            "any length (the position ids are a range over the prompt's length); give --prefill-chunk 16, say, "
            "or lower with the onnxruntime backend"
        )
    output_file(args.output, "-o", "model.tdp")
    partitioners = chosen_partitioners(args, args.backends or ["onnxruntime", "reference"], {})
    started = time.perf_counter()
    with contextlib.ExitStack() as stack:
        start_preprocessing(args, stack)
        try:
            with _without_standard_input():
                checkpoint = read_checkpoint(
                    args.directory, True, args.trust_remote_code, lambda line: print(line, file=out)
                )
            cache = checkpoint.cache_length(args.max_cache)
            if args.prefill_chunk is not None and args.prefill_chunk >= cache:
                raise UsageError(f"--prefill-chunk {args.prefill_chunk}: give fewer tokens than the cache's {cache}")
            if checkpoint.eager_reason is not None:
                print(f"reading the weights whole ({checkpoint.eager_reason})", file=out)
            elif checkpoint.weights is not None:
                print("reading the weights by memory map from the safetensors files, as stored", file=out)
            if chat_template_text(checkpoint.assets) is None:
                print(
                    "the checkpoint has no chat template: the file continues text; llm chat, --chat and a server's "
                    "chat completions will refuse it (add the checkpoint's chat_template.jinja to have one)",
                    file=out,
                )
            exported = export_methods(checkpoint.model, cache, args.prefill_chunk, args.prefill_logits)
            logits = logits_given(exported["prefill"])  # what the model gave: "all" where it cannot keep fewer
            programs = checkpoint.bound(exported)
        except CheckpointError as error:
            raise CommandError(str(error)) from error
        chunk = args.prefill_chunk
        prompt = f"{chunk} tokens at a time" if chunk else f"prompts of 1 to {cache - 1} tokens"
        print(f"exported prefill ({prompt}) and decode from {args.directory}", file=out)
        if args.prefill_logits == "last" and logits == "all":
            print(
                f"prefill gives every position's logits: {type(checkpoint.model).__name__}'s forward cannot keep "
                "only the last (it has no logits_to_keep)",
                file=out,
            )
        lowered = lowered_programs(programs, partitioners, args, out)
    assets = {**checkpoint.assets, SETTINGS: settings_asset(cache, chunk, checkpoint.stop_tokens, logits)}
    directory_for(args.output, "-o", out)
    lowered.save(args.output, assets=assets)  # written whole: a failure leaves no partial file
    seconds = time.perf_counter() - started
    from torchdelegate.report.terminal import human_bytes

    size = human_bytes(args.output.stat().st_size)
    print(
        f"wrote {args.output}: {size} in {seconds:.1f} s (a cache of {cache} positions; tokenizer and generation "
        "settings included)",
        file=out,
    )
    return EXIT_OK


def llm_generate_command(args: argparse.Namespace, out: TextIO) -> int:
    sampling = sampling_of(args)
    with loaded(args.file, args.external_data, args.trust, args.backend_options) as program, read_as_text():
        model = language_model(program)
        if args.chat:
            prompt = model.chat_prompt([{"role": "user", "content": args.prompt}], WITHOUT_CHAT)
        else:
            prompt = model.encode(args.prompt)
        model.refuse_unfitting(prompt)
        generator = model.generator()
        generation = generator.generate(prompt, args.max_new_tokens, sampling, on_token=TextOut(model, out))
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


@contextlib.contextmanager
def _without_standard_input() -> Iterator[None]:
    """Standard input empty while a checkpoint is read: a question asked there (transformers asks
    whether to run a checkpoint's code) meets the end of input, never an answer piped in."""
    given = sys.stdin
    sys.stdin = io.StringIO()
    try:
        yield
    finally:
        sys.stdin = given
