"""``torchdelegate inspect``: what a program file holds (methods, delegates, named data, state)
and its saved partition report, without running a delegate."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from torchdelegate.cli.command import (
    EXIT_OK,
    FULL_INSTALL,
    CommandError,
    UsageError,
    add_backend_options,
    add_file_options,
    add_imports,
    add_verbose,
    backend_runtime,
    directory_for,
    file_backend_ids,
    loaded,
    output_file,
)
from torchdelegate.errors import first_line
from torchdelegate.report.terminal import coverage_line, human_bytes

if TYPE_CHECKING:
    from torchdelegate.report import LoweringReport

HELP = "describe a program file"
DESCRIPTION = "Describe a program file written by torchdelegate."


def define(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", type=Path)
    parser.add_argument("--html", type=Path, metavar="FILE.html", help="write the saved partition report as HTML")
    parser.add_argument("--report", action="store_true", help="print the saved partition report in full")
    parser.add_argument(
        "--debug-handles",
        action="store_true",
        help="print each delegate's debug handle map in full: what its blob runs (ONNX nodes...) -> the graph's "
        "nodes, named by the saved report",
    )
    parser.add_argument(
        "--model-explorer",
        type=Path,
        metavar="DIR",
        help="write the saved report for Google's Model Explorer: the graphs (FILE.json) and node-data "
        "overlays by backend and by partition",
    )
    parser.add_argument(
        "--open",
        action="store_true",
        help="with --model-explorer: start Model Explorer on loopback with them loaded, until Ctrl-C "
        "(needs torchdelegate[viz])",
    )
    parser.add_argument(
        "--port", type=int, metavar="N", help="with --open: Model Explorer's port (default: a free one)"
    )
    add_file_options(parser, "accepted for symmetry with run: inspect never runs a delegate, so needs no trust")
    add_imports(parser)
    add_backend_options(parser)
    add_verbose(parser)
    parser.set_defaults(handler=inspect_command)


def _print_debug_handles(delegates: list[Any], report: dict[str, Any] | None, full: bool, out: TextIO) -> None:
    """How many entries each delegate's debug handle map has; with ``full``, every entry and its nodes."""
    from torchdelegate.report.attribution import delegate_nodes

    mapped = [(i, d) for i, d in enumerate(delegates) if d.debug_handle_map]
    if not mapped:
        return
    print("debug handle maps (what each blob runs -> the graph's nodes):", file=out)
    for index, delegate in mapped:
        named = "" if report is not None else "; the file has no report to name them"
        count = len(delegate.debug_handle_map)
        print(f"  #{index} {delegate.name} ({delegate.backend_id}): {count} entries{named}", file=out)
        for identifier, found in delegate_nodes(delegate, report).items() if full else ():
            print(f"    {identifier} -> {', '.join(map(str, found)) or 'no node'}", file=out)
    if not full:
        print("  (--debug-handles prints every entry)", file=out)


def _native_backends(path: Path, external_data: Path | None) -> list[str]:
    """The file's backends whose blobs are native code: inspect loads them (it never runs one) and marks
    them. Asked of their torch-free runtimes where they have one, so describing such a file imports no torch."""
    try:
        used = file_backend_ids(path, external_data)
    except Exception:  # not a program file, a missing data file...: loading it says so, with the command's hints
        return []
    return [backend_id for backend_id in used if getattr(backend_runtime(backend_id), "runs_native_code", False)]


def inspect_command(args: argparse.Namespace, out: TextIO) -> int:
    from torchdelegate.cli.outputs import named_output_type
    from torchdelegate.serialize.container import FORMAT_VERSION

    output_file(args.html, "--html", "report.html")
    if (args.open or args.port is not None) and args.model_explorer is None:
        raise UsageError("--open and --port go with --model-explorer DIR")
    if args.port is not None and not args.open:
        raise UsageError("--port is Model Explorer's port: it goes with --open")

    native = _native_backends(args.file, args.external_data)
    with loaded(args.file, args.external_data, native, args.backend_options) as program:
        file = program.file
        producer = file.producer.get("torch", "?")
        file_size = human_bytes(args.file.stat().st_size)
        print(f"{args.file}: {file_size}, format version {FORMAT_VERSION}, written with torch {producer}", file=out)
        print("methods:", file=out)
        for record in file.methods:
            bound = program.method(record.name)
            parameters = ", ".join(bound.signature())
            named, plain = named_output_type(bound.output_type, program.plain_types)
            returns = f" -> {named}" if named else ""
            returns += f" (read as a {plain} here)" if plain else ""
            delegates = ", ".join(f"#{i} {file.delegates[i].backend_id}" for i in record.delegates) or "none"
            print(f"  {record.name}({parameters}){returns}  delegates: {delegates}", file=out)
            ranges = [
                f"{symbol} from {_bound(low)} to {_bound(high)}" for symbol, (low, high) in bound.size_ranges().items()
            ]
            if ranges:
                print(f"    sizes: {'; '.join(ranges)}", file=out)
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
        saved = program.report  # read (inflated) once, for the maps' node names and the report below
        _print_debug_handles(file.delegates, saved, args.debug_handles, out)
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
        if file.assets:
            carried = ", ".join(
                f"{n} ({human_bytes(file.segment_length(d, 'asset'))})" for n, d in sorted(file.assets.items())
            )
            print(f"assets: {carried}", file=out)
    _print_report(saved, args, out)
    return EXIT_OK


def _print_report(saved: dict[str, Any] | None, args: argparse.Namespace, out: TextIO) -> None:
    """The saved partition report: each method's coverage, or in full (``--report``), as HTML, for
    Model Explorer. Reading it needs torch (the report's classes are lowering's); without torch the
    rest of inspect's description stands and the report is said to need it."""
    if saved is None:
        if args.html or args.report or args.model_explorer:
            raise CommandError(f"{args.file} holds no partition report; {_NO_REPORT}")
        print(f"report: none saved ({_NO_REPORT})", file=out)
        return
    try:
        from torchdelegate.report import LoweringReport, render_html, render_text
    except ImportError as error:
        needs = f"reading the saved partition report needs torch ({first_line(error)}): {FULL_INSTALL}"
        if args.html or args.report or args.model_explorer:
            raise CommandError(f"{args.file}: {needs}") from error
        print(f"report: saved; {needs}", file=out)
        return
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
        directory_for(args.html, "--html", out)
        args.html.write_text(render_html(report, title=f"torchdelegate: {args.file.name}"), encoding="utf-8")
        print(f"report: {args.html}", file=out)
    if args.model_explorer:
        _model_explorer(report, args, out)


def _model_explorer(report: LoweringReport, args: argparse.Namespace, out: TextIO) -> None:
    from torchdelegate.cli.explorer_server import serve_model_explorer
    from torchdelegate.report.model_explorer import write_model_explorer

    if args.model_explorer.exists() and not args.model_explorer.is_dir():
        raise CommandError(f"--model-explorer {args.model_explorer}: not a directory")
    files = write_model_explorer(report, args.model_explorer, args.file.stem)
    print(f"model explorer: {files.graphs} (overlays {files.backends.name}, {files.partitions.name})", file=out)
    if args.open:
        serve_model_explorer(files, args.port, out)


_NO_REPORT = (
    "it was saved with report=False, or before save kept the lowering's report by default; lower it and "
    "save it again (lowered.save(path) keeps the report of the lowering that made it)"
)


def _bound(value: int | None) -> str:
    return "any" if value is None else str(value)
