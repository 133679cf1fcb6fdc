"""Splicing: rebuild a graph with each partition replaced by a call to its delegate.

One pass over the fused order copies every remaining node and emits, for each partition,
``lowered_module_N`` (``get_attr``), one ``call_delegate`` node, and one ``getitem`` per
output. A ``getitem`` takes the name and meta of the node whose value it now carries, so
the printed graph reads like the original and the signature keeps its names.

Each new ``call_delegate`` node gets a ``meta["debug_handle"]``, as ExecuTorch gives its
delegate calls one: the number after the largest the program holds. ExecuTorch takes the
largest of the graph that stays (the partition's nodes gone, the delegates already spliced
counted), one partition at a time; here it is the largest of the whole program before lowering
(the delegated nodes and control-flow sub-graphs included) and of the delegate calls kept from
earlier lowerings, so a delegate call never shares a number with a computation, in its delegate
or elsewhere. The program's graph is numbered once all its sub-graphs are spliced: its delegate
calls in graph order, then its sub-graphs' by attribute name.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Collection, Mapping
from typing import Any

import torch
from torch.export.graph_signature import ExportGraphSignature
from torch.fx import GraphModule, Node

from torchdelegate.delegate.lowered_module import LoweredBackendModule, call_delegate
from torchdelegate.exported.debug_handles import DEBUG_HANDLE, number_after
from torchdelegate.exported.structural_copy import copy_meta, copy_node, fetch_attr, graph_like, keep_name
from torchdelegate.lowering.partitions import GraphPartitions, Partition

LOWERED_MODULE_PREFIX = "lowered_module_"


def next_delegate_index(found: GraphPartitions) -> int:
    """The first ``lowered_module_N`` index after the delegates the graph keeps from earlier lowerings."""
    taken = []
    for step in found.order:
        if isinstance(step, Node) and step.op == "get_attr" and step not in found.dropped:
            suffix = str(step.target).removeprefix(LOWERED_MODULE_PREFIX)
            if suffix != str(step.target) and suffix.isdigit():
                taken.append(int(suffix))
    return max(taken, default=-1) + 1


def splice(
    gm: GraphModule,
    found: GraphPartitions,
    delegates: Mapping[Partition, LoweredBackendModule],
    submodules: Mapping[str, GraphModule],
    reserved: Collection[str] = (),
) -> tuple[torch.fx.Graph, dict[str, Any], dict[str, str]]:
    """``gm``'s graph rebuilt with its partitions replaced by delegate calls.

    ``submodules`` replaces sub-graphs that were lowered themselves. No delegate is attached
    under a name in ``reserved`` (the roots of the program's state names: unlifting the
    program puts its parameters and buffers there). Returns the new graph, the attributes it
    reads, and the renaming of every kept value (old name to new name).
    """
    graph = graph_like(gm)
    env: dict[Node, Node] = {}
    attrs: dict[str, Any] = {}
    index = next_delegate_index(found)
    for step in found.order:
        if isinstance(step, Partition):
            while f"{LOWERED_MODULE_PREFIX}{index}" in reserved:
                index += 1
            name = f"{LOWERED_MODULE_PREFIX}{index}"
            index += 1
            attrs[name] = delegates[step]
            _emit_delegate(graph, name, step, env)
            continue
        node = step
        if node in found.dropped:
            continue
        if node.op == "output":
            _emit_output(graph, node, env, found.owned_outputs)
            continue
        copy_node(graph, node, env)
        if node.op == "get_attr":
            target = str(node.target)
            attrs[target] = submodules[target] if target in submodules else fetch_attr(gm, target)
    if found.top_level:
        _number_delegate_calls(gm, graph, attrs)
    return graph, attrs, {old.name: new.name for old, new in env.items()}


def _number_delegate_calls(gm: GraphModule, graph: torch.fx.Graph, attrs: Mapping[str, Any]) -> None:
    """Number the delegate calls without a debug handle in the program's new graph and its sub-graphs,
    after every handle of the program as it was (``gm``) and as it is."""
    spliced = [graph]
    for _, value in sorted(attrs.items()):
        if isinstance(value, GraphModule):
            spliced += [m.graph for _, m in sorted(value.named_modules()) if isinstance(m, GraphModule)]
    calls = [
        node
        for each in spliced
        for node in each.nodes
        if node.target is call_delegate and not isinstance(node.meta.get(DEBUG_HANDLE), int)
    ]
    if calls:
        original = [m.graph for _, m in gm.named_modules() if isinstance(m, GraphModule)]
        number_after(calls, [*original, *spliced])


def _emit_delegate(graph: torch.fx.Graph, name: str, partition: Partition, env: dict[Node, Node]) -> None:
    module_node = graph.get_attr(name)
    args = (module_node, *(env[n] for n in partition.inputs))
    call = graph.create_node("call_function", call_delegate, args, name="call_delegate")
    call.meta["val"] = tuple(n.meta.get("val") for n in partition.outputs)
    call.meta["delegate"] = name
    for i, produced in enumerate(partition.outputs):
        item = graph.create_node("call_function", operator.getitem, (call, i))
        keep_name(graph, item, produced.name)
        copy_meta(produced, item)
        env[produced] = item


def _emit_output(graph: torch.fx.Graph, node: Node, env: Mapping[Node, Node], owned: set[int]) -> None:
    values = node.args[0]
    if isinstance(values, (list, tuple)):
        kept = [v for i, v in enumerate(values) if i not in owned]
        values = type(values)(kept) if isinstance(values, tuple) else kept
    mapped = torch.fx.node.map_arg(values, env.__getitem__)
    output = graph.output(mapped)
    copy_meta(node, output)


def rename_signature(
    signature: ExportGraphSignature, renamed: Mapping[str, str], dropped: set[str], owned: set[int]
) -> ExportGraphSignature:
    """The owner's signature after splicing: dropped inputs and owned mutations removed."""

    def renamed_spec(spec: Any) -> Any:
        name = getattr(spec.arg, "name", None)
        if name is None or name not in renamed or renamed[name] == name:
            return spec
        return dataclasses.replace(spec, arg=dataclasses.replace(spec.arg, name=renamed[name]))

    inputs = [renamed_spec(s) for s in signature.input_specs if getattr(s.arg, "name", None) not in dropped]
    outputs = [renamed_spec(s) for i, s in enumerate(signature.output_specs) if i not in owned]
    return ExportGraphSignature(input_specs=inputs, output_specs=outputs)


def dropped_targets(found: GraphPartitions) -> list[str]:
    """FQNs of the state the owner gives up entirely (no user of it remains)."""
    return sorted(
        str(found.input_specs[n.name].target)
        for n in found.dropped
        if n.op == "placeholder" and n.name in found.input_specs
    )
