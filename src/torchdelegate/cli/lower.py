"""``torchdelegate lower``: torch.export files, one per method, lowered to backends in priority
order and saved as one program file with its partition report."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from torchdelegate.cli.command import (
    EXIT_OK,
    CommandError,
    UsageError,
    add_imports,
    add_verbose,
    directory_for,
    output_file,
    require_torch,
)
from torchdelegate.delegate.progress import PreprocessProgress
from torchdelegate.errors import BackendNotFoundError, FormatError
from torchdelegate.exported.torch_warnings import loggers_quieted
from torchdelegate.quantization.recipe_table import DEFAULT_RECIPE, RECIPES
from torchdelegate.report.terminal import human_bytes
from torchdelegate.serialize.foreign_files import PICKLED, TORCH_SAVE_ADVICE, zip_kind

if TYPE_CHECKING:
    import torch

    from torchdelegate.cache.compile_cache import CompileCache

HELP = "lower torch.export files (one per method) and save one program file"
DESCRIPTION = "Lower torch.export.save files, one per method, to backends in priority order; save one file."


def define(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("methods", nargs="+", metavar="METHOD=FILE.pt2", help="a method name and its exported program")
    parser.add_argument(
        "--backend",
        "-b",
        action="append",
        required=True,
        dest="backends",
        metavar="ID",
        help="a backend, highest priority first (repeat): onnxruntime, inductor, reference, or any installed "
        "backend that proposes a partitioner",
    )
    parser.add_argument("-o", "--output", required=True, type=Path, help="the program file to write")
    parser.add_argument(
        "--compile-spec",
        action="append",
        default=[],
        metavar="ID:KEY=VALUE",
        help="a compile spec for one backend, e.g. onnxruntime:intra_op_num_threads=2 (repeat)",
    )
    parser.add_argument("--min-partition-size", type=int, default=1, metavar="N", help="smallest partition (default 1)")
    parser.add_argument("--html", type=Path, metavar="FILE.html", help="also write the partition report as HTML")
    parser.add_argument("--external-data", type=Path, metavar="FILE", help="put weights in this separate data file")
    add_lowering_options(parser)
    add_imports(parser)
    add_verbose(parser)
    parser.set_defaults(handler=lower_command)


QUANTIZE_RECIPES = (DEFAULT_RECIPE, *(name for name in RECIPES if name != DEFAULT_RECIPE))
"""The recipes' names, the default first (``recipe_table`` imports no torch: parsing stays quick)."""


def add_lowering_options(parser: argparse.ArgumentParser) -> None:
    """--cache, --quantize (--group-size, --keep-float, --embeddings), --jobs and --cluster: lower, llm export."""
    parser.add_argument(
        "--cache",
        metavar="DIR",
        help="keep compiled partitions in this compile cache (a directory or fsspec URL; 'off': none); "
        "default: TORCHDELEGATE_CACHE, else ~/.cache/torchdelegate",
    )
    parser.add_argument(
        "--quantize",
        nargs="?",
        const=QUANTIZE_RECIPES[0],
        choices=QUANTIZE_RECIPES,
        metavar="RECIPE",
        help=f"quantize linear layers first (needs torchao), by RECIPE: {QUANTIZE_RECIPES[0]} when none is named "
        "(int4 weights in groups of 32 with zero points, int8 dynamic activations, the head "
        "8da8w), 8da4w (torchao's int4 weights in groups, int8 dynamic activations), 8da8w, int4 or int8 "
        "(weights only); docs/QUANTIZATION.md compares them",
    )
    parser.add_argument(
        "--group-size", type=int, metavar="N", help="--quantize: inputs per scale (default 32; 8-bit: one per row)"
    )
    parser.add_argument(
        "--keep-float",
        action="append",
        default=[],
        metavar="PATTERN",
        help="--quantize: leave in float the layers whose weight or module path matches (fnmatch), e.g. lm_head",
    )
    parser.add_argument(
        "--embeddings",
        choices=["int8", "int4", "float"],
        help="--quantize: the embedding tables too, weight-only: int8 (default; one scale per row), int4 (groups of "
        "32), or float (left as they are)",
    )
    parser.add_argument("--jobs", "-j", type=int, metavar="N", help="compile partitions on N worker processes")
    parser.add_argument(
        "--cluster", metavar="tcp://HOST:PORT", help="compile partitions on the Dask cluster with this scheduler"
    )


