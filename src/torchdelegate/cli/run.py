"""``torchdelegate run``: one method of a program file on inputs from .npy files or numbers.

Inputs go in as numpy arrays and outputs come back as arrays: a file whose delegates need no torch
(ONNX Runtime's) runs without importing it.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from torchdelegate.cli.command import (
    EXIT_OK,
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

HELP = "run one method of a program file"
DESCRIPTION = "Run one method of a program file on inputs from .npy files (or numbers), in call order."


def define(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", type=Path)
    parser.add_argument("--method", "-m", default=None, help="the method (default: the only one, or 'forward')")
    parser.add_argument(
        "--input",
        "-i",
        action="append",
        default=[],
        dest="inputs",
        metavar="[NAME=]X.npy|NUMBER",
        help="one input, in call order (repeat); NAME= passes it by keyword",
    )
    parser.add_argument("--save", type=Path, metavar="OUT.npz", help="save the outputs as output_0, output_1, ...")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="time what each delegate's blob runs (backends that profile: onnxruntime) and print the longest, "
        "each with the graph nodes it computes",
    )
    add_file_options(parser)
    add_backend_options(parser)
    add_imports(parser)
    add_verbose(parser)
    parser.set_defaults(handler=run_command)


def run_command(args: argparse.Namespace, out: TextIO) -> int:
    import numpy as np

    from torchdelegate.cli.outputs import as_array, container_phrase, describe_value, flat_outputs, output_names

    args_in, kwargs_in = _inputs(args.inputs)
    if args.save:
        output_file(args.save, "--save", "outputs.npz")
    options = [*args.backend_options, *(_profiling(args.file, args.external_data) if args.profile else [])]
    with loaded(args.file, args.external_data, args.trust, options) as program:
        method = args.method or _default_method(program.method_names)
        if method not in program.method_names:
            names = ", ".join(program.method_names)
            raise CommandError(f"no method {method!r} in {args.file}; the methods are {names}")
        started = time.perf_counter()
        outputs = program.run(method, *args_in, **kwargs_in)
        seconds = time.perf_counter() - started
        container = container_phrase(program.method(method).output_type, program.plain_types)
        profiled = _profile_lines(program) if args.profile else []
    flat = flat_outputs(outputs)
    print(f"{method}: {len(flat)} output(s) in {seconds * 1e3:.2f} ms{container}", file=out)
    places = output_names([path for path, _ in flat])
    for index, ((_, value), name) in enumerate(zip(flat, places, strict=True)):
        print(f"  output_{index}{' ' + name if name else ''}: {describe_value(value)}", file=out)
    for line in profiled:
        print(line, file=out)
    if args.save:
        arrays = {f"output_{i}": as_array(v) for i, (_, v) in enumerate(flat)}
        directory_for(args.save, "--save", out)
        np.savez(args.save, **arrays)  # type: ignore[arg-type]
        print(f"saved {args.save}", file=out)
    return EXIT_OK


PROFILE_LINES = 20


def _profiling(path: Path, external_data: Path | None) -> list[str]:
    """``ID.profile=1`` for each backend of the file that takes a ``profile`` load option."""
    used = file_backend_ids(path, external_data)
    runtimes = {backend_id: backend_runtime(backend_id) for backend_id in used}
    chosen = [f"{i}.profile=1" for i, runtime in runtimes.items() if "profile" in getattr(runtime, "load_options", {})]
    if not chosen:
        raise CommandError(f"no backend of {path} records a profile ({', '.join(used) or 'no delegates'})")
    return chosen


def _profile_lines(program: Any) -> list[str]:
    """The longest units of the profile, each with the graph nodes it computes."""
    from torchdelegate.report.attribution import attributed_profile

    units = attributed_profile(program)
    if not units:
        return ["profile: no delegate recorded a profile"]
    total = sum(unit.seconds for unit in units)
    lines = [f"profile: {len(units)} units timed, {total * 1e3:.2f} ms in all; the longest:"]
    for unit in units[:PROFILE_LINES]:
        delegate = program.delegates[unit.delegate].name
        nodes = ", ".join(map(str, unit.nodes)) or "no graph node named"
        lines.append(f"  {unit.seconds * 1e3:8.3f} ms  {delegate}  {unit.identifier} -> {nodes}")
    return lines


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
    """A .npy file as a numpy array (the program returns arrays for it, and needs no torch to take it);
    otherwise an int, a float, or true/false."""
    if value.endswith(".npy"):
        import numpy as np

        path = Path(value)
        if not path.is_file():
            raise CommandError(f"no input file {value!r}")
        try:
            array = np.load(path, allow_pickle=False)
        except ValueError as error:
            raise CommandError(f"{value!r} is not a .npy array without objects: {error}") from error
        return np.ascontiguousarray(array)
    lowered = value.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    raise CommandError(f"input {value!r} is neither a .npy file nor a number")
