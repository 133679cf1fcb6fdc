"""The check that a partitioner only tagged the graph, and the switch that skips it."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.fx import GraphModule, Node

from torchdelegate.lowering.structural_copy import fetch_attr

_state = threading.local()
_disabled_globally = False


@contextlib.contextmanager
def validation_disabled() -> Iterator[None]:
    """Within this block (in this thread), lowering does not check partitioners' graphs."""
    previous = getattr(_state, "disabled", False)
    _state.disabled = True
    try:
        yield
    finally:
        _state.disabled = previous


def disable_validation() -> None:
    """Stop checking partitioners' graphs, for the rest of the process."""
    global _disabled_globally
    _disabled_globally = True


def validation_enabled() -> bool:
    return not (_disabled_globally or getattr(_state, "disabled", False))


def _shape(value: Any) -> Any:
    """An argument with nodes replaced by their names, for comparison."""
    return torch.fx.node.map_aggregate(value, lambda v: ("node", v.name) if isinstance(v, Node) else v)


def _describe(node: Node) -> str:
    return f"{node.op} {node.name!r} ({node.target})"


def first_graph_difference(original: GraphModule, tagged: GraphModule, where: str = "graph") -> str | None:
    """The first structural difference between two graphs (and their sub-graphs), or None."""
    old_nodes = list(original.graph.nodes)
    new_nodes = list(tagged.graph.nodes)
    for old, new in zip(old_nodes, new_nodes, strict=False):
        if (old.op, old.name, old.target) != (new.op, new.name, new.target):
            if new.name not in {n.name for n in old_nodes}:
                return f"{where}: node {_describe(new)} was added before {old.name!r}"
            if old.name not in {n.name for n in new_nodes}:
                return f"{where}: node {_describe(old)} was removed"
            return f"{where}: node {_describe(old)} became {_describe(new)}"
        if _shape(old.args) != _shape(new.args) or _shape(old.kwargs) != _shape(new.kwargs):
            return f"{where}: the arguments of node {old.name!r} changed"
        if old.op == "get_attr":
            old_value, new_value = fetch_attr(original, old.target), fetch_attr(tagged, new.target)
            if isinstance(old_value, GraphModule) and isinstance(new_value, GraphModule):
                found = first_graph_difference(old_value, new_value, f"{where}.{old.target}")
                if found:
                    return found
            elif isinstance(old_value, torch.Tensor) != isinstance(new_value, torch.Tensor):
                return f"{where}: attribute {old.target!r} changed type"
    if len(old_nodes) != len(new_nodes):
        extra = new_nodes[len(old_nodes) :] or old_nodes[len(new_nodes) :]
        verb = "added" if len(new_nodes) > len(old_nodes) else "removed"
        return f"{where}: node {_describe(extra[0])} was {verb}"
    return None


def program_fingerprint(program: ExportedProgram) -> tuple[Any, ...]:
    """Everything about a program's structure that a backend could change in place.

    Compared before and after ``preprocess``: the graphs (all sub-graphs too), the signature,
    and which tensors the program holds. fx keeps arguments in immutable containers, so
    holding them is a snapshot. Cost is linear in nodes; no tensor data is read.
    """
    nodes = tuple(
        (node, node.op, node.name, node.target, node.args, node.kwargs)
        for gm in program.graph_module.modules()
        if isinstance(gm, GraphModule)
        for node in gm.graph.nodes
    )
    state = tuple((k, id(v)) for k, v in (*program.state_dict.items(), *program.constants.items()))
    return nodes, str(program.graph_signature), state
