"""Decode latency of each shipped backend against eager torch and ExecuTorch + XNNPACK.

The benchmark stack (benchmarks/stack.py; L=4, d=256 by default) called on one token:
eager torch; torchdelegate with each backend (its partitioner first, ``reference`` after it
for anything left), saved and loaded in the runtime; and, when ``.venv-executorch`` exists
(``make bench`` creates it), ExecuTorch 1.5.1's runtime with XNNPACK on the same model from
the same seed. Sides alternate over ``--rounds`` rounds; each round is the median of
``--repeats`` timings of ``--calls`` calls; reported: the median round and the min-max.

    python benchmarks/backends.py [--layers 4] [--width 256] [--backends reference onnxruntime]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from stack import seeded_stack

import torchdelegate as td
from torchdelegate.backends.reference import ReferencePartitioner

ROOT = Path(__file__).resolve().parent.parent
EXECUTORCH_PYTHON = ROOT / ".venv-executorch" / "bin" / "python"


def _partitioners(backend: str) -> list[Any]:
    if backend == "onnxruntime":
        from torchdelegate.backends.onnxruntime import OnnxRuntimePartitioner

        return [OnnxRuntimePartitioner(), ReferencePartitioner()]
    if backend == "inductor":
        from torchdelegate.backends.inductor import InductorPartitioner

        return [InductorPartitioner(), ReferencePartitioner()]
    return [ReferencePartitioner()]


def _time(call: Callable[[], Any], calls: int, repeats: int) -> float:
    """Median microseconds per call over ``repeats`` runs of ``calls`` calls."""
    for _ in range(10):
        call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(times)


def _executorch(layers: int, width: int, calls: int, repeats: int) -> dict[str, float] | None:
    if not EXECUTORCH_PYTHON.exists():
        return None
    command = [str(EXECUTORCH_PYTHON), str(ROOT / "benchmarks" / "executorch_decode.py")]
    command += ["--layers", str(layers), "--width", str(width), "--calls", str(calls), "--repeats", str(repeats)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=ROOT / "benchmarks")
    if done.returncode:
        raise RuntimeError(f"the ExecuTorch side failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--backends", nargs="+", default=["reference", "onnxruntime", "inductor"])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    model, x = seeded_stack(args.layers, args.width)
    with torch.no_grad():
        expected = model(x)
        program = torch.export.export(model, (x,))
    sides: dict[str, Callable[[], Any]] = {"eager torch": lambda: model(x)}
    details: dict[str, str] = {}
    programs = []
    directory = tempfile.TemporaryDirectory()
    for backend in args.backends:
        lowered = td.to_edge(program).to_backend(_partitioners(backend))
        path = Path(directory.name) / f"{backend}.tdp"
        lowered.save(path)
        loaded = td.load(path)
        programs.append(loaded)
        difference = float((loaded.run("forward", x) - expected).abs().max())
        delegates = [d.backend_id for d in lowered.delegates()["forward"]]
        details[f"torchdelegate {backend}"] = (
            f"{len(delegates)} delegates, file {path.stat().st_size} B, max diff {difference:.1e}"
        )
        sides[f"torchdelegate {backend}"] = lambda loaded=loaded: loaded.run("forward", x)
    results: dict[str, list[float]] = {name: [] for name in sides}
    executorch: list[dict[str, float]] = []
    for _ in range(args.rounds):
        for name, call in sides.items():
            with torch.no_grad():
                results[name].append(_time(call, args.calls, args.repeats))
        measured = _executorch(args.layers, args.width, args.calls, args.repeats)
        if measured is not None:
            executorch.append(measured)
    if executorch:
        results["ExecuTorch 1.5.1 + XNNPACK"] = [m["latency_us"] for m in executorch]
        details["ExecuTorch 1.5.1 + XNNPACK"] = (
            f"file {int(executorch[0]['file_bytes'])} B, max diff {executorch[0]['max_abs_diff']:.1e}"
        )
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    print(f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}, torch {torch.__version__}")
    print(f"decode latency, stack L={args.layers} d={args.width}, one token ({args.rounds} rounds, median [min-max]):")
    reference = statistics.median(results["ExecuTorch 1.5.1 + XNNPACK"]) if executorch else None
    for name, values in results.items():
        median = statistics.median(values)
        ratio = f"  {median / reference:.2f} x ExecuTorch" if reference else ""
        print(f"  {name:<32} {median:8.1f} us  [{min(values):.1f}-{max(values):.1f}]{ratio}  {details.get(name, '')}")
    for loaded in programs:
        loaded.close()
    directory.cleanup()


if __name__ == "__main__":
    main()
