"""What the backend claims: the ops torch's ONNX exporter translates into models ONNX Runtime's CPU
provider runs.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any

import torch
from torch._ops import OpOverload
from torch.export import ExportedProgram
from torch.fx import Node

from torchdelegate.backends.onnxruntime.blockwise import lookup_runs_on_kernel, runs_on_kernel
from torchdelegate.backends.onnxruntime.settings import BACKEND_ID, require
from torchdelegate.backends.onnxruntime.translation import onnx_registry
from torchdelegate.delegate.specs import CompileSpec, DelegationSpec
from torchdelegate.partition.capability import (
    CapabilityPartitioner,
    is_state_placeholder,
    non_tensor_value,
    values_made,
)
from torchdelegate.quantization.embedding import embedding_of, quantized_embeddings
from torchdelegate.quantization.linear import affine_ops, layer_of, quantized_linears

_UNSUPPORTED_DTYPES = frozenset(
    {torch.bfloat16, torch.complex64, torch.complex128, torch.float8_e4m3fn, torch.float8_e5m2}
)
# Ops torch.onnx translates into models ONNX Runtime refuses (torch 2.13, onnxruntime 1.32):
# _linalg_det's translation reads a tensor as a sequence.
_TRANSLATIONS_REFUSED = frozenset({torch.ops.aten._linalg_det.default})


@cache
def _onnx_registry() -> Any:
    from torchdelegate.backends.onnxruntime.onnx_export import quiet_exporter  # lowering only, not at load

    with quiet_exporter():
        return onnx_registry()


class OnnxRuntimePartitioner(CapabilityPartitioner):
    """Claims the ops torch's ONNX exporter can translate: the capability partitioner over
    :meth:`operator_support`.

    The exporter's own registry decides (no hard-coded list); partitions with fewer than
    ``min_partition_size`` computations are left to later partitioners, since each
    delegate call costs a session run. A subclass narrows what it claims by overriding
    :meth:`operator_support`.
    """

    def __init__(self, compile_specs: list[CompileSpec] | None = None, *, min_partition_size: int = 1) -> None:
        require("onnxruntime")
        spec = DelegationSpec(BACKEND_ID, list(compile_specs or []))
        super().__init__(self.operator_support, spec, min_partition_size=min_partition_size)

    def ops_to_not_decompose(
        self, exported_program: ExportedProgram
    ) -> tuple[list[OpOverload], Callable[[Node], bool] | None]:
        """torchao's quantization ops and the linear layers they feed, where ``MatMulNBits`` runs
        the layer (``blockwise.py``): decomposed, they would become float arithmetic."""
        ops = affine_ops()
        if ops is None:
            return [], None
        kept = []
        if any(runs_on_kernel(layer) for layer in quantized_linears(exported_program)):
            kept.append(torch.ops.aten.linear.default)
        if any(lookup_runs_on_kernel(lookup) for lookup in quantized_embeddings(exported_program)):
            kept.append(torch.ops.aten.embedding.default)
        return ([*ops, *kept], _in_layer_on_kernel) if kept else ([], None)

    def operator_support(self, node: Node) -> bool | str:
        """True if the exporter translates this node's op, every value it makes is a tensor, and
        every tensor it reads or makes has a dtype that ONNX Runtime's CPU provider and numpy
        share, or if it is part of a quantized linear layer or embedding ONNX Runtime's integer kernels
        run; otherwise why not."""
        if isinstance(node.target, torch._ops.OpOverload) and _in_layer_on_kernel(node):
            return True
        if not isinstance(node.target, torch._ops.OpOverload) or not _onnx_registry().is_registered(node.target):
            return f"torch.onnx has no translation for {node.target}"
        if node.target in _TRANSLATIONS_REFUSED:
            return f"torch.onnx's translation of {node.target} makes a model ONNX Runtime refuses"
        not_tensor = non_tensor_value(node)
        if not_tensor is not None:
            return not_tensor
        for v in values_made(node):
            if isinstance(v, torch.Tensor) and v.dtype in _UNSUPPORTED_DTYPES:
                return f"makes {v.dtype}, which the CPU provider does not run"
        converts = node.target is torch.ops.aten._to_copy.default
        for source in node.all_input_nodes:
            v = source.meta.get("val")
            if isinstance(v, torch.Tensor) and v.dtype in _UNSUPPORTED_DTYPES:
                if converts and v.dtype == torch.bfloat16 and is_state_placeholder(source):
                    continue  # a bfloat16 weight read as stored (a named data's bytes), converted here
                return f"reads {v.dtype} ({source.name}), which the CPU provider does not run"
        return True


def _in_layer_on_kernel(node: Node) -> bool:
    """Whether ``node`` is part of a quantized linear layer ``MatMulNBits`` runs or of a quantized
    embedding ``GatherBlockQuantized`` runs: read from the node's own graph, so it answers for the
    nodes decomposition makes as for the program's own."""
    layer = layer_of(node)
    if layer is not None:
        return runs_on_kernel(layer)
    lookup = embedding_of(node)
    return lookup is not None and lookup_runs_on_kernel(lookup)
