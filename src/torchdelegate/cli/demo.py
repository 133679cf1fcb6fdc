"""``torchdelegate demo``: a small language model lowered, saved, loaded and checked against eager."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TextIO

from torchdelegate.cli.command import (
    EXIT_FAILED,
    EXIT_OK,
    CommandError,
    UsageError,
    add_verbose,
    directory_for,
    output_directory,
    require_torch,
)

HELP = "lower, save, load and run a small language model, checked against eager"
DESCRIPTION = (
    "A small decoder-only language model (built in, trained on a public-domain novel) as prefill + "
    "decode with a KV cache: lowered to ONNX Runtime with reference as fallback, saved, loaded, generating "
    "tokens checked against eager torch."
)


def define(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokens", type=int, default=80, metavar="N", help="tokens to generate (default 80)")
    parser.add_argument("--output-dir", type=Path, metavar="DIR", help="keep the program file and report here")
    parser.add_argument("--rounds", type=int, default=3, metavar="R", help="timing rounds, median taken (default 3)")
    parser.add_argument(
        "--checkpoint",
        type=Path,
        metavar="DIR",
        help="instead, write the demo model as a transformers checkpoint (GPT-2, byte-level tokenizer) in DIR, "
        "for torchdelegate llm export",
    )
    add_verbose(parser)
    parser.set_defaults(handler=demo_command)


def demo_command(args: argparse.Namespace, out: TextIO) -> int:
    require_torch("the demo")
    from torchdelegate.demo.walkthrough import run_demo

    if args.checkpoint is not None:
        return _write_checkpoint(args.checkpoint, out)
    if args.tokens < 1:
        raise UsageError(f"--tokens must be at least 1, got {args.tokens}")
    if args.rounds < 1:
        raise UsageError(f"--rounds must be at least 1, got {args.rounds}")
    output_directory(args.output_dir, "--output-dir")
    directory_for(args.output_dir, "--output-dir", out, is_directory=True)
    result = run_demo(tokens=args.tokens, output_dir=args.output_dir, rounds=args.rounds, out=out)
    return EXIT_OK if result.matches else EXIT_FAILED


def _write_checkpoint(directory: Path, out: TextIO) -> int:
    """--checkpoint DIR: the demo model as a transformers checkpoint, for ``llm export``."""
    from torchdelegate.demo.model import trained_demo_model

    try:
        from torchdelegate.demo.gpt2_checkpoint import save_transformers_checkpoint

        save_transformers_checkpoint(trained_demo_model(), directory)
    except ImportError as e:
        raise CommandError(
            f"--checkpoint needs transformers and tokenizers: pip install 'torchdelegate[llm]' ({e})"
        ) from e
    print(
        f"wrote {directory}: the demo model as a transformers GPT-2 checkpoint and its byte-level tokenizer", file=out
    )
    print(f"next: torchdelegate llm export {directory} -o demo-llm.tdp", file=out)
    return EXIT_OK
