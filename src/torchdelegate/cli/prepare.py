"""``torchdelegate prepare``: a program's machine-specific loading work done once, kept in the machine cache."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import TextIO

from torchdelegate.cli.command import (
    EXIT_OK,
    add_backend_options,
    add_file_options,
    add_imports,
    add_verbose,
    loaded,
)

HELP = "do a program's machine-specific loading work once, so that loads on this machine start faster"
DESCRIPTION = (
    "Do once the work a program's backends would repeat at every load because it depends on this "
    "machine (ONNX Runtime optimizes the model and packs the weights for this CPU), and keep it in the machine "
    "cache (TORCHDELEGATE_CACHE, by default ~/.cache/torchdelegate), where later loads on this machine find "
    "it. The file is not changed."
)


def define(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", type=Path)
    add_file_options(parser)
    add_backend_options(parser)
    add_imports(parser)
    add_verbose(parser)
    parser.set_defaults(handler=prepare_command)


def prepare_command(args: argparse.Namespace, out: TextIO) -> int:
    from torchdelegate.cache.machine_cache import required_cache_directory

    required_cache_directory()  # before the file is read
    with loaded(args.file, args.external_data, args.trust, args.backend_options) as program:
        started = time.perf_counter()
        lines = program.prepare()
        seconds = time.perf_counter() - started
    if not lines:
        print(f"{args.file}: nothing to prepare (no delegate's backend does machine-specific work at load)", file=out)
        return EXIT_OK
    for line in lines:
        print(line, file=out)
    print(f"prepared in {seconds:.1f} s: loads of {args.file} on this machine use it", file=out)
    return EXIT_OK
