"""``torchdelegate COMMAND``: parse, run the command, and turn its failure into one line and an exit code."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TextIO, cast

from torchdelegate.cli.command import (
    EXIT_FAILED,
    EXIT_USAGE,
    CommandError,
    PrintableText,
    UsageError,
    import_module,
    printable,
)
from torchdelegate.cli.parser import build_parser
from torchdelegate.errors import TorchDelegateError
from torchdelegate.exported.torch_warnings import torch_internal_warnings_silenced

# Each command's module and function, imported only to run it: the command line is read, and a
# usage error or --help answered, without importing torch.
_COMMANDS = {
    "lower": ("lower", "lower_command"),
    "inspect": ("inspect", "inspect_command"),
    "run": ("run", "run_command"),
    "prepare": ("prepare", "prepare_command"),
    "cache": ("cache", "cache_command"),
    "demo": ("demo", "demo_command"),
    "llm export": ("llm", "llm_export_command"),
    "llm generate": ("llm", "llm_generate_command"),
    "llm chat": ("llm", "llm_chat_command"),
}


def _command(name: str) -> Callable[[argparse.Namespace, TextIO], int]:
    module, function = _COMMANDS[name]
    found = getattr(importlib.import_module(f"torchdelegate.cli.{module}"), function)
    return cast(Callable[[argparse.Namespace, TextIO], int], found)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    out = sys.stdout if args.command in ("lower", "demo", "llm") else cast(TextIO, PrintableText(sys.stdout))
    try:
        for module in getattr(args, "imports", ()):
            import_module(module)
        with torch_internal_warnings_silenced(), _warnings_as_lines():
            command = f"llm {args.llm_command}" if args.command == "llm" else args.command
            return _command(command)(args, out)
    except KeyboardInterrupt:
        print("torchdelegate: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader stopped (| head): nothing more to say, and nowhere to say it
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_FAILED
    except (CommandError, TorchDelegateError, ValueError, TypeError, KeyError, OSError, RuntimeError) as error:
        if args.verbose:
            traceback.print_exc()
        message = str(error.args[0] if isinstance(error, KeyError) and error.args else error)
        notes = "; ".join(getattr(error, "__notes__", ()))  # where torch failed, added by torchdelegate
        print(f"torchdelegate: error: {printable(message + (f' ({notes})' if notes else ''))}", file=sys.stderr)
        return EXIT_USAGE if isinstance(error, UsageError) else EXIT_FAILED


@contextlib.contextmanager
def _warnings_as_lines() -> Iterator[None]:
    """Each warning the command meets printed as one line, ``torchdelegate: warning: ...``, not
    with the source line that raised it (torch's own are silenced before they get here)."""

    def show(message: Warning | str, *_: Any, **__: Any) -> None:
        print(f"torchdelegate: warning: {printable(str(message))}", file=sys.stderr)

    with warnings.catch_warnings():
        warnings.showwarning = show
        yield


def entry_point() -> None:
    """``[project.scripts]``: exit with :func:`main`'s code."""
    sys.exit(main())
