"""Reports the HTML picture is tested and shown on: a zoo model with three backends, and the 200M LLM.

Only planned, never compiled: a report needs the partitioner's plan, not the backends' blobs.
"""

from __future__ import annotations

import gc

import torch

import torchdelegate as td
from torchdelegate import CapabilityPartitioner, DelegationSpec
from torchdelegate.partition.capability import why_unsupported
from torchdelegate.report import LoweringReport, plan_report

aten = torch.ops.aten
LEFT_OUT_FOR_THE_PICTURE = {aten.index.Tensor, aten.any.dim}


def swin_three_backends() -> LoweringReport:
    """A transformers Swin: matrix products on ONNX Runtime, norms and softmax on the reference
    backend, the rest on Inductor but two ops no backend is given (planned only, nothing compiled)."""
    from zoo.models import swin

    from torchdelegate.partition.proposed import backend_supports

    case = swin()
    call = case.example("forward")
    program = torch.export.export(case.modules["forward"], call.args, dict(call.kwargs), strict=case.strict)
    [(inductor, inductor_spec)] = backend_supports(["inductor"])

    def inductor_but_two(node: torch.fx.Node) -> bool | str:
        if node.target in LEFT_OUT_FOR_THE_PICTURE:
            return "left out of this test's plan"
        return why_unsupported(inductor, node) or True

    partitioner = CapabilityPartitioner(
        [
            (
                {aten.addmm.default, aten.mm.default, aten.bmm.default, aten.convolution.default},
                DelegationSpec("onnxruntime"),
            ),
            ({aten.native_layer_norm.default, aten._softmax.default, aten.gelu.default}, DelegationSpec("reference")),
            (inductor_but_two, inductor_spec),
        ]
    )
    return plan_report(td.to_edge(program), partitioner)


def llm_200m() -> LoweringReport:
    """benchmarks/llm.py's 200M Llama, prefill and decode, planned for ONNX Runtime then the reference backend.

    Its weights are allocated but never written (the report reads shapes, not values)."""
    import llm_side
    from transformers import LlamaForCausalLM

    from torchdelegate.backends.onnxruntime import OnnxRuntimePartitioner
    from torchdelegate.backends.reference import ReferencePartitioner
    from torchdelegate.lowering.edge_program_manager import edge_keeping

    with torch.device("meta"):
        model = LlamaForCausalLM(llm_side.llama_config("base")).eval()
    module = llm_side.static_cache_module(model.to_empty(device="cpu"))
    programs = llm_side.export(module, strict=True)
    partitioners = [OnnxRuntimePartitioner(), ReferencePartitioner()]
    edge, _ = edge_keeping(programs, partitioners)
    report = plan_report(edge, CapabilityPartitioner([*partitioners[0].backends, *partitioners[1].backends]))
    del edge, programs, module, model
    gc.collect()
    return report
