"""Looking at a lowered program: its delegates, what was left undelegated, and a printable summary.

Every function here takes a lowered program in any of its three forms: an
``ExportedProgram``, its ``GraphModule``, or an :class:`~torchdelegate.EdgeProgramManager`
(then every method, in the manager's order). Graphs are walked in node order; the sub-graphs
of a control-flow op (``cond`` branches, ``while_loop`` and ``map`` bodies) are walked where
that op stands, so a sub-graph's delegates and nodes come at its op. The order is therefore
the graph's own, the same on every run. Nothing is changed.

A *computation* is a ``call_function`` node other than a delegate call and other than a
tuple item (a ``getitem`` reading one value of a computation's tuple, which goes wherever
that computation goes): the unit the rest of the package counts in.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, TextIO

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind
from torch.fx import Graph, GraphModule, Node

from torchdelegate.delegate.lowered_module import LoweredBackendModule, call_delegate
from torchdelegate.exported.structural_copy import fetch_attr
from torchdelegate.lowering.edge_program_manager import EdgeProgramManager
from torchdelegate.partition.contract import is_tuple_item
from torchdelegate.partition.plan import op_name

Lowered = ExportedProgram | GraphModule | EdgeProgramManager
"""What the helpers of this module look at."""


@dataclass(frozen=True)
class LoweredSubmodule:
    """One delegate call in a lowered graph: where it is, its call node, and its module."""

    method: str | None
    """The method, when looking at a manager; None for a program or a graph module."""
    graph: str
    """The control-flow sub-graph holding the call, as a dotted attribute path from the method's
    graph module (``"true_graph_0"``, ``"while_loop_body_graph_0.true_graph_0"``); ``""`` for the
    method's own graph."""
    name: str
    """The attribute of that graph module holding the module (``"lowered_module_0"``)."""
    call: Node
    """The ``call_delegate`` node; the ``getitem`` nodes among its users read its outputs."""
    module: LoweredBackendModule

    @property
    def qualified_name(self) -> str:
        """The module's name from the method's graph module (``"true_graph_0.lowered_module_0"``)."""
        return f"{self.graph}.{self.name}" if self.graph else self.name

    @property
    def processed_bytes(self) -> bytes:
        """The delegate's payload: the blob its backend's ``preprocess`` returned."""
        return self.module.processed_bytes


def _method_graphs(lowered: Lowered, helper: str) -> list[tuple[str | None, GraphModule]]:
    if isinstance(lowered, EdgeProgramManager):
        return [(method, lowered.exported_program(method).graph_module) for method in lowered.methods]
    if isinstance(lowered, ExportedProgram):
        return [(None, lowered.graph_module)]
    if isinstance(lowered, GraphModule):
        return [(None, lowered)]
    hint = (
        "; a loaded Program has no lowered modules: its delegates are Program.delegates"
        if type(lowered).__name__ == "Program"
        else ""
    )
    raise TypeError(
        f"{helper} takes an ExportedProgram, a GraphModule or an EdgeProgramManager, got {type(lowered).__name__}{hint}"
    )


def _sub_graphs(gm: GraphModule, node: Node) -> list[tuple[str, GraphModule]]:
    """The sub-graphs a control-flow op of ``gm`` runs, in argument order: (attribute, graph module)."""
    if node.op != "call_function" or node.target is call_delegate:
        return []
    found: dict[str, GraphModule] = {}
    for source in node.all_input_nodes:
        if source.op == "get_attr":
            value = fetch_attr(gm, str(source.target))
            if isinstance(value, GraphModule):
                found.setdefault(str(source.target), value)
    return list(found.items())


def _walk(gm: GraphModule, path: str, sub_graphs: bool) -> Iterator[tuple[str, Node]]:
    """Every node of ``gm`` with its sub-graph's path, in order, each control-flow op followed by its sub-graphs'."""
    for node in gm.graph.nodes:
        yield path, node
        if sub_graphs:
            for attribute, child in _sub_graphs(gm, node):
                yield from _walk(child, f"{path}.{attribute}" if path else attribute, sub_graphs)


def is_computation(node: Node) -> bool:
    """A ``call_function`` node that computes: not a delegate call, not a tuple item."""
    return node.op == "call_function" and node.target is not call_delegate and not is_tuple_item(node)


def delegate_calls(graph: Graph | GraphModule | ExportedProgram) -> list[Node]:
    """The ``call_delegate`` nodes of one graph, in order (its control-flow sub-graphs are not searched)."""
    if isinstance(graph, (ExportedProgram, GraphModule)):
        graph = graph.graph
    if not isinstance(graph, Graph):
        raise TypeError(
            f"delegate_calls takes a Graph, a GraphModule or an ExportedProgram, got {type(graph).__name__}"
        )
    return [node for node in graph.nodes if node.op == "call_function" and node.target is call_delegate]


