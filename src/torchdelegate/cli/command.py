"""What every command shares: its errors and exit codes, its parser, the flags several commands take,
text quoted from files made printable, ``--import``, and loading a program file.

A command is one module of this package: ``HELP`` and ``DESCRIPTION``, ``define(parser)``, which adds
its flags and sets its handler (``parser.set_defaults(handler=...)``), and the handler itself,
``(args, out) -> exit code``. A command module imports neither torch nor numpy at its top, so that
the command line is read, and ``--help`` answered, in a moment.
"""

from __future__ import annotations

import argparse
import importlib
import io
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn, TextIO

from torchdelegate.errors import first_line

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


class CommandError(Exception):
    """A failure to report in one line, with exit code 1."""


class UsageError(CommandError):
    """A command line argparse accepted whose values are wrong: one line, exit code 2, as argparse's own."""


class CommandParser(argparse.ArgumentParser):
    """argparse's parser, whose usage errors exit with ``EXIT_USAGE``."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


FULL_INSTALL = "pip install torchdelegate (the full distribution; torchdelegate-runtime only runs files)"
"""How to get torch and what lowers with it, where only the runtime is installed."""


def require_torch(what: str = "lowering") -> None:
    """A ``CommandError`` in one line where torch cannot be imported: ``what`` needs it, and how to
    install it. Commands that lower call it first (they import torch right after anyway)."""
    try:
        import torch  # noqa: F401
    except ImportError as error:
        raise CommandError(
            f"{what} needs torch, which cannot be imported here ({first_line(error)}): {FULL_INSTALL}"
        ) from error


def add_verbose(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--verbose", "-v", action="store_true", help="show the traceback of an error")


def add_imports(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--import",
        action="append",
        default=[],
        dest="imports",
        metavar="MODULE",
        help="import this module before reading the files (repeat; the current directory is searched last): "
        "the one that registers the programs' output types or custom operators, e.g. "
        "transformers.modeling_outputs",
    )


TRUST_HELP = (
    "run this backend's native code from the file (AOTInductor's compiled libraries: --trust inductor); "
    "without it such delegates are refused. Repeatable; or set TORCHDELEGATE_TRUSTED_BACKENDS to "
    "comma-separated ids"
)


def add_file_options(parser: argparse.ArgumentParser, trust_help: str = TRUST_HELP) -> None:
    """--external-data and --trust: how a command that loads a program file finds and trusts it."""
    parser.add_argument("--external-data", type=Path, metavar="FILE", help="where the data file is, if moved")
    parser.add_argument("--trust", action="append", default=[], metavar="BACKEND", help=trust_help)


def add_backend_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--backend-option",
        action="append",
        default=[],
        dest="backend_options",
        metavar="ID.KEY=VALUE",
        help="a load-time option of a backend, for this machine (repeat), e.g. onnxruntime.intra_op_num_threads=4",
    )


def printable(text: str) -> str:
    """``text`` with control characters (terminal escapes) shown escaped; line breaks and tabs kept."""
    return "".join(c if c.isprintable() or c in "\n\t" else repr(c)[1:-1] for c in text)


class PrintableText(io.TextIOBase):
    """Output that quotes text read from a file: control characters (terminal escapes) are shown
    escaped, never sent; line breaks and tabs pass."""

    def __init__(self, stream: TextIO) -> None:
        super().__init__()
        self._stream = stream

    def write(self, text: str) -> int:
        self._stream.write(printable(text))
        return len(text)

    def flush(self) -> None:
        self._stream.flush()


def import_module(module: str) -> None:
    """``--import MODULE``: what the files need registered (pytree types, custom operators).

    The current directory is searched after the installed packages, as ``python -m`` would.
    """
    if not all(part.isidentifier() for part in module.split(".")):
        raise UsageError(
            f"--import {module!r} is not a module name (dotted identifiers: transformers.modeling_outputs)"
        )
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as error:
        if error.name is not None and (module == error.name or module.startswith(f"{error.name}.")):
            raise UsageError(
                f"--import {module}: no module named {error.name!r} in this environment or the current directory"
            ) from error
        raise CommandError(
            f"--import {module}: importing it failed: ModuleNotFoundError: {first_line(error)}"
        ) from error
    except Exception as error:
        failure = f"{type(error).__name__}: {first_line(error)}"
        raise CommandError(f"--import {module}: importing it failed: {failure}") from error


def backend_options(given: Sequence[str]) -> dict[str, dict[str, str]]:
    """``--backend-option ID.KEY=VALUE`` (repeated) as ``load``'s ``backend_options``."""
    from torchdelegate.runtime.backend_options import parsed_option

    options: dict[str, dict[str, str]] = {}
    for text in given:
        parsed = parsed_option(text)
        if parsed is None:
            raise UsageError(f"--backend-option {text!r}: give ID.KEY=VALUE, e.g. onnxruntime.intra_op_num_threads=4")
        backend_id, key, value = parsed
        options.setdefault(backend_id, {})[key] = value
    return options


