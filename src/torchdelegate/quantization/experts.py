"""The weights of a mixture of experts, which the recipes leave in float, found so that quantizing
says so instead of leaving it to be discovered in the file's size.

A mixture-of-experts layer keeps its experts' weights as one 3-D parameter per projection
(``[experts, outputs, inputs]``), and the exported graph gathers the rows of the experts each token
chose (``aten.index.Tensor``) before a batched product (``aten.bmm``), or multiplies the stack as a
whole. Those are not linear layers, so no recipe rewrites them.
"""

from __future__ import annotations

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind

_READS = (torch.ops.aten.index.Tensor, torch.ops.aten.bmm.default, torch.ops.aten.matmul.default)


def expert_stacks(program: ExportedProgram) -> list[str]:
    """The names of ``program``'s float parameters of three dimensions that its graph gathers rows of
    or multiplies as a batch (the experts of a mixture), sorted."""
    parameters = {
        spec.arg.name: spec.target
        for spec in program.graph_signature.input_specs
        if spec.kind == InputKind.PARAMETER and spec.target is not None
    }
    found = set()
    for node in program.graph.nodes:
        target = parameters.get(node.name) if node.op == "placeholder" else None
        value = program.state_dict.get(target) if target is not None else None
        if not isinstance(value, torch.Tensor) or value.dim() != 3 or not value.dtype.is_floating_point:
            continue
        if any(user.target in _READS and user.args and user.args[0] is node for user in node.users):
            found.add(target)
    return sorted(t for t in found if t is not None)


def float_experts_note(programs: dict[str, ExportedProgram], recipe: str) -> str | None:
    """What to tell the user when ``programs`` keep expert stacks in float after quantizing by
    ``recipe``; None when they have none."""
    stacks = sorted({name for program in programs.values() for name in expert_stacks(program)})
    if not stacks:
        return None
    shown = ", ".join(stacks[:2]) + (f" and {len(stacks) - 2} more" if len(stacks) > 2 else "")
    return (
        f"quantized with {recipe}: the experts' weights are left in float ({len(stacks)} "
        f"{'stack' if len(stacks) == 1 else 'stacks'}: {shown}); "
        "the recipes quantize linear layers and embedding tables, and a mixture of experts keeps its experts "
        "as 3-D stacks"
    )
