"""torch.export programs as lowering makes them: the one place an ``ExportedProgram`` is built,
which of a program's inputs are its state and their values, what a graph returns, and the metadata key a
partitioner tags nodes with.

Every program lowering makes (a structural copy, a sub-program, a lowered method, a program
with its tensors or names replaced) goes through :func:`build_program`, so each one is checked
by torch's own verifier and takes what it does not replace from the program it derives from.
"""

from __future__ import annotations

import operator
from typing import Any

from torch.export import ExportedProgram
from torch.export.graph_signature import ExportGraphSignature, InputKind
from torch.fx import Graph, GraphModule, Node

TENSOR_STATE_KINDS = (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR)
"""The inputs that carry a program's tensors (named by their spec's ``target``) rather than the caller's."""
STATE_KINDS = (*TENSOR_STATE_KINDS, InputKind.CUSTOM_OBJ)
"""Every input a program carries itself: its tensors and its script objects."""
DELEGATION_TAG = "delegation_tag"
"""The node metadata key under which a partitioner names a node's partition."""


def state_value(program: ExportedProgram, fqn: str) -> Any:
    """A parameter, buffer or constant of ``program`` by its fully qualified name."""
    return program.state_dict[fqn] if fqn in program.state_dict else program.constants[fqn]


def output_values(output: Node) -> list[Any]:
    """The flat list of values an output node returns."""
    values = output.args[0]
    return list(values) if isinstance(values, (list, tuple)) else [values]


def build_program(
    like: ExportedProgram,
    root: GraphModule | dict[str, Any],
    graph: Graph,
    graph_signature: ExportGraphSignature,
    state_dict: dict[str, Any],
    constants: dict[str, Any],
    *,
    range_constraints: dict[Any, Any] | None = None,
    module_call_graph: list[Any] | None = None,
    example_inputs: bool = True,
    with_meta: bool = False,
) -> ExportedProgram:
    """A program of ``graph`` over ``root`` (a graph module, or the attributes its ``get_attr``
    nodes read, so that the graph is compiled once), verified by torch.

    ``like`` gives the verifiers and whatever is not passed: range constraints, module call graph,
    example inputs (unless ``example_inputs`` is False: a sub-program's inputs are not the owner's),
    and with ``with_meta`` its graph module's meta.
    """
    program = ExportedProgram(
        root=root,
        graph=graph,
        graph_signature=graph_signature,
        state_dict=state_dict,
        range_constraints=like.range_constraints if range_constraints is None else range_constraints,
        module_call_graph=like.module_call_graph if module_call_graph is None else module_call_graph,
        example_inputs=like.example_inputs if example_inputs else None,
        constants=constants,
        verifiers=list(like.verifiers),
    )
    if with_meta:
        program.graph_module.meta.update(like.graph_module.meta)
    return program


def is_tuple_item(node: Node) -> bool:
    """A ``getitem`` reading one value of a computation's tuple: it goes wherever that computation
    goes, so a tuple never crosses a delegate's boundary (the one home of this rule)."""
    return node.target is operator.getitem and isinstance(node.args[0], Node) and node.args[0].op == "call_function"