def output_file(path: Path | None, flag: str, example: str) -> None:
    """The one rule for a file a command writes, checked before the command does any work: a path that is
    a directory, or lies under a file, is a ``UsageError`` naming the flag, and so is one whose nearest
    existing directory cannot be written. Nothing is made yet (:func:`directory_for` makes what is
    missing when the file is written), so a command that fails leaves nothing behind."""
    if path is None:
        return
    if path.is_dir():
        raise UsageError(f"{flag} {path} is a directory: give the file to write, e.g. {path / example}")
    output_directory(path.parent, flag)


def output_directory(directory: Path | None, flag: str) -> None:
    """``output_file``'s check for a directory a command writes into."""
    if directory is None:
        return
    existing = next(parent for parent in (directory, *directory.parents) if parent.exists() or parent == parent.parent)
    if not existing.is_dir():
        raise UsageError(f"{flag} {directory}: {existing} is a file, not a directory; give a path in a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {directory}: {existing} cannot be written; give a directory you can write")


def directory_for(path: Path | None, flag: str, out: TextIO, *, is_directory: bool = False) -> None:
    """The missing directories of the file ``path`` (or of the directory itself) made, as the command
    writes it, and said so on ``out``; a ``CommandError`` if they cannot be."""
    if path is None:
        return
    directory = path if is_directory else path.parent
    if directory.is_dir():
        return
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise CommandError(f"{flag} {directory}: the directory cannot be made ({first_line(error)})") from error
    print(f"made directory {directory} (for {flag})", file=out)


def refuse_directory(path: Path) -> None:
    """A ``CommandError`` when ``path``, given as a program file, is a directory (a checkpoint, say)."""
    if not path.is_dir():
        return
    hint = f": a checkpoint? make a program file from it with torchdelegate llm export {path} -o FILE.tdp"
    raise CommandError(
        f"{path} is a directory, not a program file" + (hint if (path / "config.json").is_file() else "")
    )


def loaded(path: Path, external_data: Path | None, trust: Sequence[str], options: Sequence[str] = ()) -> Any:
    """``load`` for the commands: a missing operator library or data file says how to give it here; a
    load option the file's backends do not take is a usage error."""
    from torchdelegate.errors import BackendNotFoundError, OperatorNotFoundError
    from torchdelegate.runtime.backend_options import BackendOptionError
    from torchdelegate.runtime.program import load

    chosen = backend_options(options)
    refuse_directory(path)
    try:
        return load(path, external_data_path=external_data, trusted_backends=trust, backend_options=chosen)
    except (OperatorNotFoundError, BackendNotFoundError) as error:
        raise CommandError(f"{error} (with this command: --import MODULE)") from error
    except BackendOptionError as error:
        raise UsageError(str(error).replace("backend_options", "--backend-option", 1)) from error
    except FileNotFoundError as error:
        if external_data is not None or not path.is_file():
            raise
        raise CommandError(f"{error} (with this command: --external-data FILE)") from error  # its data file


def file_backend_ids(path: Path, external_data: Path | None) -> list[str]:
    """The ids of the backends whose delegates ``path`` holds (its own, not those nested in their
    blobs), read from its manifest without loading it."""
    from torchdelegate.serialize.reader import ProgramFile

    file = ProgramFile(path, external_data)
    try:
        return sorted({record.backend_id for record in file.delegates})
    finally:
        file.close()


def backend_runtime(backend_id: str) -> Any | None:
    """What runs ``backend_id``'s blobs, for its declarations (``runs_native_code``, ``load_options``):
    its torch-free array runtime where it has one (so asking imports no torch), else its
    ``BackendDetails``; None where neither can be imported here (loading the file says why)."""
    try:
        from torchdelegate.delegate.array_runtime import array_runtime

        runtime = array_runtime(backend_id)
        if runtime is not None:
            return runtime
        from torchdelegate.delegate.backend_details import get_backend

        return get_backend(backend_id)
    except Exception:  # ImportError without torch, a backend that fails to import: loading reports it
        return None
