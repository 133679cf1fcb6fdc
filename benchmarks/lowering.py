"""Lowering cost against model size: is it linear, and does it copy weights?

A stack of L transformer blocks (attention + MLP, d=64) is exported and decomposed; a
partitioner built on torch.fx's CapabilityBasedPartitioner claims linear/addmm/mm/permute/
view/add/mul/gelu, so every block yields several partitions; the backend's preprocess
does nothing, so the time measured is the framework's. For each L the script prints the
graph's nodes, the partitions, the median seconds of ``to_backend`` over a few runs, the
ratio to L=32, the seconds fx's partitioner took to propose the partitions (computed once
and cached under benchmarks/.cache, outside the timing: it is quadratic, about 11 minutes
at L=128 here; lowering sees its tags replayed), the peak growth of resident memory during
the first lowering in a fresh process against the weights' bytes, and the bytes of tensor
storage the lowered program holds that the original does not share (0: nothing copied),
and the Python objects (graphs, nodes, generated code) a lowering allocates: kept in the
result, and at its peak (tracemalloc; tensor data is not Python objects).

    python benchmarks/lowering.py [--layers 2 8 32 128] [--width 64] [--repeats 5] [--two-methods 32]

Then prefill (seq 8) and decode (seq 1) of the L=32 stack, same weights, are lowered
together (one to_backend call) and compared with lowering prefill alone.

Last, lowering with a report, as ``torchdelegate lower`` does (``--report-layers L``): the L-block
stack through ``to_edge`` and a capability partitioner of the same ops, timed with its report
(``lower_with_report``: before the report was emitted by lowering, it planned the partitions
twice and found their boundaries again; that function now reads the manager's own report).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Iterable
from pathlib import Path

import torch
from instruments import PeakRss  # benchmarks/ is the script's directory
from stack import Stack
from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner
from torch.fx.passes.operator_support import OperatorSupportBase

from torchdelegate import (
    DELEGATION_TAG,
    BackendDetails,
    DelegationSpec,
    LoweredBackendModule,
    Partitioner,
    PartitionResult,
    PreprocessResult,
    to_backend,
)

aten = torch.ops.aten
CACHE = Path(__file__).parent / ".cache"
SUPPORTED = {
    aten.linear.default,
    aten.addmm.default,
    aten.mm.default,
    aten.permute.default,
    aten.view.default,
    aten.add.Tensor,
    aten.mul.Tensor,
    aten.gelu.default,
}


class BenchmarkBackend(BackendDetails):
    """Does no work, so that what is timed is the framework."""

    backend_id = "BenchmarkNoop"

    @staticmethod
    def preprocess(edge_program, compile_specs):  # type: ignore[no-untyped-def]
        return PreprocessResult(processed_bytes=b"noop")


class _Support(OperatorSupportBase):
    def is_node_supported(self, submodules, node):  # type: ignore[no-untyped-def]
        return node.op == "call_function" and node.target in SUPPORTED


def fx_partitions(program: torch.export.ExportedProgram) -> dict[str, str]:
    """Node name -> tag, as torch.fx's CapabilityBasedPartitioner proposes (it is quadratic)."""
    proposer = CapabilityBasedPartitioner(program.graph_module, _Support(), allows_single_node_partition=True)
    return {node.name: f"tag{partition.id}" for partition in proposer.propose_partitions() for node in partition.nodes}


class ReplayPartitioner(Partitioner):
    """Tags the nodes fx's partitioner proposed (computed once), so the timing is lowering's."""

    def __init__(self, tags: dict[str, str]) -> None:
        self.tags = tags

    def partition(self, exported_program):  # type: ignore[no-untyped-def]
        spec = DelegationSpec(BenchmarkBackend.backend_id)
        for node in exported_program.graph.nodes:
            if node.name in self.tags:
                node.meta[DELEGATION_TAG] = self.tags[node.name]
        return PartitionResult(exported_program, dict.fromkeys(sorted(set(self.tags.values())), spec))


def _storages(tensors: Iterable[object]) -> dict[int, int]:
    """Storage address -> bytes, for the tensors among ``tensors``."""
    return {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if isinstance(t, torch.Tensor)
    }


def copied_bytes(original: torch.export.ExportedProgram, lowered: torch.export.ExportedProgram) -> int:
    """Bytes of tensor storage in the lowered program (and its delegates) not shared with the original."""
    before = _storages([*original.state_dict.values(), *original.constants.values()])
    after = _storages([*lowered.state_dict.values(), *lowered.constants.values()])
    for module in lowered.graph_module.modules():
        if isinstance(module, LoweredBackendModule):
            sub = module.original_module
            after.update(_storages([*sub.state_dict.values(), *sub.constants.values()]))
    return sum(size for pointer, size in after.items() if pointer not in before)


def cached_fx_partitions(
    program: torch.export.ExportedProgram, layers: int, width: int, seq: int = 8
) -> tuple[dict[str, str], float]:
    """fx's proposal for this model, computed once per torch version and size (it is quadratic)."""
    CACHE.mkdir(parents=True, exist_ok=True)
    suffix = "" if seq == 8 else f"-s{seq}"
    path = CACHE / f"fx-tags-torch{torch.__version__}-L{layers}-d{width}{suffix}.json"
    names = {node.name for node in program.graph.nodes}
    if path.exists():
        cached = json.loads(path.read_text())
        if set(cached["tags"]) <= names:
            return cached["tags"], cached["seconds"]
    start = time.perf_counter()
    tags = fx_partitions(program)
    seconds = time.perf_counter() - start
    path.write_text(json.dumps({"tags": tags, "seconds": seconds}, sort_keys=True))
    return tags, seconds


