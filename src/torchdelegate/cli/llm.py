"""``torchdelegate llm export DIR``, ``llm generate FILE``, ``llm chat FILE`` and ``llm serve FILE``: a
transformers checkpoint lowered to one file that carries its tokenizer, and text generated from that
file, at the terminal or over HTTP."""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

from torchdelegate.cli.command import (
    EXIT_OK,
    CommandError,
    CommandParser,
    UsageError,
    add_backend_options,
    add_file_options,
    add_imports,
    add_verbose,
    backend_options,
    loaded,
    output_file,
    refuse_directory,
    require_torch,
)
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
    output_file(args.output, "-o", out, "model.tdp")
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
    sampling = _sampling(args)
    with loaded(args.file, args.external_data, args.trust, args.backend_options) as program, _read_as_text():
        model = _language_model(program)
        if args.chat:
            prompt = model.chat_prompt([{"role": "user", "content": args.prompt}], _WITHOUT_CHAT)
        else:
            prompt = model.encode(args.prompt)
        model.refuse_unfitting(prompt)
        generator = model.generator()
        generation = generator.generate(prompt, args.max_new_tokens, sampling, on_token=_Stream(model, out))
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


def llm_chat_command(args: argparse.Namespace, out: TextIO) -> int:
    """Read a user's messages line by line (a terminal, or any stdin), answer each in turn.

    The conversation so far stays in the KV cache: each turn reads only the tokens the cache does
    not hold yet. When the conversation outgrows the cache, the earlier turns are dropped."""
    sampling = _sampling(args)
    interactive = sys.stdin.isatty()
    with loaded(args.file, args.external_data, args.trust, args.backend_options) as program, _read_as_text():
        model = _language_model(program)
        conversation = _Conversation(model, args.system)
        reply_tokens = args.max_new_tokens or _chat_reply_tokens(model.max_cache)
        print(
            f"chatting with {args.file.name} ({model.max_cache} positions of context, replies of at most "
            f"{reply_tokens} tokens); /reset starts over, /exit or end of input ends",
            file=out,
        )
        while (message := _next_message(interactive, out)) is not None:
            if message == "/exit":
                break
            if message == "/reset":
                conversation.reset()
                print("(a new conversation)", file=out)
            elif message:
                try:
                    generation = conversation.reply(message, reply_tokens, sampling, out)
                except (CommandError, ValueError) as error:  # this message is refused; the conversation goes on
                    print(f"torchdelegate: error: {error}", file=sys.stderr)
                    continue
                stats = generation.stats
                ids = f"; token ids: {generation.tokens}" if args.ids else ""
                cut = "; cut short: the cache is full" if generation.finish == "cache full" else ""
                print(
                    f"\n({stats.new_tokens} tokens{cut}, first after {stats.time_to_first_token * 1e3:.0f} ms, "
                    f"{stats.decode_tokens_per_second:.1f} tokens/s{ids})",
                    file=out,
                )
    return EXIT_OK


def llm_serve_command(args: argparse.Namespace, out: TextIO) -> int:
    """Serve the file until SIGTERM or Ctrl-C; the weights are prepared first (in a process of its
    own) so that every worker maps the same packed copy."""
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise CommandError(
            f"llm serve needs the serve extra ({e.name} is missing): pip install 'torchdelegate[serve]'"
        ) from e
    if args.workers < 1:
        raise UsageError(f"--workers {args.workers}: give 1 or more")
    if args.queue < 0:
        raise UsageError(f"--queue {args.queue}: give 0 or more")
    if not 0 <= args.port < 65536:
        raise UsageError(f"--port {args.port}: give 0 to 65535")
    from torchdelegate.llm.serving.http_app import listening_socket, serve
    from torchdelegate.llm.serving.worker_pool import WorkerPool, prepared_in_child
    from torchdelegate.llm.serving.worker_process import FileLoad

    refuse_directory(args.file)  # before the port: the mistake to name is the file, not a busy port
    try:
        listening = listening_socket(args.host, args.port)
    except OSError as e:
        raise CommandError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}") from e
    _trusted_by_workers(args.trust)
    with (
        listening,
        loaded(args.file, args.external_data, args.trust, args.backend_options) as program,
        _read_as_text(),
    ):
        model = _language_model(program)
        options = _per_worker_threads(backend_options(args.backend_options), program, args.workers)
        external = None if args.external_data is None else str(args.external_data)
        file = FileLoad(str(args.file), external, options, tuple(args.imports))
        for line in prepared_in_child(file):
            print(line, file=out, flush=True)
        pool = WorkerPool(file, args.workers, args.queue, lambda line: print(line, file=out, flush=True))
        try:
            serve(model, pool, listening, args.api_key or os.environ.get("TORCHDELEGATE_API_KEY") or None, out)
        except RuntimeError as e:
            raise CommandError(str(e)) from e
    return EXIT_OK


def _trusted_by_workers(trust: list[str]) -> None:
    """--trust given to the workers too: they load the file in processes of their own, which trust
    what ``TORCHDELEGATE_TRUSTED_BACKENDS`` names (this process's environment, which they inherit)."""
    from torchdelegate.delegate.trust import TRUSTED_BACKENDS_VARIABLE

    given = [name.strip() for name in os.environ.get(TRUSTED_BACKENDS_VARIABLE, "").split(",") if name.strip()]
    if trust:
        os.environ[TRUSTED_BACKENDS_VARIABLE] = ",".join(dict.fromkeys([*given, *trust]))


