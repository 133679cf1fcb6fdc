"""The runtime's own costs: per delegate call, opening a large file, and resident memory.

1. **Overhead per delegate call.** A chain of N small ops, each its own delegate on the
   reference backend (the residual graph is nothing but delegate calls), saved and loaded.
   ``Program.run`` time minus the time spent inside the backend's ``execute`` (measured by
   the backend itself), divided by N. Medians over repetitions.
2. **Opening a large file.** A program whose named data is ``--gib`` GiB (a stack of
   4096x4096 linears on the reference backend), saved; a fresh process times ``load()``
   (mmap, checks; no backend ``init``) and reports its resident memory growth.
3. **Resident memory after loading two methods.** The test suite's decoder (prefill +
   decode share every weight), larger; a fresh process loads it, runs each method once
   (so every weight has been read), and reports resident memory growth over the weights'
   bytes. The baseline is taken after loading and running a tiny program and one GEMM of
   the model's largest shape, so that one-time initialisation is not counted: Python's and
   torch's, and the workspace MKL allocates on its first large GEMM (about 8 MB here; eager
   torch pays it too). The script prints that workspace separately.

    python benchmarks/runtime.py [--delegates 64] [--gib 1.0] [--repeats 7]
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
import textwrap
import time
from pathlib import Path
from typing import Any

import torch

import torchdelegate as td
from torchdelegate import DELEGATION_TAG, DelegationSpec, Partitioner, PartitionResult
from torchdelegate.backends.reference import ReferenceBackend, ReferencePartitioner

ROOT = Path(__file__).resolve().parent.parent


class TimedReference(ReferenceBackend):
    """The reference backend, accumulating the nanoseconds spent in its own ``execute``."""

    backend_id = "BenchTimedReference"
    execute_ns = 0
    calls = 0

    @classmethod
    def execute(cls, handle: Any, inputs: list[Any]) -> list[torch.Tensor]:
        start = time.perf_counter_ns()
        outputs = handle(inputs)
        cls.execute_ns += time.perf_counter_ns() - start
        cls.calls += 1
        return outputs


class EachNodeAlone(Partitioner):
    """Every computation is its own partition."""

    def partition(self, exported_program: torch.export.ExportedProgram) -> PartitionResult:
        tags = {}
        for index, node in enumerate(n for n in exported_program.graph.nodes if n.op == "call_function"):
            node.meta[DELEGATION_TAG] = tag = f"op{index:05d}"
            tags[tag] = DelegationSpec(TimedReference.backend_id)
        return PartitionResult(exported_program, tags)


class Chain(torch.nn.Module):
    def __init__(self, length: int) -> None:
        super().__init__()
        self.length = length

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for index in range(self.length):
            x = x * 1.0001 if index % 2 else x + 0.5
        return x


def delegate_overhead(count: int, repeats: int, calls: int) -> dict[str, float]:
    program = torch.export.export(Chain(count), (torch.randn(4, 4),))
    lowered = td.to_edge(program).to_backend(EachNodeAlone())
    delegates = sum(len(d) for d in lowered.delegates().values())
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "chain.tdp"
        lowered.save(path)
        with td.load(path) as loaded:
            x = torch.randn(4, 4)
            for _ in range(20):
                loaded.run("forward", x)
            per_call = []
            for _ in range(repeats):
                TimedReference.execute_ns = TimedReference.calls = 0
                start = time.perf_counter_ns()
                for _ in range(calls):
                    loaded.run("forward", x)
                total = time.perf_counter_ns() - start
                assert TimedReference.calls == calls * delegates
                per_call.append((total - TimedReference.execute_ns) / (calls * delegates) / 1000)
                run_us = total / calls / 1000
    return {
        "delegates": delegates,
        "overhead_us_per_delegate_call": statistics.median(per_call),
        "overhead_min": min(per_call),
        "overhead_max": max(per_call),
        "run_us": run_us,
        "execute_us_per_call": TimedReference.execute_ns / TimedReference.calls / 1000,
    }


class Linears(torch.nn.Module):
    def __init__(self, count: int, width: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width, bias=False) for _ in range(count))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


_CHILD_RSS = """
import json, sys, time, resource
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()
import torch, torchdelegate
"""


def large_file_open(gib: float) -> dict[str, float]:
    width = 4096
    count = max(1, round(gib * (1 << 30) / (width * width * 4)))
    with torch.no_grad():
        model = Linears(count, width)
    program = torch.export.export(model, (torch.randn(1, width),))
    lowered = td.to_edge(program).to_backend(ReferencePartitioner())
    weights = sum(p.numel() * 4 for p in model.parameters())
    del model, program
    with tempfile.TemporaryDirectory(dir=ROOT / "benchmarks") as directory:
        path = Path(directory) / "large.tdp"
        lowered.save(path)
        del lowered
        script = _CHILD_RSS + textwrap.dedent(
            f"""
            before = rss()
            start = time.perf_counter()
            program = torchdelegate.load({str(path)!r})
            seconds = time.perf_counter() - start
            print(json.dumps({{"seconds": seconds, "rss_growth": rss() - before}}))
            """
        )
        runs = _children(script)
        size = path.stat().st_size
    return {
        "named_data_bytes": weights,
        "file_bytes": size,
        **_medians(runs),
        "seconds_max": max(r["seconds"] for r in runs),
    }


def two_method_resident(vocab: int, width: int) -> dict[str, float]:
    sys.path.insert(0, str(ROOT / "tests"))
    from models import TinyDecoder, decoder_methods

    torch.manual_seed(0)
    model = TinyDecoder(vocab=vocab, d=width, max_len=64)
    weights = model.weight_bytes()
    lowered = td.to_edge(decoder_methods(model)).to_backend(ReferencePartitioner())
    tiny = td.to_edge(decoder_methods(TinyDecoder(vocab=16, d=8, max_len=64))).to_backend(ReferencePartitioner())
    with tempfile.TemporaryDirectory() as directory:
        path, warm = Path(directory) / "decoder.tdp", Path(directory) / "tiny.tdp"
        lowered.save(path)
        tiny.save(warm)
        script = _CHILD_RSS + textwrap.dedent(
            f"""
            def generate(program):
                program.run("prefill", torch.arange(8), torch.arange(8))
                program.run("decode", torch.tensor([1]), torch.tensor([8]))
            with torch.no_grad():
                with torchdelegate.load({str(warm)!r}) as warm_up:
                    generate(warm_up)
                start = rss()
                torch.addmm(torch.zeros({vocab}), torch.ones(8, {width}), torch.ones({vocab}, {width}).t())
                workspace = rss() - start  # the operands are freed; what stays is the workspace
                before = rss()
                program = torchdelegate.load({str(path)!r})
                loaded = rss()
                generate(program)
                ran = rss()
            print(json.dumps({{"after_load": loaded - before, "after_run": ran - before, "workspace": workspace}}))
            """
        )
        runs = _children(script)
        size = path.stat().st_size
    return {"weight_bytes": weights, "file_bytes": size, **_medians(runs)}


def _children(script: str, count: int = 3) -> list[dict[str, float]]:
    """The JSON each of ``count`` fresh processes running ``script`` prints last."""
    runs = []
    for _ in range(count):
        done = subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, text=True, timeout=600)
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    return runs


def _medians(runs: list[dict[str, float]]) -> dict[str, float]:
    return {key: statistics.median(run[key] for run in runs) for key in runs[0]}


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as info:
            cpu = next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}, torch {torch.__version__}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--delegates", type=int, default=64)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--width", type=int, default=384)
    args = parser.parse_args()
    print(f"machine: {_machine()}")

    overhead = delegate_overhead(args.delegates, args.repeats, args.calls)
    print(
        f"\n1. overhead per delegate call ({overhead['delegates']} delegates, {args.calls} runs x {args.repeats}):\n"
        f"   run {overhead['run_us']:.1f} us, backend execute {overhead['execute_us_per_call']:.2f} us per delegate\n"
        f"   framework overhead {overhead['overhead_us_per_delegate_call']:.2f} us per delegate call "
        f"(min {overhead['overhead_min']:.2f}, max {overhead['overhead_max']:.2f}); target <= 20 us"
    )

    opened = large_file_open(args.gib)
    print(
        f"\n2. open a file with {opened['named_data_bytes'] / (1 << 30):.2f} GiB of named data "
        f"({opened['file_bytes']} bytes): load() {opened['seconds']:.3f} s median of 3 "
        f"(max {opened['seconds_max']:.3f}), resident growth {opened['rss_growth'] / 1e6:.1f} MB; "
        "target <= 0.2 s"
    )

    resident = two_method_resident(args.vocab, args.width)
    weights = resident["weight_bytes"]
    print(
        f"\n3. two methods sharing {weights / 1e6:.1f} MB of weights (file {resident['file_bytes'] / 1e6:.2f} MB, "
        f"{resident['file_bytes'] / weights:.3f} x weights): resident growth after load "
        f"{resident['after_load'] / 1e6:.1f} MB, after running both methods "
        f"{resident['after_run'] / 1e6:.1f} MB = {resident['after_run'] / weights:.2f} x weights; "
        "target <= 1.2 x\n"
        f"   (not counted: MKL's one-time GEMM workspace, {resident['workspace'] / 1e6:.1f} MB, "
        "taken before the baseline)"
    )


if __name__ == "__main__":
    main()
