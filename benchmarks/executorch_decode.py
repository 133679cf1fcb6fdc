"""The ExecuTorch side of the decode benchmark; runs in .venv-executorch (torch + executorch only).

Lowers the benchmark stack to XNNPACK with ExecuTorch's own API, saves the .pte, loads it
with ExecuTorch's runtime and prints, as JSON: the median latency of one-token calls, the
file size, and the largest difference from eager torch.

    .venv-executorch/bin/python benchmarks/executorch_decode.py --layers 4 --width 256 --calls 200
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
from executorch.exir import to_edge_transform_and_lower
from executorch.runtime import Runtime
from stack import seeded_stack


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    model, x = seeded_stack(args.layers, args.width)
    with torch.no_grad():
        expected = model(x)
        program = torch.export.export(model, (x,))
    executorch = to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()]).to_executorch()
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "stack.pte"
        path.write_bytes(executorch.buffer)
        method = Runtime.get().load_program(path).load_method("forward")
        for _ in range(20):
            out = method.execute([x])[0]
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            for _ in range(args.calls):
                method.execute([x])
            times.append((time.perf_counter() - start) / args.calls * 1e6)
        print(
            json.dumps(
                {
                    "latency_us": statistics.median(times),
                    "min_us": min(times),
                    "max_us": max(times),
                    "file_bytes": path.stat().st_size,
                    "max_abs_diff": float((out - expected).abs().max()),
                }
            )
        )


if __name__ == "__main__":
    main()