def lowered_module_of(call: Node) -> LoweredBackendModule:
    """The delegate a ``call_delegate`` node runs (its payload is ``.processed_bytes``)."""
    attribute, owner = _delegate_attribute(call), call.graph.owning_module
    module = fetch_attr(owner, attribute) if attribute is not None and owner is not None else None
    if not isinstance(module, LoweredBackendModule):
        raise ValueError(
            f"node {call.name!r} ({call.op} {op_name(call)}) is not a delegate call of a graph module; "
            "pass a node from delegate_calls(graph) or lowered_submodules(program)"
        )
    return module


def _delegate_attribute(call: Node) -> str | None:
    """The attribute (``lowered_module_0``) a delegate call reads its module from; None if not a delegate call."""
    source = call.args[0] if call.target is call_delegate and call.args else None
    return str(source.target) if isinstance(source, Node) and source.op == "get_attr" else None


def lowered_submodules(lowered: Lowered, *, sub_graphs: bool = True) -> list[LoweredSubmodule]:
    """Every delegate call of a lowered program: its place, call node and module, in graph order.

    With ``sub_graphs`` (the default) the calls inside control-flow sub-graphs are included,
    at their op. Delegates nested in another delegate's sub-program are that delegate's own
    business and are not listed (look at ``module.original_module``).
    """
    found = []
    for method, root in _method_graphs(lowered, "lowered_submodules"):
        for path, node in _walk(root, "", sub_graphs):
            if node.op == "call_function" and node.target is call_delegate:
                module = lowered_module_of(node)
                found.append(LoweredSubmodule(method, path, str(_delegate_attribute(node)), node, module))
    return found


def lowered_modules(lowered: Lowered) -> list[LoweredBackendModule]:
    """The delegates of a lowered program, control-flow sub-graphs included, each once, in graph order."""
    unique: dict[LoweredBackendModule, None] = {}
    for submodule in lowered_submodules(lowered):
        unique.setdefault(submodule.module, None)
    return list(unique)


def undelegated_nodes(lowered: Lowered, *, sub_graphs: bool = True) -> list[Node]:
    """The computations a lowered program still runs itself (outside every delegate), in graph order.

    Control-flow ops left in the graph are listed, then (with ``sub_graphs``) the
    computations of their sub-graphs. For a manager, every method's, in the manager's order
    (``node.graph`` tells them apart).
    """
    return [
        node
        for _, root in _method_graphs(lowered, "undelegated_nodes")
        for _, node in _walk(root, "", sub_graphs)
        if is_computation(node)
    ]


def _delegated_computations(module: LoweredBackendModule) -> Iterator[Node]:
    """The computations a delegate took: its sub-program's, nested delegates' included."""
    for _, node in _walk(module.original_module.graph_module, "", True):
        if node.op == "call_function" and node.target is call_delegate:
            yield from _delegated_computations(lowered_module_of(node))
        elif is_computation(node):
            yield node


@dataclass(frozen=True)
class OperatorDelegation:
    """How many computations of one operator were delegated and how many were not."""

    op: str
    delegated: int = 0
    not_delegated: int = 0


@dataclass(frozen=True)
class DelegationInfo:
    """What a lowering delegated, counted in computations (see the module's docstring)."""

    delegates: int
    """Delegate calls, control-flow sub-graphs included."""
    delegated_nodes: int
    """Computations inside delegates (their sub-programs, nested delegates included)."""
    undelegated_nodes: int
    """Computations the program still runs itself."""
    by_operator: dict[str, OperatorDelegation]
    """Per operator (``aten.addmm.default``, ``cond``), sorted by name."""

    def summary(self) -> str:
        """A few lines: delegates, and computations delegated and not."""
        total = self.delegated_nodes + self.undelegated_nodes
        share = f" ({100 * self.delegated_nodes / total:.1f}%)" if total else ""
        return (
            f"delegates: {self.delegates}\n"
            f"computations delegated: {self.delegated_nodes} of {total}{share}\n"
            f"computations not delegated: {self.undelegated_nodes}\n"
        )

    def operator_table(self) -> str:
        """One row per operator, delegated and not, then the totals."""
        rows = [(row.op, str(row.delegated), str(row.not_delegated)) for row in self.by_operator.values()]
        rows.append(("total", str(self.delegated_nodes), str(self.undelegated_nodes)))
        header = ("operator", "delegated", "not delegated")
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(3)]
        lines = [
            f"{op:<{widths[0]}}  {delegated:>{widths[1]}}  {not_delegated:>{widths[2]}}"
            for op, delegated, not_delegated in [header, *rows]
        ]
        return "\n".join(lines) + "\n"


