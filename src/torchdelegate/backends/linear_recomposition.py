"""Linear layers regained from their core-ATen decomposition, for backends that fuse them.

Decomposition turns ``linear(x, w, b)`` on a batch of sequences into ``view`` (to two
dimensions), ``addmm(b, ·, permute(w))`` and ``view`` back. An exporter translates that
literally (a reshape, a GEMM, a reshape), and pattern-based fusions downstream (attention,
bias + activation) no longer recognise the layer. :func:`recompose_linear` returns a copy
of a partition with each such chain as one ``aten.linear`` again; the caller's program is
not touched and its tensors are shared.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.export import ExportedProgram
from torch.fx import Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

from torchdelegate.exported.debug_handles import stand_for
from torchdelegate.exported.structural_copy import copy_graph, program_around

_aten = torch.ops.aten


def recompose_linear(program: ExportedProgram) -> ExportedProgram:
    """A copy of ``program`` in which every decomposed linear layer is one ``aten.linear``."""
    graph, attrs = copy_graph(program.graph_module)
    changed = False
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target in (_aten.addmm.default, _aten.mm.default):
            changed |= _recompose(graph, node)
    if not changed:
        return program
    graph.eliminate_dead_code()
    graph.lint()
    return program_around(program, graph, attrs)


def _recompose(graph: torch.fx.Graph, product: Node) -> bool:
    """Replace the linear layer ending at ``product`` (an addmm or mm); whether there was one."""
    if product.kwargs:
        return False  # addmm's beta / alpha
    args: tuple[Any, ...] = (None, *product.args) if product.target is _aten.mm.default else tuple(product.args)
    bias, flat, transposed = args
    permute = _node(transposed, _aten.permute.default)
    if permute is None or list(permute.args[1]) not in ([1, 0], [-1, -2]):  # type: ignore[arg-type]
        return False
    weight = permute.args[0]
    source: Any = flat
    output = product
    flattening = _node(flat, _aten.view.default)
    if flattening is not None and len(product.users) == 1:
        restoring = _node(next(iter(product.users)), _aten.view.default)
        if restoring is not None:
            source, output = flattening.args[0], restoring
    if not _is_linear_shape(source, weight, output):
        return False
    # The last node of the chain becomes the linear: its name, users and place in the signature stay.
    stand_for(output, [n for n in (flattening, product, permute) if n is not None and n is not output])
    output.target = _aten.linear.default
    output.args = (source, weight) if bias is None else (source, weight, bias)
    output.kwargs = {}
    return True


def _node(value: Any, target: Any) -> Node | None:
    """``value`` if it is a call of ``target``."""
    if isinstance(value, Node) and value.op == "call_function" and value.target is target:
        return value
    return None


def _is_linear_shape(source: Any, weight: Any, output: Node) -> bool:
    """Whether ``output`` has the shape ``linear(source, weight)`` has: source's leading dims, weight's rows."""
    values = [getattr(n, "meta", {}).get("val") for n in (source, weight, output)]
    if not all(isinstance(v, torch.Tensor) for v in values):
        return False
    x, w, y = (v for v in values if isinstance(v, torch.Tensor))
    if w.dim() != 2 or x.dim() < 1 or y.dim() != x.dim():
        return False
    expected = (*x.shape[:-1], w.shape[0])
    sizes = [*zip(y.shape, expected, strict=True), (x.shape[-1], w.shape[1])]
    return all(statically_known_true(a == b) for a, b in sizes)
