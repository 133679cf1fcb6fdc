"""Structural copies of programs: new graphs and nodes, the same tensors.

A partitioner tags ``node.meta``; lowering rewrites graphs. Both work on a structural copy
so the caller's program is never touched, while weights are shared, never copied.
"""

from __future__ import annotations

import copy
import dataclasses
import keyword
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.export.exported_program import ModuleCallEntry
from torch.export.graph_signature import ExportGraphSignature
from torch.fx import GraphModule

from torchdelegate.exported.programs import DELEGATION_TAG, build_program


def fetch_attr(module: torch.nn.Module, target: str) -> Any:
    """The attribute a ``get_attr`` node names (a dotted path)."""
    value: Any = module
    for atom in target.split("."):
        value = getattr(value, atom)
    return value


def copy_meta(source: torch.fx.Node, target: torch.fx.Node) -> None:
    """Give ``target`` a shallow copy of ``source``'s meta, without its delegation tag."""
    meta = dict(source.meta)
    meta.pop(DELEGATION_TAG, None)
    target.meta = meta


def keep_name(graph: torch.fx.Graph, node: torch.fx.Node, name: str) -> None:
    """Give ``node`` exactly ``name``, and keep ``graph`` from giving that name to a new node.

    torch.fx renames a node whose name shadows a builtin or keyword (``input`` becomes
    ``input_1``), but signatures, tags and files refer to nodes by the names export gave them.
    Python code generated from the graph uses names of its own, so any name is safe to keep.
    """
    node.name = name
    graph._graph_namespace._used_names.add(name)


def graph_like(gm: GraphModule) -> torch.fx.Graph:
    """An empty graph with ``gm``'s code generator, in which no new node takes a name of ``gm``'s."""
    graph = torch.fx.Graph()
    graph._codegen = gm.graph._codegen
    graph._graph_namespace._used_names.update(node.name for node in gm.graph.nodes)
    return graph


def copy_node(
    graph: torch.fx.Graph, node: torch.fx.Node, env: dict[torch.fx.Node, torch.fx.Node], *, keep_tag: bool = False
) -> torch.fx.Node:
    """Copy ``node`` into ``graph`` under its own name (arguments mapped through ``env``).

    The copy's meta is a shallow copy of ``node``'s, without the delegation tag unless ``keep_tag``.
    """
    env[node] = new = graph.node_copy(node, env.__getitem__)
    keep_name(graph, new, node.name)
    if not keep_tag:
        new.meta.pop(DELEGATION_TAG, None)
    return new


def copy_graph(gm: GraphModule) -> tuple[torch.fx.Graph, dict[str, Any]]:
    """A copy of ``gm``'s graph (nodes copied, meta shallow-copied) and the attributes it reads.

    Sub-GraphModules reached by ``get_attr`` (control-flow branches and bodies) are copied
    the same way, recursively; tensors and other attributes are shared.
    """
    graph = graph_like(gm)
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    attrs: dict[str, Any] = {}
    for node in gm.graph.nodes:
        copy_node(graph, node, env, keep_tag=True)
        if node.op == "get_attr" and node.target not in attrs:
            value = fetch_attr(gm, node.target)
            attrs[node.target] = copy_graph_module(value) if isinstance(value, GraphModule) else value
    return graph, attrs


def copy_graph_module(gm: GraphModule) -> GraphModule:
    """A structural copy of ``gm``: see :func:`copy_graph`."""
    graph, attrs = copy_graph(gm)
    return make_graph_module(attrs, graph, gm)


def make_graph_module(attrs: dict[str, Any], graph: torch.fx.Graph, like: GraphModule) -> GraphModule:
    """A GraphModule of ``graph`` with ``attrs``, carrying ``like``'s class name and meta."""
    new = GraphModule(attrs, graph, class_name=type(like).__name__)
    new.meta.update(like.meta)
    return new


def copy_module_call_graph(
    entries: list[ModuleCallEntry], renamed: Mapping[str, str] | None = None
) -> list[ModuleCallEntry]:
    """The module call graph with fresh argument objects, renamed by ``renamed``.

    Tree specs are immutable and shared (``copy.deepcopy`` of them is slow and deprecated).
    """
    renamed = renamed or {}

    def argument(value: Any) -> Any:
        new = copy.copy(value)
        name = getattr(value, "name", None)
        if name is not None and name in renamed:
            new.name = renamed[name]
        return new

    copied = []
    for entry in entries:
        signature = entry.signature
        if signature is not None:
            signature = dataclasses.replace(
                signature,
                inputs=[argument(a) for a in signature.inputs],
                outputs=[argument(a) for a in signature.outputs],
            )
        copied.append(ModuleCallEntry(entry.fqn, signature))
    return copied


