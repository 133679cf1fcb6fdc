"""Graph-structure equality: do two graphs (or programs) compute the same thing the same way?

Two graphs have the same structure when their nodes, taken in graph order, pair up: the
same kind (placeholder, call, attribute, output), the same target (the same operator), and
arguments wired the same way — a node argument must name the node at the same position in
the other graph, and every other argument (ints, floats, dtypes, lists, None) must be equal
and of the same type. Node names are ignored unless ``node_names=True``, since passes and
re-exports rename freely. What ``get_attr`` nodes read is compared by value: control-flow
sub-graphs recursively, tensor constants by dtype, shape and elements, delegates by backend
id, compile specs and the structure of their sub-programs (not blob bytes, which a backend
may stamp). For programs, the signatures must agree too (each input's and output's kind and
target, in order), tensor constants by value, parameters and buffers by dtype and shape
(their values are data, not structure). For managers, the same methods in the same order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind
from torch.fx import Graph, GraphModule, Node

from torchdelegate.delegate.lowered_module import LoweredBackendModule
from torchdelegate.exported.programs import TENSOR_STATE_KINDS, state_value
from torchdelegate.exported.structural_copy import fetch_attr
from torchdelegate.lowering.edge_program_manager import EdgeProgramManager

Structured = Graph | GraphModule | ExportedProgram | EdgeProgramManager


def same_graph_structure(left: Structured, right: Structured, *, node_names: bool = False) -> bool:
    """Whether ``left`` and ``right`` have the same structure (see the module's docstring)."""
    return graph_structure_difference(left, right, node_names=node_names) is None


def graph_structure_difference(left: Structured, right: Structured, *, node_names: bool = False) -> str | None:
    """The first structural difference between ``left`` and ``right``, in words; None if there is none."""
    for value in (left, right):
        if not isinstance(value, (Graph, GraphModule, ExportedProgram, EdgeProgramManager)):
            raise TypeError(
                "same_graph_structure compares Graphs, GraphModules, ExportedPrograms or EdgeProgramManagers, "
                f"got {type(value).__name__}"
            )
    if isinstance(left, EdgeProgramManager) and isinstance(right, EdgeProgramManager):
        return _managers(left, right, node_names)
    if isinstance(left, ExportedProgram) and isinstance(right, ExportedProgram):
        return _programs(left, right, node_names, "the program")
    if isinstance(left, GraphModule) and isinstance(right, GraphModule):
        return _graphs(left.graph, right.graph, left, right, node_names, "the graph")
    if isinstance(left, Graph) and isinstance(right, Graph):
        return _graphs(left, right, left.owning_module, right.owning_module, node_names, "the graph")
    return f"{_kind(left)} on the left, {_kind(right)} on the right"


def _managers(left: EdgeProgramManager, right: EdgeProgramManager, node_names: bool) -> str | None:
    if left.methods != right.methods:
        return f"the methods are {left.methods} on the left, {right.methods} on the right"
    for method in left.methods:
        found = _programs(
            left.exported_program(method), right.exported_program(method), node_names, f"method {method!r}"
        )
        if found:
            return found
    return None


def _programs(left: ExportedProgram, right: ExportedProgram, node_names: bool, where: str) -> str | None:
    ours, theirs = left.graph_signature, right.graph_signature
    found = _signature_specs("input", ours.input_specs, theirs.input_specs, where) or _signature_specs(
        "output", ours.output_specs, theirs.output_specs, where
    )
    if found:
        return found
    for spec in ours.input_specs:
        if spec.kind in TENSOR_STATE_KINDS and spec.target is not None:
            compare_elements = spec.kind == InputKind.CONSTANT_TENSOR
            found = _values(state_value(left, spec.target), state_value(right, spec.target), compare_elements)
            if found:
                return f"{where}: {spec.kind.name.lower()} {spec.target!r}: {found}"
    return _graphs(left.graph, right.graph, left.graph_module, right.graph_module, node_names, where)


def _signature_specs(what: str, ours: Sequence[Any], theirs: Sequence[Any], where: str) -> str | None:
    """How two signatures' input (or output) specs differ in number, kind or target."""
    if len(ours) != len(theirs):
        return f"{where}: {len(ours)} {what}s on the left, {len(theirs)} on the right"
    for index, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        if (a.kind, a.target) != (b.kind, b.target):
            return (
                f"{where}: {what} {index} is {a.kind.name.lower()} {a.target!r} on the left, "
                f"{b.kind.name.lower()} {b.target!r} on the right"
            )
    return None


def _graphs(left: Graph, right: Graph, left_module: Any, right_module: Any, node_names: bool, where: str) -> str | None:
    ours, theirs = list(left.nodes), list(right.nodes)
    position = {node: index for index, node in enumerate(ours)}
    position.update({node: index for index, node in enumerate(theirs)})
    for index, (a, b) in enumerate(zip(ours, theirs, strict=False)):
        at = f"{where}: node {index}"
        if a.op != b.op or (a.op in ("call_function", "call_method", "call_module") and a.target != b.target):
            return f"{at} is {_describe(a)} on the left, {_describe(b)} on the right"
        if node_names and a.name != b.name:
            return f"{at} is named {a.name!r} on the left, {b.name!r} on the right"
        wiring = _arguments((a.args, a.kwargs), position), _arguments((b.args, b.kwargs), position)
        if wiring[0] != wiring[1]:
            shown = f"{_show(wiring[0])} on the left, {_show(wiring[1])} on the right"
            return f"{at} ({_describe(a)}): its arguments differ: {shown}"
        if a.op == "get_attr":
            found = _attributes(
                fetch_attr(left_module, str(a.target)),
                fetch_attr(right_module, str(b.target)),
                node_names,
                f"{at} ({a.target})",
            )
            if found:
                return found
    if len(ours) != len(theirs):
        extra = (theirs if len(theirs) > len(ours) else ours)[min(len(ours), len(theirs))]
        side = "right" if len(theirs) > len(ours) else "left"
        counts = f"{len(ours)} nodes on the left, {len(theirs)} on the right"
        return f"{where}: {counts} (the {side} goes on with {_describe(extra)})"
    return None


def _attributes(left: Any, right: Any, node_names: bool, where: str) -> str | None:
    if type(left) is not type(right) and not (isinstance(left, GraphModule) and isinstance(right, GraphModule)):
        return f"{where}: a {type(left).__name__} on the left, a {type(right).__name__} on the right"
    if isinstance(left, GraphModule):
        return _graphs(left.graph, right.graph, left, right, node_names, f"{where}, sub-graph")
    if isinstance(left, LoweredBackendModule):
        if (left.backend_id, left.compile_specs) != (right.backend_id, right.compile_specs):
            return (
                f"{where}: a delegate for {left.backend_id!r} {_specs(left)} on the left, "
                f"for {right.backend_id!r} {_specs(right)} on the right"
            )
        return _programs(left.original_module, right.original_module, node_names, f"{where}, sub-program")
    if isinstance(left, torch.Tensor):
        found = _values(left, right, compare_elements=True)
        return f"{where}: {found}" if found else None
    return None if left == right else f"{where}: {left!r} on the left, {right!r} on the right"


def _values(left: Any, right: Any, compare_elements: bool) -> str | None:
    """How two state values differ: type, dtype and shape, and elements if asked."""
    if not (isinstance(left, torch.Tensor) and isinstance(right, torch.Tensor)):
        return None if type(left) is type(right) else f"{_kind(left)} on the left, {_kind(right)} on the right"
    if (left.dtype, left.shape) != (right.dtype, right.shape):
        return f"{left.dtype}{list(left.shape)} on the left, {right.dtype}{list(right.shape)} on the right"
    if compare_elements and not torch.equal(left.detach(), right.detach()):
        return "its elements differ"
    return None


def _arguments(value: Any, position: Mapping[Node, int]) -> Any:
    """Arguments with each node replaced by its position, and literals tagged with their type."""
    if isinstance(value, Node):
        return ("node", position[value])
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_arguments(v, position) for v in value))
    if isinstance(value, dict):
        return (
            "dict",
            tuple((k, _arguments(v, position)) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))),
        )
    return (type(value).__name__, value)


def _show(wiring: Any) -> str:
    """Arguments as compared, for a message: node positions as ``%3``."""
    kind, value = wiring
    if kind == "node":
        return f"%{value}"
    if kind in ("tuple", "list"):
        inner = ", ".join(_show(v) for v in value)
        return f"({inner})" if kind == "tuple" else f"[{inner}]"
    if kind == "dict":
        return "{" + ", ".join(f"{k}={_show(v)}" for k, v in value) + "}"
    return repr(value)


def _describe(node: Node) -> str:
    target = node.target if node.op not in ("placeholder", "output") else ""
    return f"{node.op} {target} ({node.name!r})".replace("  ", " ")


def _kind(value: Any) -> str:
    name = type(value).__name__
    return f"an {name}" if name[:1].lower() in "aeiou" else f"a {name}"


def _specs(module: LoweredBackendModule) -> str:
    return "[" + ", ".join(f"{s.key}={s.value!r}" for s in module.compile_specs) + "]"
