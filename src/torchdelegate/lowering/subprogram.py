"""Building a partition's sub-program: an ExportedProgram of its own, sharing the owner's tensors."""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.export import ExportedProgram
from torch.export.exported_program import ModuleCallEntry, ModuleCallSignature
from torch.export.graph_signature import (
    ExportGraphSignature,
    InputKind,
    InputSpec,
    OutputKind,
    OutputSpec,
    SymBoolArgument,
    SymFloatArgument,
    SymIntArgument,
    TensorArgument,
)
from torch.fx import GraphModule, Node

from torchdelegate.exported.programs import DELEGATION_TAG, build_program, output_values
from torchdelegate.exported.structural_copy import MutableStateCopies, copy_meta, copy_node, fetch_attr, keep_name
from torchdelegate.lowering.partitions import GraphPartitions, Partition


def graph_argument(name: str, value: Any) -> TensorArgument | SymIntArgument | SymFloatArgument | SymBoolArgument:
    """The signature argument for a value named ``name`` whose ``meta["val"]`` is ``value``."""
    if isinstance(value, torch.SymInt):
        return SymIntArgument(name=name)
    if isinstance(value, torch.SymFloat):
        return SymFloatArgument(name=name)
    if isinstance(value, torch.SymBool):
        return SymBoolArgument(name=name)
    return TensorArgument(name=name)


def calling_specs(n_inputs: int, n_outputs: int) -> ModuleCallEntry:
    """The root module-call entry for flat positional inputs and a flat tuple of outputs."""
    in_spec = pytree.tree_flatten((tuple(range(n_inputs)), {}))[1]
    out_spec = pytree.tree_flatten(tuple(range(n_outputs)))[1]
    return ModuleCallEntry(fqn="", signature=ModuleCallSignature([], [], in_spec, out_spec))


def build_subprogram(
    owner: GraphModule,
    partition: Partition,
    found: GraphPartitions,
    program: ExportedProgram,
    output_specs: list[OutputSpec] | None,
    state_copies: MutableStateCopies,
) -> ExportedProgram:
    """The partition as an ExportedProgram: its state inside, its inputs as user inputs.

    ``program`` is the top-level program the graph belongs to (for its tensors, range
    constraints and verifiers); ``output_specs`` are the owner graph's (``None`` for a
    control-flow sub-graph). Buffers whose mutation the partition owns get private copies.
    """
    graph = torch.fx.Graph()
    env: dict[Node, Node] = {}
    input_specs: list[InputSpec] = []
    state_dict: dict[str, Any] = {}
    constants: dict[str, Any] = {}
    owned = {output_specs[i].target for i in partition.mutations} if output_specs else set()
    for node in partition.state:
        spec = found.input_specs[node.name]
        env[node] = placeholder = graph.placeholder(node.name)
        keep_name(graph, placeholder, node.name)
        copy_meta(node, placeholder)
        input_specs.append(spec)  # same placeholder name: the owner's names are unique
        assert spec.target is not None
        persistent = spec.kind == InputKind.PARAMETER or (spec.kind == InputKind.BUFFER and spec.persistent)
        value = (program.state_dict if persistent else program.constants)[spec.target]
        if spec.target in owned:
            value = state_copies(value)
        (state_dict if persistent else constants)[spec.target] = value
    for node in partition.inputs:
        env[node] = placeholder = graph.placeholder(node.name)
        keep_name(graph, placeholder, node.name)
        copy_meta(node, placeholder)
        value = node.meta.get("val")
        input_specs.append(InputSpec(InputKind.USER_INPUT, graph_argument(placeholder.name, value), None))
    attrs: dict[str, Any] = {}
    for node in (*partition.attrs, *(n for n in partition.nodes if n.op == "get_attr")):
        attrs[str(node.target)] = fetch_attr(owner, str(node.target))
    for node in partition.attrs:
        copy_node(graph, node, env)
    for value in attrs.values():
        if isinstance(value, GraphModule):  # a control-flow op delegated whole: its tags are spent
            for module in value.modules():
                if isinstance(module, GraphModule):
                    for inner in module.graph.nodes:
                        inner.meta.pop(DELEGATION_TAG, None)
    for node in partition.nodes:
        copy_node(graph, node, env)

    values: list[Node] = []
    out_specs: list[OutputSpec] = []
    if partition.mutations:
        assert output_specs is not None
        owner_outputs = output_values(next(reversed(owner.graph.nodes)))
        for i in partition.mutations:
            produced = env[owner_outputs[i]]
            values.append(produced)
            out_specs.append(
                OutputSpec(OutputKind.BUFFER_MUTATION, TensorArgument(produced.name), output_specs[i].target)
            )
    for node in partition.outputs:
        values.append(env[node])
        out_specs.append(OutputSpec(OutputKind.USER_OUTPUT, graph_argument(env[node].name, node.meta.get("val")), None))
    graph.output(tuple(values))

    return build_program(
        program,
        attrs,
        graph,
        ExportGraphSignature(input_specs, out_specs),
        state_dict,
        constants,
        range_constraints=_range_constraints(graph, program.range_constraints),
        module_call_graph=[calling_specs(len(partition.inputs), len(partition.outputs))],
        example_inputs=False,
    )


def _range_constraints(graph: torch.fx.Graph, constraints: dict[Any, Any]) -> dict[Any, Any]:
    """The owner's range constraints on the symbols this graph's values use."""
    if not constraints:
        return {}
    symbols: set[Any] = set()
    for node in graph.nodes:
        for value in pytree.tree_leaves(node.meta.get("val")):
            sizes = value.shape if isinstance(value, torch.Tensor) else (value,)
            for size in sizes:
                if isinstance(size, (torch.SymInt, torch.SymFloat, torch.SymBool)):
                    symbols |= size.node.expr.free_symbols
    return {symbol: bounds for symbol, bounds in constraints.items() if symbol in symbols}
