"""Structural copies of programs: new graphs and nodes, the same tensors.

A partitioner tags ``node.meta``; lowering rewrites graphs. Both work on a structural copy
so the caller's program is never touched, while weights are shared, never copied.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import ExportGraphSignature
from torch.fx import GraphModule


def fetch_attr(module: torch.nn.Module, target: str) -> Any:
    """The attribute a ``get_attr`` node names (a dotted path)."""
    value: Any = module
    for atom in target.split("."):
        value = getattr(value, atom)
    return value


def copy_graph_module(gm: GraphModule) -> GraphModule:
    """A new GraphModule with copied nodes (shallow-copied meta) and shared attributes.

    Sub-GraphModules reached by ``get_attr`` (control-flow branches and bodies) are copied
    the same way, recursively; tensors and other attributes are shared.
    """
    graph = torch.fx.Graph()
    graph._codegen = gm.graph._codegen
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    attrs: dict[str, Any] = {}
    for node in gm.graph.nodes:
        env[node] = graph.node_copy(node, env.__getitem__)
        if node.op == "get_attr" and node.target not in attrs:
            value = fetch_attr(gm, node.target)
            attrs[node.target] = copy_graph_module(value) if isinstance(value, GraphModule) else value
    new = GraphModule(attrs, graph, class_name=type(gm).__name__)
    new.meta.update(gm.meta)
    return new


def copy_signature(signature: ExportGraphSignature) -> ExportGraphSignature:
    return ExportGraphSignature(
        input_specs=[copy.copy(s) for s in signature.input_specs],
        output_specs=[copy.copy(s) for s in signature.output_specs],
    )


def copy_program(program: ExportedProgram) -> ExportedProgram:
    """A structural copy of ``program``: its graphs copied, its tensors shared."""
    gm = copy_graph_module(program.graph_module)
    return ExportedProgram(
        root=gm,
        graph=gm.graph,
        graph_signature=copy_signature(program.graph_signature),
        state_dict=dict(program.state_dict),
        range_constraints=dict(program.range_constraints),
        module_call_graph=copy.deepcopy(program.module_call_graph),
        example_inputs=program.example_inputs,
        constants=dict(program.constants),
        verifiers=list(program.verifiers),
    )