def delegation_info(lowered: Lowered) -> DelegationInfo:
    """Delegates and delegated/undelegated computations of a lowered program, in total and per operator.

    For a manager, its methods together (call it on ``manager.exported_program(method)`` for one).
    """
    submodules = lowered_submodules(lowered)
    delegated: dict[str, int] = {}
    for submodule in submodules:
        for node in _delegated_computations(submodule.module):
            delegated[op_name(node)] = delegated.get(op_name(node), 0) + 1
    kept: dict[str, int] = {}
    for node in undelegated_nodes(lowered):
        kept[op_name(node)] = kept.get(op_name(node), 0) + 1
    by_operator = {
        op: OperatorDelegation(op, delegated.get(op, 0), kept.get(op, 0)) for op in sorted(delegated.keys() | kept)
    }
    return DelegationInfo(len(submodules), sum(delegated.values()), sum(kept.values()), by_operator)


def format_delegated_graph(lowered: Lowered) -> str:
    """A readable text form of a lowered program: each graph's nodes in order, every delegate's
    backend, partition and sub-program under its call, and control-flow sub-graphs under their op."""
    lines: list[str] = []
    for method, root in _method_graphs(lowered, "format_delegated_graph"):
        if isinstance(lowered, EdgeProgramManager) and method is not None:
            lines.append(f"method {method!r}:")
            _format_graph(root, _input_kinds(lowered.exported_program(method)), 1, lines)
        else:
            kinds = _input_kinds(lowered) if isinstance(lowered, ExportedProgram) else {}
            _format_graph(root, kinds, 0, lines)
    return "\n".join(lines) + "\n"


def print_delegated_graph(lowered: Lowered, file: TextIO | None = None) -> None:
    """Print :func:`format_delegated_graph` (to ``file``, else standard output)."""
    print(format_delegated_graph(lowered), end="", file=file if file is not None else sys.stdout)


_INDENT = "    "


def _input_kinds(program: ExportedProgram) -> dict[str, str]:
    """Placeholder name -> how it is fed: ``parameter 'l1.weight'``, ``buffer 'cache'``, ``input``."""
    kinds = {}
    for spec in program.graph_signature.input_specs:
        name = getattr(spec.arg, "name", None)
        if name is None:
            continue
        kind = "input" if spec.kind == InputKind.USER_INPUT else spec.kind.name.lower().replace("_", " ")
        kinds[name] = kind if spec.target is None else f"{kind} {spec.target!r}"
    return kinds


def _format_graph(gm: GraphModule, kinds: dict[str, str], depth: int, lines: list[str]) -> None:
    indent = _INDENT * depth
    for node in gm.graph.nodes:
        lines.append(indent + _format_node(node, kinds))
        if node.op == "call_function" and node.target is call_delegate:
            _format_delegate(lowered_module_of(node), str(_delegate_attribute(node)), depth + 1, lines)
        for attribute, child in _sub_graphs(gm, node):
            lines.append(f"{indent}{_INDENT}{attribute}:")
            _format_graph(child, {}, depth + 2, lines)


def _format_delegate(module: LoweredBackendModule, attribute: str, depth: int, lines: list[str]) -> None:
    indent = _INDENT * depth
    specs = ", ".join(f"{spec.key}={spec.value!r}" for spec in module.compile_specs) or "none"
    where = ""
    if "tag" in module.meta:
        where = f", partition {module.meta['tag']!r}" + (
            f" of method {module.meta['method']!r}" if "method" in module.meta else ""
        )
    lines.append(
        f"{indent}{attribute}: backend {module.backend_id!r}{where}, blob {len(module.processed_bytes)} bytes, "
        f"compile specs: {specs}"
    )
    lines.append(f"{indent}sub-program:")
    program = module.original_module
    _format_graph(program.graph_module, _input_kinds(program), depth + 1, lines)


def _format_node(node: Node, kinds: dict[str, str]) -> str:
    if node.op == "placeholder":
        return f"{node.name} = {kinds.get(node.name, 'input')}"
    if node.op == "get_attr":
        return f"{node.name} = get_attr {node.target}"
    if node.op == "output":
        return f"return {_format_argument(node.args[0] if len(node.args) == 1 else node.args)}"
    arguments = [_format_argument(a) for a in node.args]
    arguments += [f"{key}={_format_argument(value)}" for key, value in node.kwargs.items()]
    target = "call_delegate" if node.target is call_delegate else op_name(node)
    return f"{node.name} = {target}({', '.join(arguments)})"


def _format_argument(value: Any) -> str:
    if isinstance(value, Node):
        return value.name
    if isinstance(value, tuple):
        inner = ", ".join(_format_argument(v) for v in value)
        return f"({inner},)" if len(value) == 1 else f"({inner})"
    if isinstance(value, list):
        return f"[{', '.join(_format_argument(v) for v in value)}]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {_format_argument(v)}" for k, v in value.items()) + "}"
    if isinstance(value, torch.dtype):
        return str(value)
    return repr(value)
