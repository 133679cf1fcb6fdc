"""torchdelegate's side of benchmarks/compare.py; the same measurements as executorch_side.py.

Each call does one measurement in this fresh process and prints it as JSON on its last line:

    lower --layers L                   EdgeProgramManager.to_backend on the stack (d=64), tagged by
                                       workloads.tag_runs for a backend that does nothing
    save --backend B --out F.tdp       prefill + decode of the stack (L=4, d=256) lowered to backend
                                       B (``reference`` takes what B leaves), saved
    run --file F.tdp | --eager         load both methods (or build the model), resident memory,
                                       then the latency of one-token decode calls
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch
from instruments import PeakRss, call_latency_us, rss_bytes, warm_up_torch
from stack import seeded_stack
from workloads import method_inputs, run_side, side_parser, tag_runs, weight_bytes

import torchdelegate as td
from torchdelegate import BackendDetails, CompileSpec, DelegationSpec, Partitioner, PartitionResult, PreprocessResult

# Backend variants: a shipped backend and its compile specs.
VARIANTS: dict[str, tuple[str, list[CompileSpec]]] = {
    "onnxruntime": ("onnxruntime", []),
    "onnxruntime-noprepack": ("onnxruntime", [CompileSpec("disable_prepacking", b"1")]),
    "inductor": ("inductor", []),
    "reference": ("reference", []),
}


class NoopBackend(BackendDetails):
    """Does no work, so that what is timed is torchdelegate's lowering."""

    backend_id = "BenchNoop"

    @staticmethod
    def preprocess(edge_program: Any, compile_specs: Any) -> PreprocessResult:
        return PreprocessResult(processed_bytes=b"noop")


class RunsPartitioner(Partitioner):
    def partition(self, exported_program: torch.export.ExportedProgram) -> PartitionResult:
        tags = tag_runs(exported_program.graph)
        return PartitionResult(exported_program, dict.fromkeys(tags, DelegationSpec(NoopBackend.backend_id)))


def lower(args: argparse.Namespace) -> dict[str, Any]:
    model, _ = seeded_stack(args.layers, args.width)
    program = torch.export.export(model, (torch.randn(1, 8, args.width),))
    edge = td.to_edge(program)
    with PeakRss() as rss:
        start = time.perf_counter()
        lowered = edge.to_backend(RunsPartitioner())
        seconds = time.perf_counter() - start
    return {
        "nodes": len(edge.exported_program().graph.nodes),
        "partitions": len(lowered.delegates()["forward"]),
        "seconds": seconds,
        "rss_growth": rss.growth,
        "weights": weight_bytes(model),
    }


def save(args: argparse.Namespace) -> dict[str, Any]:
    from torchdelegate.partition.capability import CapabilityPartitioner
    from torchdelegate.partition.proposed import backend_supports

    backend, specs = VARIANTS[args.backend]
    model, _ = seeded_stack(args.layers, args.width)
    with torch.no_grad():
        programs = {m: torch.export.export(model, x) for m, x in method_inputs(args.width).items()}
    ids = list(dict.fromkeys([backend, "reference"]))
    partitioner = CapabilityPartitioner(backend_supports(ids, {backend: specs}))
    lowered = td.to_edge(programs).to_backend(partitioner)
    lowered.save(args.out)
    delegates = {m: sorted({d.backend_id for d in ds}) for m, ds in lowered.delegates().items()}
    counts = {m: len(ds) for m, ds in lowered.delegates().items()}
    return {
        "file_bytes": Path(args.out).stat().st_size,
        "weights": weight_bytes(model),
        "delegates": counts,
        "backends": delegates,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    inputs = method_inputs(args.width)
    expected = torch.load(args.expected)
    import onnxruntime  # noqa: F401  the backends' runtime libraries load before the baseline, as ExecuTorch's do

    warm_up_torch(args.width)
    before = rss_bytes()
    with torch.no_grad():
        if args.eager:
            model, _ = seeded_stack(args.layers, args.width)
            methods = {m: model for m in inputs}
        else:
            program = td.load(args.file)
            methods = {m: program.method(m) for m in inputs}
        outputs = {m: method(*inputs[m]) for m, method in methods.items()}
        resident = rss_bytes() - before
        decode, x = methods["decode"], inputs["decode"]
        times = call_latency_us(lambda: decode(*x), args.calls, args.repeats)
    difference = max(float((outputs[m] - expected[m]).abs().max()) for m in inputs)
    return {"latency_us": times, "rss_growth": resident, "max_abs_diff": difference}


def main() -> None:
    parser = side_parser(__doc__ or "")
    parser.add_argument("--backend", choices=sorted(VARIANTS))
    parser.add_argument("--eager", action="store_true")
    run_side(parser, {"lower": lower, "save": save, "run": run})


if __name__ == "__main__":
    main()