def measure(layers: int, width: int, repeats: int) -> dict[str, float]:
    """One size, in this (fresh) process: first the memory of one lowering, then the timings."""
    torch.manual_seed(0)
    model = Stack(layers, width).eval()
    program = torch.export.export(model, (torch.randn(1, 8, width),)).run_decompositions()
    weight_bytes = sum(t.numel() * t.element_size() for t in program.state_dict.values())
    tags, fx_seconds = cached_fx_partitions(program, layers, width)
    partitioner = ReplayPartitioner(tags)
    gc.collect()
    with PeakRss() as rss:
        lowered = to_backend(program, partitioner)
    copied = copied_bytes(program, lowered)
    partitions = sum(1 for m in lowered.graph_module.children() if isinstance(m, LoweredBackendModule))
    del lowered
    gc.collect()
    tracemalloc.start()
    kept = to_backend(program, partitioner)
    python_bytes, python_peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    del kept
    times = []
    for _ in range(repeats):
        gc.collect()
        start = time.perf_counter()
        to_backend(program, partitioner)
        times.append(time.perf_counter() - start)
    return {
        "layers": layers,
        "nodes": len(program.graph.nodes),
        "partitions": partitions,
        "seconds": statistics.median(times),
        "fx_seconds": fx_seconds,
        "rss_growth": rss.growth,
        "copied": copied,
        "python_kept": python_bytes,
        "python_peak": python_peak,
        "weights": weight_bytes,
    }


def measure_two_methods(layers: int, width: int, repeats: int) -> dict[str, float]:
    """Lowering prefill (seq 8) and decode (seq 1) of one model together, against prefill alone."""
    torch.manual_seed(0)
    model = Stack(layers, width).eval()
    programs, partitioners = {}, {}
    for method, seq in (("prefill", 8), ("decode", 1)):
        program = torch.export.export(model, (torch.randn(1, seq, width),)).run_decompositions()
        programs[method] = program
        partitioners[method] = ReplayPartitioner(cached_fx_partitions(program, layers, width, seq)[0])
    one, both = [], []
    for _ in range(repeats):
        gc.collect()
        start = time.perf_counter()
        to_backend({"prefill": programs["prefill"]}, {"prefill": partitioners["prefill"]})
        one.append(time.perf_counter() - start)
        gc.collect()
        start = time.perf_counter()
        to_backend(programs, partitioners)
        both.append(time.perf_counter() - start)
    return {"one": statistics.median(one), "both": statistics.median(both)}


def measure_with_report(layers: int, width: int, repeats: int) -> float:
    """Median seconds of lowering the stack with its partition report (a capability partitioner)."""
    import warnings

    from torchdelegate import CapabilityPartitioner, to_edge
    from torchdelegate.report import lower_with_report

    torch.manual_seed(0)
    model = Stack(layers, width).eval()
    edge = to_edge(torch.export.export(model, (torch.randn(1, 8, width),)))
    partitioner = CapabilityPartitioner(SUPPORTED, DelegationSpec(BenchmarkBackend.backend_id))
    times = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        for _ in range(repeats):
            gc.collect()
            start = time.perf_counter()
            lower_with_report(edge, partitioner)
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 8, 32, 128])
    parser.add_argument("--width", type=int, default=64, help="the model dimension d")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    parser.add_argument(
        "--two-methods", type=int, default=32, metavar="L", help="L of the prefill+decode run (0: skip)"
    )
    parser.add_argument(
        "--report-layers", type=int, default=32, metavar="L", help="L of the lowering with a report (0: skip)"
    )
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(measure(args.child, args.width, args.repeats)))
        return
    print(
        f"torch {torch.__version__}, Python {platform.python_version()}, {platform.machine()}, {os.cpu_count()} cores"
    )
    rows = []
    for layers in args.layers:
        command = [sys.executable, __file__, "--child", str(layers), "--width", str(args.width)]
        child = subprocess.run([*command, "--repeats", str(args.repeats)], capture_output=True, text=True, check=True)
        rows.append(json.loads(child.stdout.strip().splitlines()[-1]))
    base = next((r for r in rows if r["layers"] == 32), rows[0])
    print(
        f"{'L':>5} {'nodes':>7} {'partitions':>10} {'to_backend s':>12} {'/L=32':>7} {'fx tagging s':>12} "
        f"{'peak RSS +MiB':>14} {'weights MiB':>12} {'RSS/weights':>12} {'copied B':>9} "
        f"{'py objs kept/peak MiB':>22}"
    )
    for r in rows:
        print(
            f"{r['layers']:>5} {r['nodes']:>7} {r['partitions']:>10} {r['seconds']:>12.3f} "
            f"{r['seconds'] / base['seconds']:>7.2f} {r['fx_seconds']:>12.2f} {r['rss_growth'] / 2**20:>14.2f} "
            f"{r['weights'] / 2**20:>12.2f} {r['rss_growth'] / r['weights']:>12.2%} {r['copied']:>9} "
            f"{r['python_kept'] / 2**20:>12.2f} / {r['python_peak'] / 2**20:>7.2f}"
        )
    if args.two_methods:
        two = measure_two_methods(args.two_methods, args.width, args.repeats)
        print(
            f"two methods, L={args.two_methods}: prefill alone {two['one']:.3f} s, prefill + decode together "
            f"{two['both']:.3f} s, ratio {two['both'] / two['one']:.2f}"
        )
    if args.report_layers:
        seconds = measure_with_report(args.report_layers, args.width, args.repeats)
        print(f"with its report (capability partitioner, to_edge'd), L={args.report_layers}: {seconds:.3f} s")


if __name__ == "__main__":
    main()