def lower_command(args: argparse.Namespace, out: TextIO) -> int:
    require_torch()
    from torchdelegate.report import render_html, render_text

    methods = _method_files(args.methods)
    output_file(args.output, "-o", "model.tdp")
    output_file(args.html, "--html", "report.html")
    output_file(args.external_data, "--external-data", "model.data")
    partitioners = chosen_partitioners(args, args.backends, _compile_specs(args.compile_spec))
    with contextlib.ExitStack() as stack:
        start_preprocessing(args, stack)  # worker processes start while the programs load
        programs = {method: _load_export(method, path) for method, path in methods}
        started = time.perf_counter()
        lowered = lowered_programs(programs, partitioners, args, out, args.min_partition_size)
        seconds = time.perf_counter() - started
    report = lowered.report
    directory_for(args.output, "-o", out)
    directory_for(args.external_data, "--external-data", out)
    lowered.save(args.output, external_data_path=args.external_data)
    print(render_text(report), file=out)
    print("", file=out)
    size = args.output.stat().st_size
    print(f"lowered in {seconds:.1f} s; wrote {args.output}: {human_bytes(size)}", file=out)
    print(_sharing_line(report), file=out)
    if args.html:
        directory_for(args.html, "--html", out)
        args.html.write_text(render_html(report, title=f"torchdelegate: {args.output.name}"), encoding="utf-8")
        print(f"report: {args.html}", file=out)
    return EXIT_OK


def chosen_partitioners(
    args: argparse.Namespace, backend_ids: Sequence[str], compile_specs: dict[str, list[Any]]
) -> list[Any]:
    """The shipped partitioners of the backends asked for, in priority order; the quantize options checked."""
    from torchdelegate.partition.proposed import backend_partitioners

    if args.quantize is None and (args.group_size is not None or args.keep_float or args.embeddings is not None):
        raise UsageError("--group-size, --keep-float and --embeddings go with --quantize RECIPE")
    try:
        return backend_partitioners(backend_ids, compile_specs)
    except (BackendNotFoundError, ValueError) as error:
        raise UsageError(str(error.args[0] if error.args else error)) from error


def lowered_programs(
    programs: dict[str, Any],
    partitioners: list[Any],
    args: argparse.Namespace,
    out: TextIO,
    min_partition_size: int = 1,
) -> Any:
    """The programs quantized (``--quantize``), decomposed keeping what each backend asks to keep,
    and lowered with a progress bar (the manager carries its report); kept ops no backend claimed
    decomposed after."""
    from torchdelegate.lowering.edge_program_manager import edge_keeping
    from torchdelegate.partition.capability import CapabilityPartitioner

    if args.quantize is not None:
        programs = _quantized_programs(programs, args, out)
    supports = [p.backends[0] for p in partitioners]
    partitioner = CapabilityPartitioner(supports, min_partition_size=min_partition_size)
    edge, kept = edge_keeping(programs, list(partitioners))
    with ProgressBar(sys.stderr) as bar:
        lowered = bar.run(edge, partitioner)
    return kept.decompose_unclaimed(lowered)


def _quantized_programs(programs: dict[str, Any], args: argparse.Namespace, out: TextIO) -> dict[str, Any]:
    """--quantize RECIPE (--group-size, --keep-float, --embeddings): the recipe applied to every method."""
    from torchdelegate.errors import QuantizationError
    from torchdelegate.quantization.embedding import quantized_embeddings
    from torchdelegate.quantization.linear import quantized_linears
    from torchdelegate.quantization.recipes import quantize

    before = {method: len(quantized_linears(program)) for method, program in programs.items()}
    tables = {method: len(quantized_embeddings(program)) for method, program in programs.items()}
    embeddings = None if args.embeddings == "float" else (args.embeddings or "int8")
    try:
        quantized = quantize(
            programs, args.quantize, group_size=args.group_size, keep_float=args.keep_float, embeddings=embeddings
        )
    except QuantizationError as e:
        raise UsageError(str(e)) from e
    except ImportError as e:
        raise CommandError(str(e)) from e
    layers = {method: len(quantized_linears(program)) - before[method] for method, program in quantized.items()}
    if not any(layers.values()):
        print(
            f"quantized with {args.quantize}: no float linear layer to quantize (quantized already, or kept)", file=out
        )
    else:
        counts = ", ".join(f"{method} {count}" for method, count in layers.items())
        print(f"quantized with {args.quantize}: linear layers per method: {counts}", file=out)
    looked_up = {method: len(quantized_embeddings(program)) - tables[method] for method, program in quantized.items()}
    if embeddings is not None and any(looked_up.values()):
        counts = ", ".join(f"{method} {count}" for method, count in looked_up.items())
        print(f"quantized embeddings with {embeddings} (weights only): tables per method: {counts}", file=out)
    return quantized


