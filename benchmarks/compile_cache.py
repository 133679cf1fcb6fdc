"""The compile cache and parallel preprocess, measured: each lowering in a fresh process.

For the demo language model and (``--llm``) the 200M-parameter Llama of ``llm.py``, lowered with
ONNX Runtime then the reference backend: a cold lowering into an empty cache, a warm one (same
model), and a fine-tuned variant (every weight changed, same architecture); each reports the
time spent in preprocess and the rest (export and partitioning). Then a program of four
transformer blocks kept apart by an operation left to the reference backend, lowered with ONNX
Runtime (and, ``--inductor``, with AOTInductor: minutes) serially, with ``jobs=2`` and on a
two-worker Dask ``LocalCluster`` (started before the lowering, as a deployer's cluster is): times
and whether the files are the same bytes.

    python benchmarks/compile_cache.py [--llm] [--inductor] [--rounds 3]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from stack import Block

HERE = Path(__file__).resolve().parent


def _programs(model_name: str, seed: int) -> dict[str, Any]:
    if model_name == "demo":
        from torchdelegate.demo.model import build_demo_model, export_demo

        model = build_demo_model(seed=0)
        _perturb(model, seed)
        return export_demo(model, 16)
    if model_name == "llm":
        sys.path.insert(0, str(HERE))
        from llm_side import export, llama, static_cache_module

        model = llama("base")
        _perturb(model, seed)
        return export(static_cache_module(model), True)
    torch.manual_seed(0)
    model = Branches()
    _perturb(model, seed)
    return {"forward": torch.export.export(model, (torch.randn(1, 64, 512),))}


def _perturb(model: Any, seed: int) -> None:
    """Every weight changed (a fine-tune) unless ``seed`` is 0; norms made distinct as trained ones are."""
    generator = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * (0.01 if seed else 0.001))


class Branches(torch.nn.Module):
    """Four ONNX Runtime partitions, one per transformer block, kept apart by the reference
    backend's nextafter."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(Block(512, 8) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
            x = torch.nextafter(x, x + 1)  # ONNX has no nextafter
        return x


def _partitioners(backend: str) -> list[Any]:
    from torchdelegate.backends.inductor import InductorPartitioner
    from torchdelegate.backends.onnxruntime import OnnxRuntimePartitioner
    from torchdelegate.backends.reference import ReferencePartitioner

    class InductorBlocks(InductorPartitioner):
        """AOTInductor for everything but nextafter, which keeps the blocks apart."""

        def operator_support(self, node: Any) -> bool | str:
            if node.target is torch.ops.aten.nextafter.default:
                return "left to the reference backend: it keeps the blocks apart"
            return super().operator_support(node)

    first = InductorBlocks() if backend == "inductor" else OnnxRuntimePartitioner()
    return [first, ReferencePartitioner()]


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """One lowering in this process; its figures."""
    import torchdelegate as td
    import torchdelegate.lowering.batch as batch

    spent = {"preprocess": 0.0}
    inner = batch.preprocess_jobs

    def timed(jobs: Any) -> None:
        started = time.perf_counter()
        inner(jobs)
        spent["preprocess"] += time.perf_counter() - started

    batch.preprocess_jobs = timed
    started = time.perf_counter()
    programs = _programs(args.model, args.seed)
    exported = time.perf_counter()
    options: dict[str, Any] = {"cache": args.cache or False}
    cluster = None
    if args.jobs:
        options["jobs"] = args.jobs
    if args.cluster:
        import distributed

        cluster = distributed.LocalCluster(n_workers=2, threads_per_worker=1, host="127.0.0.1", dashboard_address=None)
        options["cluster"] = cluster.scheduler_address
    with td.preprocessing(**options):
        begun = time.perf_counter()
        lowered = td.to_edge_transform_and_lower(programs, partitioner=_partitioners(args.backend))
        done = time.perf_counter()
    if cluster is not None:
        cluster.close()
    lowered.save(args.out)
    answers = [d.meta.get("compile_cache") for ds in lowered.delegates().values() for d in ds]
    return {
        "export_s": exported - started,
        "lower_s": done - begun,
        "preprocess_s": spent["preprocess"],
        "rest_s": done - begun - spent["preprocess"],
        "cache": answers,
        "sha256": hashlib.sha256(Path(args.out).read_bytes()).hexdigest(),
        "started_workers_s": begun - exported,
    }


