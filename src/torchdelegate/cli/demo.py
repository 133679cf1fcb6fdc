"""``torchdelegate demo``: a small language model lowered, saved, loaded and checked against eager."""

from __future__ import annotations

import argparse
from typing import TextIO

from torchdelegate.cli.command import EXIT_FAILED, EXIT_OK, UsageError


def demo_command(args: argparse.Namespace, out: TextIO) -> int:
    from torchdelegate.demo.session import run_demo

    if args.tokens < 1:
        raise UsageError(f"--tokens must be at least 1, got {args.tokens}")
    if args.rounds < 1:
        raise UsageError(f"--rounds must be at least 1, got {args.rounds}")
    result = run_demo(tokens=args.tokens, output_dir=args.output_dir, rounds=args.rounds, out=out)
    return EXIT_OK if result.matches else EXIT_FAILED