def start_preprocessing(args: argparse.Namespace, stack: contextlib.ExitStack) -> None:
    """--cache, --jobs and --cluster: the preprocessing block the lowering runs in, entered on ``stack``."""
    from torchdelegate.compile.options import preprocessing

    if args.jobs is not None and args.cluster is not None:
        raise UsageError("give --jobs or --cluster, not both")
    if args.jobs is not None and args.jobs < 1:
        raise UsageError(f"--jobs {args.jobs}: give a number of worker processes >= 1")
    cache = _compile_cache(args.cache)
    try:
        stack.enter_context(preprocessing(cache=cache, jobs=args.jobs, cluster=args.cluster))
    except ValueError as e:  # a --cluster that cannot be one
        raise UsageError(str(e)) from e
    except (OSError, ImportError) as e:
        raise CommandError(str(e)) from e


def _compile_cache(option: str | None) -> CompileCache | bool:
    """The compile cache ``--cache`` names, else ``TORCHDELEGATE_CACHE``'s (False: none); an error
    naming whichever of the two named what cannot be a cache, and what to give instead."""
    from torchdelegate.cache.compile_cache import CompileCache
    from torchdelegate.cache.store_settings import CACHE_VARIABLE, turned_off
    from torchdelegate.compile.options import environment_cache

    fix = "a directory you can write, an fsspec URL, or off"
    if option is not None:
        try:
            return False if turned_off(option) else CompileCache(option)
        except ValueError as e:
            raise UsageError(f"--cache {option!r}: {e}; give {fix}") from e
    try:
        return environment_cache() or False
    except ValueError as e:
        raise CommandError(f"{CACHE_VARIABLE}={os.environ.get(CACHE_VARIABLE)!r}: {e}; set it to {fix}") from e


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


def _load_export(method: str, path: Path) -> torch.export.ExportedProgram:
    import torch

    from torchdelegate.serialize.tree_specs import check_tree_specs

    if not path.is_file():
        raise CommandError(f"method {method!r}: no file {str(path)!r}")
    if zip_kind(path) == PICKLED:
        raise CommandError(f"method {method!r}: {str(path)!r} is not a torch.export.save file: {TORCH_SAVE_ADVICE}")
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
    from torchdelegate.delegate.specs import CompileSpec

    specs: dict[str, list[CompileSpec]] = {}
    for value in values:
        backend, sep, rest = value.partition(":")
        key, eq, setting = rest.partition("=")
        if not (sep and eq and backend and key):
            example = "onnxruntime:intra_op_num_threads=2"
            raise UsageError(f"--compile-spec {value!r} is not ID:KEY=VALUE (e.g. {example})")
        specs.setdefault(backend, []).append(CompileSpec(key, setting.encode()))
    return specs


class ProgressBar:
    """A progress bar over preprocess on a terminal; one line per partition elsewhere."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.tty = stream.isatty()

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()

    def run(self, edge: Any, partitioner: Any) -> Any:
        from torchdelegate.delegate.progress import preprocess_progress

        with preprocess_progress(self.show):
            return edge.to_backend(partitioner)

    def show(self, step: PreprocessProgress) -> None:
        text = f"preprocess {step.done}/{step.total}: {step.backend_id}, {step.where}"
        if self.tty:
            filled = round(24 * step.done / max(step.total, 1))
            self.stream.write(f"\r[{'#' * filled}{'.' * (24 - filled)}] {text[:90]:<90}")
        else:
            self.stream.write(text + "\n")
        self.stream.flush()
