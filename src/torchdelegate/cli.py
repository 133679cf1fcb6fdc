"""The ``torchdelegate`` command: lower, inspect, run, prepare, demo.

Exit codes: 0 success; 1 the work failed (a bad file, a backend error, outputs that differ
from eager in the demo); 2 the command line was wrong. Errors go to stderr as one line,
``torchdelegate: error: ...``; ``--verbose`` adds the traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import os
import sys
import time
import traceback
import warnings
import zipfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn, TextIO, cast

import numpy as np
import torch

from torchdelegate.errors import BackendNotFoundError, FormatError, TorchDelegateError, first_line
from torchdelegate.progress import PreprocessProgress
from torchdelegate.report.terminal import coverage_line, human_bytes
from torchdelegate.torch_warnings import loggers_quieted, torch_internal_warnings_silenced

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


class CommandError(Exception):
    """A failure to report in one line, with exit code 1."""


class UsageError(CommandError):
    """A command line argparse accepted whose values are wrong: one line, exit code 2, as argparse's own."""


def printable(text: str) -> str:
    """``text`` with control characters (terminal escapes) shown escaped; line breaks and tabs kept."""
    return "".join(c if c.isprintable() or c in "\n\t" else repr(c)[1:-1] for c in text)


class _PrintableText(io.TextIOBase):
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


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="torchdelegate",
        description="Lower torch.export programs to backends, inspect and run the files, or try the demo.",
    )
    parser.add_argument("--version", action="version", version=f"torchdelegate {_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)

    lower = commands.add_parser(
        "lower",
        help="lower torch.export files (one per method) and save one program file",
        description="Lower torch.export.save files, one per method, to backends in priority order; save one file.",
    )
    lower.add_argument("methods", nargs="+", metavar="METHOD=FILE.pt2", help="a method name and its exported program")
    lower.add_argument(
        "--backend",
        "-b",
        action="append",
        required=True,
        dest="backends",
        metavar="ID",
        help="a backend, highest priority first (repeat): onnxruntime, inductor, reference",
    )
    lower.add_argument("-o", "--output", required=True, type=Path, help="the program file to write")
    lower.add_argument(
        "--compile-spec",
        action="append",
        default=[],
        metavar="ID:KEY=VALUE",
        help="a compile spec for one backend, e.g. onnxruntime:intra_op_num_threads=2 (repeat)",
    )
    lower.add_argument("--min-partition-size", type=int, default=1, metavar="N", help="smallest partition (default 1)")
    lower.add_argument("--html", type=Path, metavar="FILE.html", help="also write the partition report as HTML")
    lower.add_argument("--external-data", type=Path, metavar="FILE", help="put weights in this separate data file")

    inspect = commands.add_parser(
        "inspect", help="describe a program file", description="Describe a program file written by torchdelegate."
    )
    inspect.add_argument("file", type=Path)
    inspect.add_argument("--html", type=Path, metavar="FILE.html", help="write the saved partition report as HTML")
    inspect.add_argument("--report", action="store_true", help="print the saved partition report in full")

    run = commands.add_parser(
        "run",
        help="run one method of a program file",
        description="Run one method of a program file on inputs from .npy files (or numbers), in call order.",
    )
    run.add_argument("file", type=Path)
    run.add_argument("--method", "-m", default=None, help="the method (default: the only one, or 'forward')")
    run.add_argument(
        "--input",
        "-i",
        action="append",
        default=[],
        dest="inputs",
        metavar="[NAME=]X.npy|NUMBER",
        help="one input, in call order (repeat); NAME= passes it by keyword",
    )
    run.add_argument("--save", type=Path, metavar="OUT.npz", help="save the outputs as output_0, output_1, ...")

    prepare = commands.add_parser(
        "prepare",
        help="do a program's machine-specific loading work once, so that loads on this machine start faster",
        description="Do once the work a program's backends would repeat at every load because it depends on this "
        "machine (ONNX Runtime optimizes the model and packs the weights for this CPU), and keep it in the machine "
        "cache (TORCHDELEGATE_CACHE, by default ~/.cache/torchdelegate), where later loads on this machine find "
        "it. The file is not changed.",
    )
    prepare.add_argument("file", type=Path)
    trust = (
        "run this backend's native code from the file (AOTInductor's compiled libraries: --trust inductor); "
        "without it such delegates are refused. Repeatable; or set TORCHDELEGATE_TRUSTED_BACKENDS to "
        "comma-separated ids"
    )
    for sub in (inspect, run, prepare):
        sub.add_argument("--external-data", type=Path, metavar="FILE", help="where the data file is, if moved")
        sub.add_argument(
            "--trust",
            action="append",
            default=[],
            metavar="BACKEND",
            help="accepted for symmetry with run: inspect never runs a delegate, so needs no trust"
            if sub is inspect
            else trust,
        )

    demo = commands.add_parser(
        "demo",
        help="lower, save, load and run a small language model, checked against eager",
        description="A small decoder-only language model (built in, random weights from a fixed seed) as prefill + "
        "decode with a KV cache: lowered to ONNX Runtime with reference as fallback, saved, loaded, generating "
        "tokens checked against eager torch.",
    )
    demo.add_argument("--tokens", type=int, default=32, metavar="N", help="tokens to generate (default 32)")
    demo.add_argument("--output-dir", type=Path, metavar="DIR", help="keep the program file and report here")
    demo.add_argument("--rounds", type=int, default=3, metavar="R", help="timing rounds, median taken (default 3)")

    for sub in (lower, inspect, run, prepare):
        sub.add_argument(
            "--import",
            action="append",
            default=[],
            dest="imports",
            metavar="MODULE",
            help="import this module before reading the files (repeat; the current directory is searched last): "
            "the one that registers the programs' output types or custom operators, e.g. "
            "transformers.modeling_outputs",
        )
    for sub in (lower, inspect, run, prepare, demo):
        sub.add_argument("--verbose", "-v", action="store_true", help="show the traceback of an error")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    commands: dict[str, Callable[[argparse.Namespace, TextIO], int]] = {
        "lower": _lower,
        "inspect": _inspect,
        "run": _run,
        "prepare": _prepare,
        "demo": _demo,
    }
    out = sys.stdout if args.command in ("lower", "demo") else cast(TextIO, _PrintableText(sys.stdout))
    try:
        for module in getattr(args, "imports", ()):
            _import(module)
        with torch_internal_warnings_silenced(), _warnings_as_lines():
            return commands[args.command](args, out)
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


def _version() -> str:
    from torchdelegate import __version__

    return __version__


# lower


def _lower(args: argparse.Namespace, out: TextIO) -> int:
    from torchdelegate.backends.support import backend_supports
    from torchdelegate.edge_program_manager import to_edge
    from torchdelegate.partition.capability import CapabilityPartitioner
    from torchdelegate.report import render_html, render_text

    methods = _method_files(args.methods)
    try:
        supports = backend_supports(args.backends, _compile_specs(args.compile_spec))
    except (BackendNotFoundError, ValueError) as error:
        raise UsageError(str(error.args[0] if error.args else error)) from error
    programs = {method: _load_export(method, path) for method, path in methods}
    partitioner = CapabilityPartitioner(supports, min_partition_size=args.min_partition_size)
    started = time.perf_counter()
    edge = to_edge(programs)
    with _ProgressBar(sys.stderr) as bar:
        lowered, report = bar.run(edge, partitioner)
    seconds = time.perf_counter() - started
    args.output.parent.mkdir(parents=True, exist_ok=True)
    lowered.save(args.output, external_data_path=args.external_data, report=report.to_json())
    print(render_text(report), file=out)
    print("", file=out)
    size = args.output.stat().st_size
    print(f"lowered in {seconds:.1f} s; wrote {args.output}: {human_bytes(size)}", file=out)
    print(_sharing_line(report), file=out)
    if args.html:
        args.html.write_text(render_html(report, title=f"torchdelegate: {args.output.name}"), encoding="utf-8")
        print(f"report: {args.html}", file=out)
    return EXIT_OK


def _sharing_line(report: Any) -> str:
    held, unique = sum(report.state_bytes.values()), report.unique_state_bytes
    line = f"weights and buffers: {human_bytes(unique)} unique"
    if len(report.state_bytes) > 1:
        saved = human_bytes(held - unique)
        line += f"; the {len(report.state_bytes)} methods hold {human_bytes(held)}, stored once: {saved} saved"
    return line


def _method_files(pairs: Sequence[str]) -> list[tuple[str, Path]]:
    found: dict[str, Path] = {}
    for pair in pairs:
        method, sep, path = pair.partition("=")
        if not sep or not method or not path:
            raise UsageError(f"{pair!r} is not METHOD=FILE.pt2 (for one method: forward={path or pair})")
        if not method.isidentifier():
            raise UsageError(f"method name {method!r} is not a Python identifier")
        if method in found:
            raise UsageError(f"method {method!r} is given twice")
        found[method] = Path(path)
    return list(found.items())


def _import(module: str) -> None:
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


def _loaded(path: Path, external_data: Path | None, trust: Sequence[str]) -> Any:
    """``load`` for the commands: a missing operator library says how to import it here."""
    from torchdelegate.errors import OperatorNotFoundError
    from torchdelegate.runtime.program import load

    try:
        return load(path, external_data_path=external_data, trusted_backends=trust)
    except OperatorNotFoundError as error:
        raise CommandError(f"{error} (with this command: --import MODULE)") from error


def _load_export(method: str, path: Path) -> torch.export.ExportedProgram:
    from torchdelegate.serialize.tree_specs import check_tree_specs

    if not path.is_file():
        raise CommandError(f"method {method!r}: no file {str(path)!r}")
    documents = _archive_documents(path)
    for member, document in documents:
        try:
            check_tree_specs(document, f"{path}: {member}")
        except FormatError as error:  # torch's reader would import what the file names
            raise CommandError(f"method {method!r}: {error}; the file is not read") from error
    try:
        with loggers_quieted(["torch.export"]):  # our one-line error quotes what torch logs at length
            return torch.export.load(path)
    except Exception as error:
        needs = _unregistered(documents)
        if needs:
            raise CommandError(
                f"method {method!r}: {str(path)!r} needs {', '.join(needs)}, which this process has not registered; "
                f"import what defines {'it' if len(needs) == 1 else 'them'}: {_import_hint(needs)}"
            ) from error
        raise CommandError(
            f"method {method!r}: {str(path)!r} is not a torch.export.save file ({type(error).__name__}: {error})"
        ) from error


def _archive_documents(path: Path) -> list[tuple[str, Any]]:
    """The program documents (JSON) of a torch.export.save archive; [] when it cannot be read so."""
    try:
        with zipfile.ZipFile(path) as archive:
            members = [m for m in archive.namelist() if m.endswith(".json") and "/models/" in m]
            return [(member, json.loads(archive.read(member))) for member in members]
    except Exception:  # noqa: BLE001 - not an archive we can read: torch.export.load says what it is
        return []


def _unregistered(documents: list[tuple[str, Any]]) -> list[str]:
    """The container types and operators the documents name that this process has not registered."""
    from torchdelegate.serialize.allow_list import operators_named, unregistered_operators
    from torchdelegate.serialize.tree_specs import unregistered_types

    needs: dict[str, None] = {}
    for member, document in documents:
        try:
            needs.update(dict.fromkeys(unregistered_types(document, member)))
            needs.update(dict.fromkeys(unregistered_operators(operators_named(document))))
        except Exception:  # noqa: BLE001 - only a hint: a document torch could not read either
            continue
    return list(needs)


def _import_hint(needs: list[str]) -> str:
    """``--import`` of the modules that define the types needed, where their names say which."""
    modules = sorted(
        {
            module
            for name in needs
            if not name.startswith("torch.ops.") and (module := name.rpartition(".")[0]) not in ("", "__main__")
        }
    )
    return " ".join(f"--import {m}" for m in modules) or "--import MODULE (the module that registers them)"


def _compile_specs(values: Sequence[str]) -> dict[str, list[Any]]:
    from torchdelegate.specs import CompileSpec

    specs: dict[str, list[CompileSpec]] = {}
    for value in values:
        backend, sep, rest = value.partition(":")
        key, eq, setting = rest.partition("=")
        if not (sep and eq and backend and key):
            example = "onnxruntime:intra_op_num_threads=2"
            raise UsageError(f"--compile-spec {value!r} is not ID:KEY=VALUE (e.g. {example})")
        specs.setdefault(backend, []).append(CompileSpec(key, setting.encode()))
    return specs


class _ProgressBar:
    """A progress bar over preprocess on a terminal; one line per partition elsewhere."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.tty = stream.isatty()

    def __enter__(self) -> _ProgressBar:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()

    def run(self, edge: Any, partitioner: Any) -> Any:
        from torchdelegate.progress import preprocess_progress
        from torchdelegate.report import lower_with_report

        with preprocess_progress(self.show):
            return lower_with_report(edge, partitioner)

    def show(self, step: PreprocessProgress) -> None:
        text = f"preprocess {step.done}/{step.total}: {step.backend_id}, {step.where}"
        if self.tty:
            filled = round(24 * step.done / max(step.total, 1))
            self.stream.write(f"\r[{'#' * filled}{'.' * (24 - filled)}] {text[:90]:<90}")
        else:
            self.stream.write(text + "\n")
        self.stream.flush()


# inspect


def _native_backends() -> list[str]:
    """Registered backends whose blobs are native code: inspect loads them (it never runs one) and marks them."""
    from torchdelegate.backend import get_backend, registered_backend_ids

    native = []
    for backend_id in registered_backend_ids():
        try:
            if get_backend(backend_id).runs_native_code:
                native.append(backend_id)
        except Exception:  # a backend that cannot be imported here is reported when the file needs it
            continue
    return native


def _inspect(args: argparse.Namespace, out: TextIO) -> int:
    from torchdelegate.report import LoweringReport, render_html, render_text
    from torchdelegate.serialize.container import FORMAT_VERSION

    native = _native_backends()
    with _loaded(args.file, args.external_data, native) as program:
        file = program.file
        producer = file.producer.get("torch", "?")
        file_size = human_bytes(args.file.stat().st_size)
        print(f"{args.file}: {file_size}, format version {FORMAT_VERSION}, written with torch {producer}", file=out)
        print("methods:", file=out)
        for record in file.methods:
            bound = program.method(record.name)
            parameters = ", ".join(bound.signature())
            output_type, plain = _output_type(bound.output_type, program.plain_types)
            returns = f" -> {output_type}" if output_type else ""
            returns += f" (read as a {plain} here)" if plain else ""
            delegates = ", ".join(f"#{i} {file.delegates[i].backend_id}" for i in record.delegates) or "none"
            print(f"  {record.name}({parameters}){returns}  delegates: {delegates}", file=out)
        print("delegates:", file=out)
        by_backend: dict[str, list[int]] = {}
        for delegate in file.delegates:
            size = file.segment_length(delegate.blob, f"delegate {delegate.name}")
            by_backend.setdefault(delegate.backend_id, []).append(size)
        for backend, sizes in by_backend.items():
            each = f" ({', '.join(human_bytes(s) for s in sizes)})" if len(sizes) > 1 else ""
            code = f"; native code: runs only with --trust {backend}" if backend in native else ""
            print(f"  {backend}: {len(sizes)} blob(s), {human_bytes(sum(sizes))}{each}{code}", file=out)
        described = [(i, d) for i, d in enumerate(file.delegates) if d.delegate_info is not None]
        if described:
            print("delegate info (from each backend's preprocess):", file=out)
        for index, delegate in described:
            info = json.dumps(delegate.delegate_info, sort_keys=True, ensure_ascii=False)
            print(f"  #{index} {delegate.name} ({delegate.backend_id}): {info}", file=out)
        digests = {r.data for r in file.named_data}
        unique = sum(file.segment_length(d, "named data") for d in digests)
        referenced = sum(file.segment_length(r.data, "named data") for r in file.named_data)
        print(
            f"named data: {len(file.named_data)} entries, {human_bytes(unique)} unique "
            f"({human_bytes(referenced - unique)} saved by storing equal bytes once)",
            file=out,
        )
        stored = [r for r in file.state if r.data is not None]
        state_bytes = sum(file.segment_length(r.data, "state") for r in stored if r.data is not None)
        mutable = sum(r.mutable for r in file.state)
        stored_bytes = human_bytes(state_bytes)
        print(f"state: {len(file.state)} tensors, {stored_bytes} stored ({mutable} updated at run time)", file=out)
        saved = program.report
    if saved is None:
        print(f"report: none saved ({_NO_REPORT})", file=out)
        if args.html or args.report:
            raise CommandError(f"{args.file} holds no partition report; {_NO_REPORT}")
        return EXIT_OK
    try:
        report = LoweringReport.from_json(saved)
    except ValueError as error:
        raise CommandError(f"{args.file}: the saved partition report cannot be read: {error}") from error
    if args.report:
        print("", file=out)
        print(render_text(report), file=out)
    else:
        for method in report.methods.values():
            print(coverage_line(method), file=out)
    if args.html:
        args.html.write_text(render_html(report, title=f"torchdelegate: {args.file.name}"), encoding="utf-8")
        print(f"report: {args.html}", file=out)
    return EXIT_OK


# run


def _run(args: argparse.Namespace, out: TextIO) -> int:
    args_in, kwargs_in = _inputs(args.inputs)
    if args.save:
        args.save.parent.mkdir(parents=True, exist_ok=True)  # as lower does for -o: known before the run
    with _loaded(args.file, args.external_data, args.trust) as program:
        method = args.method or _default_method(program.method_names)
        if method not in program.method_names:
            names = ", ".join(program.method_names)
            raise CommandError(f"no method {method!r} in {args.file}; the methods are {names}")
        started = time.perf_counter()
        outputs = program.run(method, *args_in, **kwargs_in)
        seconds = time.perf_counter() - started
        container = _container_phrase(program.method(method).output_type, program.plain_types)
    flat = torch.utils._pytree.tree_flatten_with_path(outputs)[0]
    print(f"{method}: {len(flat)} output(s) in {seconds * 1e3:.2f} ms{container}", file=out)
    output_names = _output_names([path for path, _ in flat])
    for index, ((_, value), name) in enumerate(zip(flat, output_names, strict=True)):
        print(f"  output_{index}{' ' + name if name else ''}: {_describe_value(value)}", file=out)
    if args.save:
        arrays = {f"output_{i}": _as_array(v) for i, (_, v) in enumerate(flat)}
        np.savez(args.save, **arrays)  # type: ignore[arg-type]
        print(f"saved {args.save}", file=out)
    return EXIT_OK


def _prepare(args: argparse.Namespace, out: TextIO) -> int:
    from torchdelegate.machine_cache import required_cache_directory

    required_cache_directory()  # before the file is read
    with _loaded(args.file, args.external_data, args.trust) as program:
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


_NO_REPORT = (
    "to keep one, lower with the torchdelegate command, or from Python save with "
    "lowered.save(path, report=report.to_json()), the report from torchdelegate.report.lower_with_report"
)
_PLAIN_OUTPUTS = (None, "builtins.tuple", "builtins.list", "builtins.dict")


def _output_type(output_type: str | None, plain_types: dict[str, str]) -> tuple[str | None, str | None]:
    """A method's output container worth naming (not a plain tuple, list or dict), and the plain
    type it is read as when this process has not registered it."""
    if output_type in _PLAIN_OUTPUTS:
        return None, None
    return output_type, plain_types.get(output_type or "")


def _container_phrase(output_type: str | None, plain_types: dict[str, str]) -> str:
    """How the outputs came back, when it is more than a tuple: ", a T (returned as a dict)"."""
    named, plain = _output_type(output_type, plain_types)
    if named is None:
        return ""
    return f", a {named}" + (f" (returned as a {plain}: not registered in this process)" if plain else "")


def _output_names(paths: list[tuple[Any, ...]]) -> list[str]:
    """Each output's place in the method's output structure (``logits``, ``past_key_values.0.1``);
    none for a flat tuple, whose places are the outputs' numbers."""
    if all(len(path) == 1 and isinstance(path[0], torch.utils._pytree.SequenceKey) for path in paths):
        return [""] * len(paths)
    names = []
    for path in paths:
        parts = []
        for key in path:
            for attribute in ("key", "idx", "name"):  # MappingKey, SequenceKey, GetAttrKey
                if hasattr(key, attribute):
                    parts.append(str(getattr(key, attribute)))
                    break
        names.append(".".join(parts))
    return names


def _default_method(names: list[str]) -> str:
    if len(names) == 1:
        return names[0]
    if "forward" in names:
        return "forward"
    raise CommandError(f"the file has several methods ({', '.join(names)}); choose one with --method")


def _inputs(values: Sequence[str]) -> tuple[list[Any], dict[str, Any]]:
    """``--input`` values: positional ones in order, then ``NAME=VALUE`` ones by keyword."""
    positional: list[Any] = []
    keywords: dict[str, Any] = {}
    for value in values:
        name, sep, rest = value.partition("=")
        if not sep or not name.isidentifier() or Path(value).is_file():
            if keywords:
                raise UsageError(f"input {value!r} comes after a NAME= input; give positional inputs first")
            positional.append(_input(value))
        elif name in keywords:
            raise UsageError(f"input {name!r} is given twice")
        else:
            keywords[name] = _input(rest)
    return positional, keywords


def _input(value: str) -> Any:
    """A .npy file as a tensor; otherwise an int, a float, or true/false."""
    if value.endswith(".npy"):
        path = Path(value)
        if not path.is_file():
            raise CommandError(f"no input file {value!r}")
        try:
            array = np.load(path, allow_pickle=False)
        except ValueError as error:
            raise CommandError(f"{value!r} is not a .npy array without objects: {error}") from error
        return torch.from_numpy(np.ascontiguousarray(array))
    lowered = value.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    raise CommandError(f"input {value!r} is neither a .npy file nor a number")


def _as_array(value: Any) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    return np.asarray(value)


def _describe_value(value: Any) -> str:
    if not isinstance(value, torch.Tensor):
        return repr(value)
    dtype = str(value.dtype).removeprefix("torch.")
    head = np.array2string(value.detach().reshape(-1)[:6].numpy(), precision=4, separator=", ", max_line_width=10**4)
    more = " ..." if value.numel() > 6 else ""
    return f"{dtype}[{', '.join(map(str, value.shape))}] {head}{more}"


# demo


def _demo(args: argparse.Namespace, out: TextIO) -> int:
    from torchdelegate.demo.session import run_demo

    if args.tokens < 1:
        raise UsageError(f"--tokens must be at least 1, got {args.tokens}")
    if args.rounds < 1:
        raise UsageError(f"--rounds must be at least 1, got {args.rounds}")
    result = run_demo(tokens=args.tokens, output_dir=args.output_dir, rounds=args.rounds, out=out)
    return EXIT_OK if result.matches else EXIT_FAILED


def entry_point() -> None:
    """``[project.scripts]``: exit with :func:`main`'s code."""
    sys.exit(main())


if __name__ == "__main__":
    entry_point()
