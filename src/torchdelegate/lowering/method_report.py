"""A method's report built from what lowering saw: its program, the partitioner's plan, the boundaries.

For every computation, its backend or the reasons each backend gave, its FLOPs and module calls;
for every partition, its ops, inputs and outputs, the bytes of the weights that move into it and
the FLOPs it computes. Lowering takes what it reads of the caller's program
(:class:`ReportedProgram`) and each partition's :class:`Boundary` as it goes, so that a report
made later (``lowering_report.DeferredReport``) keeps no tensor alive; the program is only read.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Mapping
from dataclasses import dataclass

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind
from torch.fx import Node

from torchdelegate.exported.debug_handles import DEBUG_HANDLE
from torchdelegate.exported.programs import TENSOR_STATE_KINDS, state_value
from torchdelegate.lowering.flop_count import node_flops
from torchdelegate.lowering.partitions import Partition
from torchdelegate.lowering.report_data import MethodReport, NodeRow, PartitionRow, short_op
from torchdelegate.partition.contract import is_tuple_item
from torchdelegate.partition.modules import module_calls
from torchdelegate.partition.plan import PartitionPlan


@dataclass(frozen=True)
class Boundary:
    """A partition's boundary as lowering found it, by name: what it reads from outside (values and
    sub-graphs), what it gives back, and the state it carries inside."""

    reads: frozenset[str]
    outputs: list[str]
    state: list[str]

    @classmethod
    def of(cls, partition: Partition) -> Boundary:
        reads = frozenset(n.name for n in [*partition.inputs, *partition.attrs])
        return cls(reads, [n.name for n in partition.outputs], [n.name for n in partition.state])


@dataclass(frozen=True)
class ReportedProgram:
    """What a method's report reads of its program: the graph (names, shapes and module calls, no
    tensors), the user inputs and the bytes of each weight. Lowering takes it from the program it
    was given, so that a report made later does not keep the caller's tensors alive."""

    graph: torch.fx.Graph
    user_inputs: frozenset[str]
    weights: Mapping[str, int]  # placeholder name -> bytes

    @classmethod
    def of(cls, program: ExportedProgram) -> ReportedProgram:
        return cls(program.graph, frozenset(_user_inputs(program)), _weight_bytes(program))


def method_report(
    method: str, program: ExportedProgram | ReportedProgram, plan: PartitionPlan, found: Mapping[str, Boundary]
) -> MethodReport:
    """The report of ``program`` partitioned as ``plan`` says, with each partition's boundary as
    lowering found it (``found``: tag -> boundary); the program is only read."""
    reported = program if isinstance(program, ReportedProgram) else ReportedProgram.of(program)
    graph_nodes = {node.name: node for node in reported.graph.nodes}
    user_inputs = reported.user_inputs
    rows: list[NodeRow] = []
    module_types: dict[str, str] = {}
    for decision in plan.decisions:
        node = graph_nodes[decision.node]
        inputs = [n.name for n in _sources(node) if n.op == "call_function" or n.name in user_inputs]
        calls = module_calls(node)
        module_types.update((call.name, call.type_name) for call in calls)
        rows.append(
            NodeRow(
                decision.node,
                decision.op,
                decision.backend_id,
                decision.tag,
                decision.reasons,
                node_flops(node),
                inputs,
                [call.name for call in calls],
                handle if isinstance(handle := node.meta.get(DEBUG_HANDLE), int) else None,
            )
        )
    flops = {row.name: row.flops for row in rows}
    weights = reported.weights
    partitions = []
    for planned in plan.partitions:
        members = [graph_nodes[name] for name in planned.nodes]
        computations = [n for n in members if not is_tuple_item(n)]
        boundary = found[planned.tag]
        partitions.append(
            PartitionRow(
                tag=planned.tag,
                backend_id=planned.backend_id,
                nodes=len(computations),
                ops=dict(Counter(short_op(str(n.target)) for n in computations)),
                inputs=_in_first_use_order(members, boundary.reads),
                outputs=list(boundary.outputs),
                weight_bytes=sum(weights.get(name, 0) for name in boundary.state),
                flops=sum(flops.get(n.name, 0) for n in computations),
                kept_apart=dict(planned.kept_apart),
            )
        )
    outputs = [n.name for n in _sources(reported.graph.output_node())]
    ordered_inputs = sorted(user_inputs, key=list(graph_nodes).index)
    return MethodReport(method, rows, partitions, ordered_inputs, outputs, module_types)


def _in_first_use_order(members: list[Node], names: Collection[str]) -> list[str]:
    """``names`` in the order ``members`` first read them."""
    read = dict.fromkeys(source.name for node in members for source in node.all_input_nodes)
    return [name for name in read if name in names]


def _sources(node: Node) -> list[Node]:
    """The nodes ``node`` reads, looking through tuple items to the node that made the tuple."""
    found: dict[Node, None] = {}
    for source in node.all_input_nodes:
        found[source.args[0] if is_tuple_item(source) and isinstance(source.args[0], Node) else source] = None
    return list(found)


def _user_inputs(program: ExportedProgram) -> set[str]:
    return {spec.arg.name for spec in program.graph_signature.input_specs if spec.kind == InputKind.USER_INPUT}


def _weight_bytes(program: ExportedProgram) -> dict[str, int]:
    """Placeholder name -> bytes, for parameters and constants (not buffers a method updates)."""
    mutated = set(program.graph_signature.buffers_to_mutate.values())
    found = {}
    for spec in program.graph_signature.input_specs:
        if spec.kind in TENSOR_STATE_KINDS and spec.target is not None and spec.target not in mutated:
            value = state_value(program, spec.target)
            if isinstance(value, torch.Tensor):
                found[spec.arg.name] = value.numel() * value.element_size()
    return found
