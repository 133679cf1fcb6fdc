"""Metadata checks that export already proved, dropped before partitioning.

Decomposition leaves ``aten._assert_tensor_metadata`` nodes (a ``.to(dtype)`` that changes
nothing, say) that check a tensor's dtype, device, layout and sizes when the graph runs. No
backend runs them, so a check left in the residual graph makes the delegate that computes
its tensor return it only to be checked: a copy and a Python call per run. When the traced
value the check reads already has the metadata it asks for (static sizes and strides
included), the check cannot fail for any input the program accepts, and it is dropped.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.export import ExportedProgram
from torch.fx import GraphModule, Node

_CHECK = torch.ops.aten._assert_tensor_metadata.default


def drop_proven_checks(program: ExportedProgram) -> int:
    """Erase from ``program`` (a program of the caller's own making) every metadata check its
    traced values prove, in every graph (control-flow sub-graphs too); how many were erased."""
    erased = 0
    for module in program.graph_module.modules():
        if not isinstance(module, GraphModule):
            continue
        proven = [n for n in module.graph.nodes if n.op == "call_function" and n.target is _CHECK and _proven(n)]
        for node in proven:
            module.graph.erase_node(node)
        if proven:
            module.recompile()
            erased += len(proven)
    return erased


def _proven(check: Node) -> bool:
    if check.users:
        return False
    arguments = dict(zip(("a", "size", "stride", "dtype"), check.args, strict=False)) | dict(check.kwargs)
    source = arguments.get("a")
    value = source.meta.get("val") if isinstance(source, Node) else None
    if not isinstance(value, torch.Tensor):
        return False
    return (
        _same(arguments.get("dtype"), value.dtype)
        and _same(arguments.get("device"), value.device)
        and _same(arguments.get("layout"), value.layout)
        and _same_sizes(arguments.get("size"), value.shape)
        and _same_sizes(arguments.get("stride"), value.stride())
    )


def _same(asked: Any, traced: Any) -> bool:
    return asked is None or asked == traced


def _same_sizes(asked: Any, traced: Any) -> bool:
    """Sizes (or strides) asked for equal the traced ones, every one a static integer."""
    if asked is None:
        return True
    return (
        isinstance(asked, (list, tuple))
        and len(asked) == len(traced)
        and all(type(a) is int and type(t) is int and a == t for a, t in zip(asked, traced, strict=True))
    )
