"""``torchdelegate prepare``: a program's machine-specific loading work done once, kept in the machine cache."""

from __future__ import annotations

import argparse
import time
from typing import TextIO

from torchdelegate.cli.command import EXIT_OK, loaded


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
