"""A delegate as a saved graph calls it: the operator
``torchdelegate::call_delegate(int index, Tensor[] tensors, SymInt[] sizes) -> Tensor[]``.

In memory a delegate is a ``get_attr`` of a :class:`LoweredBackendModule` and a
``call_delegate`` node. In a file it is one call of the operator of the same name, whose
``index`` points into the file's delegate table; the table says in which order the tensors
and sizes reach the backend. Any torch can then read the graph with its own deserializer; the
operator itself only raises (a loaded program binds each call to its delegate). Files written
before the operator took this name call it ``torchdelegate::delegate_call``: that name is read,
never written.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch._ops import OpOverload
from torch.export import ExportedProgram
from torch.fx import GraphModule, Node

from torchdelegate.delegate.lowered_module import LoweredBackendModule, call_delegate
from torchdelegate.errors import SerializationError
from torchdelegate.exported.structural_copy import copy_node, fetch_attr, graph_like, keep_name, program_around
from torchdelegate.serialize.call_plan import SIZE, TENSOR

_SCHEMA = "(int index, Tensor[] tensors, SymInt[] sizes) -> Tensor[]"
_NAME, _NAME_BEFORE_RENAME = "call_delegate", "delegate_call"
_library = torch.library.Library("torchdelegate", "DEF")


def _define(name: str) -> OpOverload:
    def not_callable(index: int, tensors: list[torch.Tensor], sizes: list[int]) -> list[torch.Tensor]:
        raise RuntimeError(
            f"torchdelegate::{name}({index}) is a placeholder in saved graphs; load the file with "
            "torchdelegate.load() to run its delegates"
        )

    _library.define(name + _SCHEMA)
    _library.impl(name, not_callable, "CompositeExplicitAutograd")
    op: OpOverload = getattr(torch.ops.torchdelegate, name).default
    torch.fx.node.has_side_effect(op)
    return op


saved_call_delegate = _define(_NAME)
SAVED_CALL_DELEGATE_OPS = frozenset({saved_call_delegate, _define(_NAME_BEFORE_RENAME)})


@dataclass(frozen=True)
class DelegateCall:
    """One delegate as a saved graph calls it: its module and the kinds of its inputs, in order."""

    module: LoweredBackendModule
    input_kinds: str
    output_count: int


def serializable_program(
    program: ExportedProgram, delegate_index: Callable[[LoweredBackendModule], int]
) -> tuple[ExportedProgram, list[DelegateCall]]:
    """``program`` with its delegates as saved ``call_delegate(index, ...)`` nodes (program unchanged).

    ``delegate_index`` gives each delegate its index in the file; the calls are returned in
    the order met (sub-graphs of control flow at their parent's node).
    """
    calls: list[DelegateCall] = []
    graph, attrs = _rewrite_graph(program.graph_module, delegate_index, calls)
    rewritten = program_around(program, graph, attrs)
    return rewritten, calls


def _rewrite_graph(
    gm: GraphModule, delegate_index: Callable[[LoweredBackendModule], int], calls: list[DelegateCall]
) -> tuple[torch.fx.Graph, dict[str, Any]]:
    graph = graph_like(gm)
    env: dict[Node, Node] = {}
    attrs: dict[str, Any] = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value = fetch_attr(gm, node.target)
            if isinstance(value, LoweredBackendModule):
                continue
            if isinstance(value, GraphModule):
                sub_graph, sub_attrs = _rewrite_graph(value, delegate_index, calls)
                value = GraphModule(sub_attrs, sub_graph, class_name=type(value).__name__)
            attrs[node.target] = value
        if node.op == "call_function" and node.target is call_delegate:
            env[node] = _saved_call_node(graph, node, fetch_attr(gm, node.args[0].target), env, delegate_index, calls)
            continue
        copy_node(graph, node, env, keep_tag=True)
    return graph, attrs


def _saved_call_node(
    graph: torch.fx.Graph,
    node: Node,
    module: LoweredBackendModule,
    env: Mapping[Node, Node],
    delegate_index: Callable[[LoweredBackendModule], int],
    calls: list[DelegateCall],
) -> Node:
    tensors: list[Node] = []
    sizes: list[Node] = []
    kinds = []
    for argument in node.args[1:]:
        value = argument.meta.get("val") if isinstance(argument, Node) else argument
        if isinstance(argument, Node) and isinstance(value, torch.Tensor):
            tensors.append(env[argument])
            kinds.append(TENSOR)
        elif isinstance(argument, Node) and isinstance(value, (int, torch.SymInt)) and not isinstance(value, bool):
            sizes.append(env[argument])
            kinds.append(SIZE)
        else:
            raise SerializationError(
                f"delegate {module.name!r} on {module.backend_id!r} takes {argument!r} "
                f"({type(value).__name__}); a saved delegate can take only tensors and integer sizes"
            )
    outputs = node.meta.get("val") or ()
    if any(not isinstance(v, torch.Tensor) for v in outputs):
        raise SerializationError(
            f"delegate {module.name!r} on {module.backend_id!r} returns a non-tensor value; "
            "a saved delegate can return only tensors"
        )
    call = graph.call_function(saved_call_delegate, (delegate_index(module), tensors, sizes))
    keep_name(graph, call, node.name)
    call.meta = {k: v for k, v in node.meta.items() if k != "delegate"}
    call.meta["val"] = list(outputs)
    calls.append(DelegateCall(module, "".join(kinds), len(outputs)))
    return call


def saved_call_nodes(gm: GraphModule) -> Iterator[tuple[GraphModule, Node]]:
    """Every saved ``call_delegate`` node of ``gm`` and of its sub-graphs, with the module it is in."""
    for module in gm.modules():
        if isinstance(module, GraphModule):
            for node in module.graph.nodes:
                if node.op == "call_function" and node.target in SAVED_CALL_DELEGATE_OPS:
                    yield module, node
