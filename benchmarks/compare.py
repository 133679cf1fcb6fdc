"""torchdelegate against ExecuTorch 1.5.1, side by side, on this machine, in one run.

``make bench`` runs this script after creating ``.venv-executorch`` (torch 2.13.0 and
executorch 1.5.1, never a dependency of the package). Every measurement is a fresh process
of its own side (``torchdelegate_side.py`` in this environment, ``executorch_side.py`` in
ExecuTorch's), so no side runs beside another's thread pools or caches; the sides alternate.

1. **Lowering cost against graph size**: the benchmark stack (d=64) at each ``--layers``,
   tagged by the same rule on both sides (``workloads.tag_runs``) for a backend that does
   nothing, so what is timed is each framework's ``EdgeProgramManager.to_backend``; also its
   peak resident memory growth against the weights' bytes. ``--repeats`` repetitions, but a
   side whose repetition took longer than ``--budget`` seconds is not repeated at that size.
2. **Two-method weight sharing**: prefill (8 tokens) and decode (1 token) of the stack at
   L=4, d=256, lowered together and saved: file bytes over the model's unique weight bytes,
   ExecuTorch + XNNPACK against torchdelegate with each backend variant.
3. **Runtime**: those files loaded (both methods), resident memory growth after one call of
   each, then the latency of one-token decode calls; eager torch beside them. ``--rounds``
   alternating rounds; a round's figure is the median of its repetitions.

Writes ``benchmarks/results/<date>.md`` (tables, the machine, the targets), its data as
JSON and two PNG plots, and prints the page.

    python benchmarks/compare.py [--layers 2 8 32 128] [--quick]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from results import write_results
from stack import seeded_stack
from workloads import method_inputs, weight_bytes

HERE = Path(__file__).resolve().parent
OURS = [sys.executable, str(HERE / "torchdelegate_side.py")]
EXECUTORCH_PYTHON = HERE.parent / ".venv-executorch" / "bin" / "python"
THEIRS = [str(EXECUTORCH_PYTHON), str(HERE / "executorch_side.py")]
EXECUTORCH = "ExecuTorch + XNNPACK"
EAGER = "eager torch"


def measure(command: list[str], timeout: float = 7200, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run one side's measurement in a fresh process (``env``: variables to set in it); its JSON."""
    environment = None if env is None else {**os.environ, **env}
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=HERE, env=environment)
    if done.returncode:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def lowering(layers: list[int], repeats: int, budget: float) -> list[dict[str, Any]]:
    """Per size, each side's repetitions, alternating ours and ExecuTorch's."""
    rows = []
    for count in layers:
        shape = ["--layers", str(count), "--width", "64"]
        sides: dict[str, list[dict[str, Any]]] = {"torchdelegate": [], "ExecuTorch": []}
        commands = {"torchdelegate": [*OURS, "lower", *shape], "ExecuTorch": [*THEIRS, "lower", *shape]}
        for _ in range(repeats):
            for side, command in commands.items():
                runs = sides[side]
                if runs and runs[-1]["seconds"] > budget:
                    continue
                runs.append(measure(command))
                print(f"  lowering L={count} {side}: {runs[-1]['seconds']:.3f} s", file=sys.stderr, flush=True)
        rows.append({"layers": count, "sides": sides})
    return rows


def saved_files(variants: list[str], directory: Path) -> dict[str, dict[str, Any]]:
    """Prefill + decode lowered by each side and saved; file figures, keyed by side name."""
    files = {}
    for variant in variants:
        path = directory / f"{variant}.tdp"
        files[f"torchdelegate {variant}"] = {**measure([*OURS, "save", "--backend", variant, "--out", str(path)])}
        files[f"torchdelegate {variant}"]["path"] = str(path)
        print(f"  saved {variant}: {path.stat().st_size} B", file=sys.stderr, flush=True)
    path = directory / "executorch.pte"
    files[EXECUTORCH] = {**measure([*THEIRS, "save", "--out", str(path)]), "path": str(path)}
    return files


