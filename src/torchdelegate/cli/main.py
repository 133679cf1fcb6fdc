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
    FULL_INSTALL,
    CommandError,
    CommandParser,
    PrintableText,
    UsageError,
    import_module,
    printable,
)
from torchdelegate.errors import TorchDelegateError, first_line
from torchdelegate.exported.torch_warnings import torch_internal_warnings_silenced
from torchdelegate.version import __version__

COMMANDS = ("lower", "inspect", "run", "prepare", "cache", "demo", "llm")
"""The commands, in the order ``--help`` lists them: each the module of this package that defines it."""


def command_line() -> argparse.ArgumentParser:
    """The parser of every command, each command's flags as its module defines them."""
    parser = CommandParser(
        prog="torchdelegate",
        description="Lower torch.export programs to backends, inspect and run the files, or try the demo.",
    )
    parser.add_argument("--version", action="version", version=f"torchdelegate {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=CommandParser)
    for name in COMMANDS:
        module = importlib.import_module(f"torchdelegate.cli.{name}")
        module.define(commands.add_parser(name, help=module.HELP, description=module.DESCRIPTION))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = command_line().parse_args(argv)
    out = sys.stdout if args.command in ("lower", "demo", "llm") else cast(TextIO, PrintableText(sys.stdout))
    try:
        for module in getattr(args, "imports", ()):
            import_module(module)
        with torch_internal_warnings_silenced(), _warnings_as_lines():
            handler = cast(Callable[[argparse.Namespace, TextIO], int], args.handler)
            return handler(args, out)
    except KeyboardInterrupt:
        print("torchdelegate: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader stopped (| head): nothing more to say, and nowhere to say it
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_FAILED
    except ImportError as error:
        needed = _library_missing(error)
        if needed is None:
            raise
        if getattr(args, "verbose", False):
            traceback.print_exc()
        print(f"torchdelegate: error: {printable(needed)}", file=sys.stderr)
        return EXIT_FAILED
    except (CommandError, TorchDelegateError, ValueError, TypeError, KeyError, OSError, RuntimeError) as error:
        if getattr(args, "verbose", False):
            traceback.print_exc()
        message = str(error.args[0] if isinstance(error, KeyError) and error.args else error)
        notes = "; ".join(getattr(error, "__notes__", ()))  # where torch failed, added by torchdelegate
        print(f"torchdelegate: error: {printable(message + (f' ({notes})' if notes else ''))}", file=sys.stderr)
        return EXIT_USAGE if isinstance(error, UsageError) else EXIT_FAILED


_LIBRARIES = {
    "torch": FULL_INSTALL,
    "transformers": "pip install 'torchdelegate[llm]'",
}


def _library_missing(error: ImportError) -> str | None:
    """What a command met an ImportError of torch or transformers for, as one line that says how to
    install it; None for any other library (a bug, shown whole). Where only the runtime is installed,
    a command that lowers says so itself (``require_torch``); this catches the rest."""
    root = (error.name or "").partition(".")[0]
    if root not in _LIBRARIES:
        return None
    return f"this needs {root}, which cannot be imported here ({first_line(error)}): {_LIBRARIES[root]}"


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
