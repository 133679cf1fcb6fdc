"""The ExecuTorch side of benchmarks/compare.py; runs in .venv-executorch (torch + executorch only).

Each call does one measurement in this fresh process and prints it as JSON on its last line:

    lower --layers L          ExecuTorch's EdgeProgramManager.to_backend on the stack (d=64),
                              tagged by workloads.tag_runs for a backend that does nothing
    save --out F.pte          prefill + decode of the stack (L=4, d=256) lowered to XNNPACK
    run --file F.pte          load both methods with ExecuTorch's runtime, resident memory,
                              then the latency of one-token decode calls
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch
from executorch.exir import to_edge, to_edge_transform_and_lower
from executorch.exir.backend.backend_details import BackendDetails, PreprocessResult
from executorch.exir.backend.partitioner import DelegationSpec, Partitioner, PartitionResult
from instruments import PeakRss, call_latency_us, rss_bytes, warm_up_torch
from stack import seeded_stack
from workloads import method_inputs, run_side, side_parser, tag_runs, weight_bytes


class NoopBackend(BackendDetails):
    """Does no work, so that what is timed is ExecuTorch's lowering."""

    @staticmethod
    def preprocess(edge_program: Any, compile_specs: Any) -> PreprocessResult:
        return PreprocessResult(processed_bytes=b"noop")


class RunsPartitioner(Partitioner):
    def __init__(self) -> None:
        super().__init__()
        self.delegation_spec = DelegationSpec(NoopBackend.__name__, [])

    def partition(self, exported_program: Any) -> PartitionResult:
        tags = tag_runs(exported_program.graph)
        return PartitionResult(exported_program, dict.fromkeys(tags, self.delegation_spec))


def lower(args: argparse.Namespace) -> dict[str, Any]:
    model, _ = seeded_stack(args.layers, args.width)
    program = torch.export.export(model, (torch.randn(1, 8, args.width),))
    edge = to_edge(program)
    with PeakRss() as rss:
        start = time.perf_counter()
        lowered = edge.to_backend(RunsPartitioner())
        seconds = time.perf_counter() - start
    graph = lowered.exported_program().graph
    return {
        "nodes": len(edge.exported_program().graph.nodes),
        "partitions": sum(1 for n in graph.nodes if n.op == "get_attr" and n.name.startswith("lowered_module")),
        "seconds": seconds,
        "rss_growth": rss.growth,
        "weights": weight_bytes(model),
    }


def save(args: argparse.Namespace) -> dict[str, Any]:
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

    model, _ = seeded_stack(args.layers, args.width)
    with torch.no_grad():
        programs = {m: torch.export.export(model, x) for m, x in method_inputs(args.width).items()}
    lowered = to_edge_transform_and_lower(programs, partitioner=[XnnpackPartitioner()]).to_executorch()
    Path(args.out).write_bytes(lowered.buffer)
    return {"file_bytes": Path(args.out).stat().st_size, "weights": weight_bytes(model)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from executorch.runtime import Runtime

    inputs = method_inputs(args.width)
    expected = torch.load(args.expected)
    runtime = Runtime.get()
    warm_up_torch(args.width)
    before = rss_bytes()
    program = runtime.load_program(Path(args.file))
    methods = {m: program.load_method(m) for m in inputs}
    outputs = {m: method.execute(list(inputs[m]))[0] for m, method in methods.items()}
    resident = rss_bytes() - before
    decode, x = methods["decode"], list(inputs["decode"])
    times = call_latency_us(lambda: decode.execute(x), args.calls, args.repeats)
    difference = max(float((outputs[m] - expected[m]).abs().max()) for m in inputs)
    return {"latency_us": times, "rss_growth": resident, "max_abs_diff": difference}


def main() -> None:
    run_side(side_parser(__doc__ or ""), {"lower": lower, "save": save, "run": run})


if __name__ == "__main__":
    main()
