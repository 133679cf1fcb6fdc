"""Decode latency of each shipped backend against eager torch and ExecuTorch + XNNPACK.

The benchmark stack (benchmarks/stack.py; L=4, d=256 by default) called on one token:
eager torch; torchdelegate with each backend (its partitioner first, ``reference`` after it
for anything left), saved, then loaded by the runtime; and, when ``.venv-executorch`` exists
(``make bench`` creates it), ExecuTorch 1.5.1's runtime with XNNPACK on the same model from
the same seed.

Every side is timed in a fresh process of its own, as the ExecuTorch side must be: no side
runs beside another's thread pools or caches. Sides alternate over ``--rounds`` rounds; a
round's figure is the median of ``--repeats`` timings of ``--calls`` calls; reported: the
median round and the min-max, and each side's ratio to ExecuTorch.

    python benchmarks/backends.py [--layers 4] [--width 256] [--backends reference onnxruntime]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from stack import seeded_stack

ROOT = Path(__file__).resolve().parent.parent
EXECUTORCH_PYTHON = ROOT / ".venv-executorch" / "bin" / "python"
EXECUTORCH = "ExecuTorch 1.5.1 + XNNPACK"


def _partitioners(backend: str) -> list[Any]:
    from torchdelegate.backends.reference import ReferencePartitioner

    if backend == "onnxruntime":
        from torchdelegate.backends.onnxruntime import OnnxRuntimePartitioner

        return [OnnxRuntimePartitioner(), ReferencePartitioner()]
    if backend == "inductor":
        from torchdelegate.backends.inductor import InductorPartitioner

        return [InductorPartitioner(), ReferencePartitioner()]
    return [ReferencePartitioner()]


def _time(call: Callable[[], Any], calls: int, repeats: int) -> list[float]:
    """Microseconds per call, for each of ``repeats`` runs of ``calls`` calls."""
    for _ in range(20):
        call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return times


def _measure(args: argparse.Namespace) -> None:
    """The child: time one side (``eager`` or a saved program) and print JSON."""
    model, x = seeded_stack(args.layers, args.width)
    with torch.no_grad():
        expected = model(x)
        if args.measure == "eager":
            times, out = _time(lambda: model(x), args.calls, args.repeats), expected
        else:
            import torchdelegate as td

            with td.load(args.measure) as program:
                out = program.run("forward", x)
                times = _time(lambda: program.run("forward", x), args.calls, args.repeats)
    result = {"latency_us": statistics.median(times), "max_abs_diff": float((out - expected).abs().max())}
    print(json.dumps(result))


def _child(command: list[str]) -> dict[str, float]:
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=ROOT / "benchmarks")
    if done.returncode:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _lower(backend: str, layers: int, width: int, directory: Path) -> tuple[Path, str]:
    """The stack lowered for ``backend`` and saved; the file and what it holds."""
    import torchdelegate as td

    model, x = seeded_stack(layers, width)
    with torch.no_grad():
        program = torch.export.export(model, (x,))
    lowered = td.to_edge(program).to_backend(_partitioners(backend))
    path = directory / f"{backend}.tdp"
    lowered.save(path)
    delegates = [d.backend_id for d in lowered.delegates()["forward"]]
    return path, f"{len(delegates)} delegates ({', '.join(sorted(set(delegates)))}), file {path.stat().st_size} B"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--backends", nargs="+", default=["reference", "onnxruntime", "inductor"])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--measure", help=argparse.SUPPRESS)  # the child's side: "eager" or a program file
    args = parser.parse_args()
    if args.measure:
        _measure(args)
        return
    shape = ["--layers", str(args.layers), "--width", str(args.width)]
    timing = ["--calls", str(args.calls), "--repeats", str(args.repeats)]
    ours = [sys.executable, str(Path(__file__).resolve()), *shape, *timing]
    sides: dict[str, list[str]] = {"eager torch": [*ours, "--measure", "eager"]}
    details: dict[str, str] = {}
    directory = tempfile.TemporaryDirectory()
    for backend in args.backends:
        path, details[f"torchdelegate {backend}"] = _lower(backend, args.layers, args.width, Path(directory.name))
        sides[f"torchdelegate {backend}"] = [*ours, "--measure", str(path)]
    if EXECUTORCH_PYTHON.exists():
        sides[EXECUTORCH] = [str(EXECUTORCH_PYTHON), str(ROOT / "benchmarks" / "executorch_decode.py"), *shape, *timing]
    results: dict[str, list[dict[str, float]]] = {name: [] for name in sides}
    for _ in range(args.rounds):
        for name, command in sides.items():
            results[name].append(_child(command))
    directory.cleanup()
    if EXECUTORCH in results:
        details[EXECUTORCH] = f"file {int(results[EXECUTORCH][0]['file_bytes'])} B"
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    print(f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}, torch {torch.__version__}")
    print(
        f"decode latency, stack L={args.layers} d={args.width}, one token; each side in its own process, "
        f"{args.rounds} alternating rounds, median [min-max]:"
    )
    medians = {name: statistics.median(r["latency_us"] for r in runs) for name, runs in results.items()}
    baseline = medians.get(EXECUTORCH)
    for name, runs in results.items():
        values = [r["latency_us"] for r in runs]
        ratio = f"  {medians[name] / baseline:.2f} x ExecuTorch" if baseline else ""
        difference = f"max diff {max(r['max_abs_diff'] for r in runs):.1e}"
        print(
            f"  {name:<28} {medians[name]:8.1f} us  [{min(values):.1f}-{max(values):.1f}]{ratio}  {difference}"
            + (f", {details[name]}" if name in details else "")
        )


if __name__ == "__main__":
    main()
