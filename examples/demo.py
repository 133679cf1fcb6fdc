"""Lower a small model to a backend, run it, and print what was delegated.

The backend here is written in a few lines to show the contract: ahead of time it
serializes each partition with torch.export's serializer, at run time it loads and runs it
with torch. Real backends (ONNX Runtime, AOTInductor) follow the same shape.
"""

from __future__ import annotations

import io
from collections import Counter

import torch
import torch.utils._pytree as pytree

from torchdelegate import (
    DELEGATION_TAG,
    BackendDetails,
    DelegationSpec,
    LoweredBackendModule,
    Partitioner,
    PartitionResult,
    PreprocessResult,
    tag_constant_data,
    to_backend,
)

aten = torch.ops.aten


class ExampleTorchBackend(BackendDetails):
    """Ahead of time: serialize the partition. At run time: load it once, call it per input."""

    @staticmethod
    def preprocess(edge_program, compile_specs):  # type: ignore[no-untyped-def]
        blob = io.BytesIO()
        torch.export.save(edge_program, blob)
        return PreprocessResult(processed_bytes=blob.getvalue())

    @classmethod
    def init(cls, processed, compile_specs, named_data):  # type: ignore[no-untyped-def]
        return torch.export.load(io.BytesIO(bytes(processed))).module()

    @classmethod
    def execute(cls, handle, inputs):  # type: ignore[no-untyped-def]
        return pytree.tree_leaves(handle(*inputs))


class MatmulPartitioner(Partitioner):
    """Claims matrix products and the element-wise ops around them; leaves the rest to torch."""

    SUPPORTED = {aten.addmm.default, aten.mm.default, aten.permute.default, aten.relu.default, aten.add.Tensor}

    def partition(self, exported_program):  # type: ignore[no-untyped-def]
        tags: dict[str, DelegationSpec] = {}
        previous_supported = False
        for node in exported_program.graph.nodes:
            if node.op != "call_function":
                continue
            supported = node.target in self.SUPPORTED
            if supported and not previous_supported:
                tags[f"matmul{len(tags)}"] = DelegationSpec(ExampleTorchBackend.backend_id)
            if supported:
                node.meta[DELEGATION_TAG] = f"matmul{len(tags) - 1}"
            previous_supported = supported
        tag_constant_data(exported_program)  # weights whose users are all delegated go inside
        return PartitionResult(exported_program, tags)


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32))
        self.norm = torch.nn.LayerNorm(32)
        self.head = torch.nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.encoder(x)).softmax(-1))


def main() -> None:
    model = Net().eval()
    x = torch.randn(8, 16)
    program = torch.export.export(model, (x,)).run_decompositions()
    lowered = to_backend(program, MatmulPartitioner())

    print(f"{len(program.graph.nodes)} nodes in the exported graph; lowered program:\n")
    print(lowered.graph_module.code)
    for name, module in lowered.graph_module.named_children():
        if isinstance(module, LoweredBackendModule):
            ops = Counter(
                str(n.target).removeprefix("aten.")
                for n in module.original_module.graph.nodes
                if n.op == "call_function"
            )
            weights = ", ".join(module.original_module.state_dict) or "none"
            print(
                f"{name}: backend {module.backend_id}, tag {module.meta['tag']!r}, blob {len(module.processed_bytes)} B"
            )
            print(f"    ops: {dict(ops)}")
            print(f"    weights inside: {weights}")
    kept = Counter(
        str(n.target).removeprefix("aten.")
        for n in lowered.graph.nodes
        if n.op == "call_function" and "getitem" not in str(n.target) and "call_delegate" not in str(n.target)
    )
    print(f"left to torch: {dict(kept)}")
    error = (lowered.module()(x) - model(x)).abs().max().item()
    print(f"max |lowered - eager| = {error:.2e}")


if __name__ == "__main__":
    main()