def runtime(files: dict[str, dict[str, Any]], expected: Path, rounds: int, calls: int) -> dict[str, list[Any]]:
    """Each side's rounds of decode latency and resident memory, alternating the sides."""
    check = ["--expected", str(expected), "--calls", str(calls)]
    commands = {EAGER: [*OURS, "run", "--eager", *check]}
    for side, figures in files.items():
        program = THEIRS if side == EXECUTORCH else OURS
        commands[side] = [*program, "run", "--file", figures["path"], *check]
    results: dict[str, list[Any]] = {side: [] for side in commands}
    for index in range(rounds):
        for side, command in commands.items():
            results[side].append(measure(command))
        print(f"  runtime round {index + 1}/{rounds} done", file=sys.stderr, flush=True)
    return results


def machine() -> dict[str, str]:
    """What the figures were measured on."""
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    memory = next(int(line.split()[1]) * 1024 for line in open("/proc/meminfo") if line.startswith("MemTotal"))
    versions = {"version": "not installed", "torch": "-"}  # a run that leaves ExecuTorch out needs no venv of it
    if EXECUTORCH_PYTHON.exists():
        versions = measure([str(EXECUTORCH_PYTHON), "-c", _VERSIONS.format(package="executorch")], timeout=300)
    import onnxruntime

    return {
        "cpu": cpu,
        "cores": str(os.cpu_count()),
        "memory": f"{memory / 2**30:.1f} GiB",
        "os": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "onnxruntime": onnxruntime.__version__,
        "executorch": versions["version"],
        "executorch torch": versions["torch"],
    }


_VERSIONS = (
    "import importlib.metadata, json, torch; "
    "print(json.dumps({{'version': importlib.metadata.version('{package}'), 'torch': torch.__version__}}))"
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 8, 32, 128])
    parser.add_argument("--repeats", type=int, default=3, help="lowering repetitions per size and side")
    parser.add_argument("--budget", type=float, default=120.0, help="seconds after which a lowering is not repeated")
    parser.add_argument(
        "--variants", nargs="+", default=["onnxruntime", "onnxruntime-noprepack", "inductor", "reference"]
    )
    parser.add_argument("--rounds", type=int, default=5, help="alternating runtime rounds")
    parser.add_argument("--calls", type=int, default=200, help="decode calls per timing")
    parser.add_argument("--quick", action="store_true", help="a smoke run: L=2 and 8, two rounds, no inductor")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args()
    if args.quick:
        args.layers, args.repeats, args.rounds, args.calls = [2, 8], 2, 2, 50
        args.variants = [v for v in args.variants if v != "inductor"]
    if not EXECUTORCH_PYTHON.exists():
        sys.exit(f"{EXECUTORCH_PYTHON} is missing: `make bench` creates it (torch==2.13.0, executorch==1.5.1)")
    data: dict[str, Any] = {"date": datetime.date.today().isoformat(), "command": " ".join(sys.argv)}
    data["machine"] = machine()
    print("lowering cost against graph size", file=sys.stderr)
    data["lowering"] = lowering(args.layers, args.repeats, args.budget)
    model, _ = seeded_stack(4, 256)
    data["weights"] = weight_bytes(model)
    with tempfile.TemporaryDirectory() as directory, torch.no_grad():
        expected = Path(directory) / "expected.pt"
        torch.save({m: model(*x) for m, x in method_inputs(256).items()}, expected)
        print("two methods saved by each side", file=sys.stderr)
        data["files"] = saved_files(args.variants, Path(directory))
        print("runtime", file=sys.stderr)
        data["runtime"] = runtime(data["files"], expected, args.rounds, args.calls)
    for figures in data["files"].values():
        figures.pop("path")
    page = write_results(data, args.out)
    print(page.read_text())


if __name__ == "__main__":
    main()