def copy_signature(signature: ExportGraphSignature) -> ExportGraphSignature:
    return ExportGraphSignature(
        input_specs=[copy.copy(s) for s in signature.input_specs],
        output_specs=[copy.copy(s) for s in signature.output_specs],
    )


def copy_program(program: ExportedProgram) -> ExportedProgram:
    """A structural copy of ``program``: its graphs copied, its tensors shared."""
    graph, attrs = copy_graph(program.graph_module)
    return program_around(program, graph, attrs)


def program_around(program: ExportedProgram, graph: torch.fx.Graph, attrs: dict[str, Any]) -> ExportedProgram:
    """A new program of ``graph`` (reading ``attrs``) with ``program``'s signature, tensors and specs.

    The signature and call graph are copied, the tensors shared.
    """
    # The attributes as root: ExportedProgram compiles the one GraphModule itself.
    return build_program(
        program,
        attrs,
        graph,
        copy_signature(program.graph_signature),
        dict(program.state_dict),
        dict(program.constants),
        range_constraints=dict(program.range_constraints),
        module_call_graph=copy_module_call_graph(program.module_call_graph),
        with_meta=True,
    )


class MutableStateCopies:
    """Private copies of the buffers programs write, one per source tensor.

    Lowering (and ``to_edge``) share weights with the caller's programs, but a buffer that a
    method writes (a KV cache) must not be written into the caller's tensor. Methods that
    share a buffer get the same copy, so they still share its state.
    """

    def __init__(self, enabled: bool = True) -> None:
        self._copies: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.enabled = enabled

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        if not self.enabled:
            return tensor
        entry = self._copies.get(id(tensor))
        if entry is None:
            entry = (tensor, tensor.detach().clone())
            self._copies[id(tensor)] = entry
        return entry[1]


def with_state(program: ExportedProgram, replace: Callable[[str, Any], Any]) -> ExportedProgram:
    """``program`` holding ``replace(fqn, value)`` for each parameter, buffer and constant.

    The same program when nothing is replaced; otherwise a new one around the same graph.
    """
    state_dict = {k: replace(k, v) for k, v in program.state_dict.items()}
    constants = {k: replace(k, v) for k, v in program.constants.items()}
    unchanged = all(state_dict[k] is v for k, v in program.state_dict.items()) and all(
        constants[k] is v for k, v in program.constants.items()
    )
    return program if unchanged else rebuilt(program, state_dict=state_dict, constants=constants)


def rebuilt(
    program: ExportedProgram,
    graph_module: GraphModule | None = None,
    *,
    state_dict: dict[str, Any] | None = None,
    constants: dict[str, Any] | None = None,
    graph_signature: ExportGraphSignature | None = None,
) -> ExportedProgram:
    """``program`` with its graph module, its tensors or its signature replaced, validated again."""
    graph_module = graph_module if graph_module is not None else program.graph_module
    return build_program(
        program,
        graph_module,
        graph_module.graph,
        graph_signature if graph_signature is not None else program.graph_signature,
        state_dict if state_dict is not None else program.state_dict,
        constants if constants is not None else program.constants,
    )


def with_state_names(program: ExportedProgram, renamed: Mapping[str, str]) -> ExportedProgram:
    """``program`` around the same graph and tensors, its state names (FQNs) renamed by ``renamed``."""

    def spec(value: Any) -> Any:
        target = getattr(value, "target", None)
        if isinstance(target, str) and target in renamed:
            return dataclasses.replace(value, target=renamed[target])
        return copy.copy(value)

    signature = ExportGraphSignature(
        input_specs=[spec(s) for s in program.graph_signature.input_specs],
        output_specs=[spec(s) for s in program.graph_signature.output_specs],
    )
    return rebuilt(
        program,
        state_dict={renamed.get(k, k): v for k, v in program.state_dict.items()},
        constants={renamed.get(k, k): v for k, v in program.constants.items()},
        graph_signature=signature,
    )


def with_identifier_state_names(program: ExportedProgram) -> tuple[ExportedProgram, dict[str, str]]:
    """``program`` with a stand-in for each state name torch cannot read as an attribute path, and the renaming.

    torch decomposes and exports through Python code that reads each parameter and buffer as
    an attribute, which fails for a name such as ``block.lambda``; such state goes by a
    stand-in name there and gets its own name back after (:func:`with_state_names`).
    """
    names = [s.target for s in program.graph_signature.input_specs if s.target is not None]
    taken = set(names)
    stand_ins: dict[str, str] = {}
    for name in names:
        if all(atom.isidentifier() and not keyword.iskeyword(atom) for atom in name.split(".")):
            continue
        index = len(stand_ins)
        while f"_torchdelegate_state_{index}" in taken:
            index += 1
        stand_ins[name] = f"_torchdelegate_state_{index}"
        taken.add(stand_ins[name])
    return (with_state_names(program, stand_ins) if stand_ins else program), stand_ins
