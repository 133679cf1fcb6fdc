"""to_edge's decomposition: each method to core ATen, functional, keeping the ops partitioners ask
for whole on the nodes they accept.

A partitioner's ``ops_to_not_decompose`` names ops (:func:`asked_overloads` reads them) and a
node filter; :data:`KeepFilters` gathers every partitioner's answer for a method, and
:func:`any_accepts` makes them one filter. :func:`decompose` keeps those ops as ExecuTorch does
(on every node first, then a second pass for the nodes a filter refused); an error of torch's
decomposition is raised as it is, with a note naming the method.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Iterable
from typing import Any

import torch
from torch._ops import OpOverload
from torch.export import ExportedProgram
from torch.fx import GraphModule, Node
from torch.fx import traceback as fx_traceback

from torchdelegate.exported.structural_copy import with_identifier_state_names, with_state_names
from torchdelegate.exported.torch_warnings import torch_internal_warnings_silenced
from torchdelegate.lowering.metadata_checks import drop_proven_checks
from torchdelegate.partition.contract import overloads_of

NodeFilter = Callable[[Node], bool]
KEEP_WHOLE = "torchdelegate_keep_whole"
"""Set in the meta of a node (of a private copy) that decomposition must leave whole."""


def decompose(
    method: str, program: ExportedProgram, keep: Collection[OpOverload] = (), node_filter: NodeFilter | None = None
) -> ExportedProgram:
    """Core ATen, functional; the ops in ``keep`` are left whole, on the nodes ``node_filter`` accepts (all if None).

    As ExecuTorch does, the ops are first kept on every node, those that only another op's
    decomposition makes included (an LSTM's ``linear``); then the filter sees the nodes of that
    program, and those it refuses are decomposed by a second pass, which only they need.

    torch decomposes through Python code that reads each parameter and buffer as an attribute,
    which fails for names that are not identifiers (a parameter registered as ``lambda``), so
    such state is decomposed under a stand-in name and gets its own name back. Metadata checks
    the traced values prove are dropped (``metadata_checks``). An error of torch's
    decomposition is raised as it is, with a note naming the method.
    """
    table = torch.export.default_decompositions()
    for op in keep:
        table.pop(op, None)
    program, stand_ins = with_identifier_state_names(program)
    decomposed = _run_decompositions(method, program, table)
    accepted, refused = _filtered(decomposed, set(keep), node_filter) if node_filter is not None else ([], False)
    if refused:
        table = torch.export.default_decompositions()
        for op in keep:
            if op in table:
                table[op] = _unless_kept(table[op])
        for node in accepted:
            node.meta[KEEP_WHOLE] = True  # read while the second pass retraces it; not copied to its nodes
        decomposed = _run_decompositions(method, decomposed, table)
    drop_proven_checks(decomposed)  # a program of our own making: its checks no backend runs
    return with_state_names(decomposed, {v: k for k, v in stand_ins.items()}) if stand_ins else decomposed


def _run_decompositions(method: str, program: ExportedProgram, table: dict[Any, Any]) -> ExportedProgram:
    try:
        with torch_internal_warnings_silenced():
            return program.run_decompositions(table)
    except Exception as error:
        error.add_note(f"method {method!r}: torch's run_decompositions failed on the exported program")
        raise


def _filtered(program: ExportedProgram, ops: set[OpOverload], node_filter: NodeFilter) -> tuple[list[Node], bool]:
    """The nodes of ``ops`` that ``node_filter`` accepts, sub-graphs included; and whether it refused any."""
    accepted, refused = [], False
    for gm in program.graph_module.modules():
        if not isinstance(gm, GraphModule):
            continue
        for node in gm.graph.nodes:
            if node.op == "call_function" and node.target in ops:
                if node_filter(node):
                    accepted.append(node)
                else:
                    refused = True
    return accepted, refused


def _unless_kept(decomposition: Callable[..., Any]) -> Callable[..., Any]:
    """``decomposition``, except on a node marked to keep: there it answers NotImplemented, which keeps the op."""

    def decompose(*args: Any, **kwargs: Any) -> Any:
        if fx_traceback.get_current_meta().get(KEEP_WHOLE):
            return NotImplemented
        return decomposition(*args, **kwargs)

    return decompose


KeepFilters = list[tuple[set[OpOverload], NodeFilter | None]]
"""Each partitioner's ``ops_to_not_decompose``: the ops it asked to keep, and its node filter."""


def wanted_whole(node: Node, filters: KeepFilters) -> bool:
    """Whether a partitioner that asked to keep ``node``'s op whole accepts this node."""
    return any(node.target in ops and (f is None or f(node)) for ops, f in filters)


def any_accepts(filters: KeepFilters) -> NodeFilter | None:
    """:func:`wanted_whole` as a node filter; None when every partitioner keeps all nodes of its ops."""
    if all(f is None for _, f in filters):
        return None
    return functools.partial(wanted_whole, filters=filters)


def asked_overloads(ops: Iterable[Any]) -> list[OpOverload]:
    """The overloads ``ops_to_not_decompose`` named."""
    found: list[OpOverload] = []
    for op in ops:
        overloads = overloads_of(op)
        if overloads is None:
            raise TypeError(f"ops_to_not_decompose returned {op!r}; expected torch ops (e.g. aten.linear.default)")
        found.extend(overloads)
    return found