def run(model: str, seed: int, out: Path, **options: Any) -> dict[str, Any]:
    command = [sys.executable, __file__, "measure", "--model", model, "--seed", str(seed), "--out", str(out)]
    for key, value in options.items():
        command += [f"--{key}"] + ([] if value is True else [str(value)])
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def cache_figures(model: str, rounds: int, directory: Path) -> list[str]:
    lines = [f"### {model}: compile cache (ONNX Runtime, then reference)", ""]
    rows: dict[str, list[dict[str, Any]]] = {"cold": [], "warm": [], "fine-tuned": []}
    for index in range(rounds):
        cache = directory / f"{model}-cache-{index}"
        rows["cold"].append(run(model, 0, directory / "cold.tdp", cache=cache))
        rows["warm"].append(run(model, 0, directory / "warm.tdp", cache=cache))
        rows["fine-tuned"].append(run(model, 1, directory / "tuned.tdp", cache=cache))
    plain = run(model, 1, directory / "tuned-plain.tdp")
    cold = statistics.median(r["preprocess_s"] for r in rows["cold"])
    lines.append("| lowering | preprocess s | of cold preprocess | rest s | cache answers |")
    lines.append("|---|---|---|---|---|")
    for name, figures in rows.items():
        preprocess = statistics.median(r["preprocess_s"] for r in figures)
        rest = statistics.median(r["rest_s"] for r in figures)
        answers = ", ".join(str(a) for a in figures[-1]["cache"])
        lines.append(f"| {name} | {preprocess:.3f} | {preprocess / cold:.1%} | {rest:.2f} | {answers} |")
    same = rows["cold"][-1]["sha256"] == rows["warm"][-1]["sha256"]
    tuned = rows["fine-tuned"][-1]["sha256"] == plain["sha256"]
    lines += ["", f"warm file = cold file: {same}; fine-tuned through the cache = fine-tuned without: {tuned}", ""]
    return lines


def parallel_figures(backend: str, rounds: int, directory: Path) -> list[str]:
    title = f"four transformer blocks, {backend} partitions: serial, jobs=2, a two-worker LocalCluster"
    lines = [f"### {title}", ""]
    runs: dict[str, list[dict[str, Any]]] = {"serial": [], "jobs 2": [], "LocalCluster, 2 workers": []}
    for _ in range(rounds):
        runs["serial"].append(run("branches", 0, directory / "serial.tdp", backend=backend))
        runs["jobs 2"].append(run("branches", 0, directory / "jobs.tdp", jobs=2, backend=backend))
        runs["LocalCluster, 2 workers"].append(
            run("branches", 0, directory / "cluster.tdp", cluster=True, backend=backend)
        )
    serial = statistics.median(r["lower_s"] for r in runs["serial"])
    lines += ["| path | lowering s | ÷ serial | preprocess s | same bytes as serial |", "|---|---|---|---|---|"]
    for name, figures in runs.items():
        lower = statistics.median(r["lower_s"] for r in figures)
        preprocess = statistics.median(r["preprocess_s"] for r in figures)
        same = figures[-1]["sha256"] == runs["serial"][-1]["sha256"]
        lines.append(f"| {name} | {lower:.2f} | {lower / serial:.2f} | {preprocess:.2f} | {same} |")
    return [*lines, ""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("phase", nargs="?", default="all", choices=["all", "measure"])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--cache")
    parser.add_argument("--jobs", type=int)
    parser.add_argument("--cluster", action="store_true")
    parser.add_argument("--llm", action="store_true", help="also the 200M-parameter Llama (minutes per lowering)")
    parser.add_argument("--backend", default="onnxruntime", choices=["onnxruntime", "inductor"])
    parser.add_argument("--inductor", action="store_true", help="also the blocks on AOTInductor (minutes each)")
    parser.add_argument("--only", choices=["cache", "parallel"], help="one of the two parts")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if args.phase == "measure":
        print(json.dumps(measure(args)))
        return
    with tempfile.TemporaryDirectory() as scratch:
        directory = Path(scratch)
        lines = []
        if args.only != "parallel":
            lines += cache_figures("demo", args.rounds, directory)
            if args.llm:
                lines += cache_figures("llm", 1, directory)
        if args.only != "cache":
            lines += parallel_figures("onnxruntime", args.rounds, directory)
            if args.inductor:
                lines += parallel_figures("inductor", 1, directory)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