def _per_worker_threads(options: dict[str, dict[str, str]], program: Any, workers: int) -> dict[str, dict[str, str]]:
    """``options`` with ONNX Runtime's threads shared out among the workers (the cores over the
    workers, at least one each) unless given, here or in ``TORCHDELEGATE_BACKEND_OPTIONS``: workers that
    each took every core would fight."""
    from torchdelegate.runtime.backend_options import environment_options

    if not any(d.backend_id == "onnxruntime" for d in program.delegates):
        return options
    onnxruntime = dict(options.get("onnxruntime", {}))
    if "intra_op_num_threads" not in environment_options(["onnxruntime"]).get("onnxruntime", {}):
        onnxruntime.setdefault("intra_op_num_threads", str(max(1, (os.cpu_count() or 1) // workers)))
    return {**options, "onnxruntime": onnxruntime}


def _next_message(interactive: bool, out: TextIO) -> str | None:
    """The user's next line, stripped; None at the end of input."""
    if interactive:
        try:
            return input("> ").strip()
        except EOFError:
            print("", file=out)
            return None
    line = sys.stdin.readline()
    if not line:
        return None
    print(f"> {line.strip()}", file=out)  # a transcript of piped input reads as the terminal's does
    return line.strip()


def _chat_reply_tokens(max_cache: int) -> int:
    """A reply's default length: a quarter of the cache (at most 256), so that a conversation holds
    several turns before its earliest are forgotten."""
    return max(1, min(256, max_cache // 4))


def _sampling(args: argparse.Namespace) -> Any:
    from torchdelegate.llm import Sampling

    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens {args.max_new_tokens}: give 1 or more")
    try:
        return Sampling(args.temperature, args.top_k, args.top_p, args.seed)
    except ValueError as error:
        raise UsageError(str(error)) from error


class _Conversation:
    """The messages so far, and the tokens the KV cache holds at positions 0, 1, ..."""

    def __init__(self, model: Any, system: str | None) -> None:
        self.model, self.generator = model, model.generator()
        model.chat_template(_WITHOUT_CHAT)  # no template: refused before the first message
        self.opening = [{"role": "system", "content": system}] if system else []
        self.reset()

    def reset(self) -> None:
        from torchdelegate.llm.language_model import HeldTokens

        self.messages = list(self.opening)
        self.held = HeldTokens()

    def reply(self, message: str, max_new_tokens: int, sampling: Any, out: TextIO) -> Any:
        """Answer ``message``, streaming the reply to ``out``; a message that does not fit the cache even
        alone is refused (ValueError) and leaves the conversation as it was."""
        turn = {"role": "user", "content": message}
        self.model.refuse_unfitting(self.model.chat_prompt([*self.opening, turn]))
        prompt = self._fitting(turn, max_new_tokens, out)
        self.messages.append(turn)
        stream = _Stream(self.model, out)
        cached = self.held.reusable(prompt)
        generation = self.generator.generate(prompt, max_new_tokens, sampling, on_token=stream, cached=cached)
        self.held.after(prompt, generation.tokens)
        self.messages.append({"role": "assistant", "content": self.model.decode(generation.tokens)})
        return generation

    def _fitting(self, turn: dict[str, str], max_new_tokens: int, out: TextIO) -> list[int]:
        """The conversation's prompt with ``turn``, its earliest exchanges (a message and its reply)
        forgotten, oldest first, until a reply of ``max_new_tokens`` fits the cache after it, or none is
        left to forget. How many were forgotten is said on ``out``."""
        past = self.messages[len(self.opening) :]
        prompt = self.model.chat_prompt([*self.opening, *past, turn])
        forgotten = 0
        while past and len(prompt) + max_new_tokens > self.model.max_cache:
            past, forgotten = past[2:], forgotten + 1
            prompt = self.model.chat_prompt([*self.opening, *past, turn])
        if forgotten:
            exchanges = "exchange is" if forgotten == 1 else f"{forgotten} exchanges are"
            print(f"(the conversation outgrew the cache: its earliest {exchanges} forgotten)", file=out)
            self.messages = [*self.opening, *past]
        return prompt


_WITHOUT_CHAT = "use llm generate without --chat"


def _language_model(program: Any) -> Any:
    from torchdelegate.llm.language_model import LanguageModel

    return LanguageModel(program)


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


@contextlib.contextmanager
def _read_as_text() -> Any:
    """What the file carries (tokenizer, chat template) and the prompt's fit, refused as a command error."""
    from torchdelegate.errors import CheckpointError

    try:
        yield
    except (CheckpointError, ValueError) as error:
        raise CommandError(str(error)) from error


class _Stream:
    """Prints each token's text as it comes."""

    def __init__(self, model: Any, out: TextIO) -> None:
        from torchdelegate.llm.language_model import TextStream

        self.text, self.out = TextStream(model), out

    def __call__(self, token: int) -> None:
        gained = self.text.add(token)
        if gained:
            self.out.write(gained)
            self.out.flush()
