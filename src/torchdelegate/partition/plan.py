"""What a partitioner decided for one program, as data: each computation's partition, or why not.

A capability partitioner makes its plan before it tags, and returns it with its result
(``PartitionResult.plan``), each backend's reason for every node it left included. Any other
partitioner only tags: lowering reads the plan from its tags (:func:`plan_from_tags`), and a
node left out then has one reason, that the partitioner did not tag it. Lowering's report is
made from this plan, so a partitioner runs once.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch.export import ExportedProgram
from torch.fx import Node

from torchdelegate.delegate.specs import DelegationSpec
from torchdelegate.exported.programs import DELEGATION_TAG, is_tuple_item


@dataclass(frozen=True)
class NodeDecision:
    """Where one computation went: a backend and tag, or nowhere; and each backend's answer."""

    node: str
    op: str
    backend_id: str | None
    tag: str | None
    reasons: dict[str, str] = field(default_factory=dict)  # backend id -> why it did not take the node


@dataclass(frozen=True)
class PlannedPartition:
    tag: str
    backend_id: str
    nodes: list[str]  # graph order; tuple items (getitem) included
    kept_apart: dict[str, str] = field(default_factory=dict)  # tag of a partition it touches -> a node between


@dataclass(frozen=True)
class PartitionPlan:
    """The decisions of a partitioner for one program, as data."""

    decisions: list[NodeDecision]  # one per computation, in graph order
    partitions: list[PlannedPartition]  # in order of their first node

    def delegated(self) -> int:
        return sum(d.tag is not None for d in self.decisions)

    def by_node(self) -> dict[str, NodeDecision]:
        return {d.node: d for d in self.decisions}

    def matches_tags(self, program: ExportedProgram) -> bool:
        """Whether ``program``'s computations carry exactly the tags this plan gives them."""
        planned = {name: p.tag for p in self.partitions for name in p.nodes}
        return all(
            node.meta.get(DELEGATION_TAG) == planned.get(node.name)
            for node in program.graph.nodes
            if node.op == "call_function"
        )


def op_name(node: Node) -> str:
    """How reports name a node's operator: ``aten.addmm.default``, ``cond``, ``getitem``."""
    target = node.target
    return str(target) if isinstance(target, torch._ops.OpOverload) else getattr(target, "__name__", str(target))


def plan_from_tags(
    program: ExportedProgram, partition_tags: Mapping[str, DelegationSpec], partitioner: str, backends: list[str]
) -> PartitionPlan:
    """The plan a partitioner's tags on ``program`` describe. A computation left untagged has, for each
    of ``backends``, the reason that ``partitioner`` (its class name) did not tag it."""
    members: dict[str, list[str]] = {}
    decisions = []
    left = dict.fromkeys(backends, f"not tagged by {partitioner}")
    for node in program.graph.nodes:
        if node.op != "call_function":
            continue
        if is_tuple_item(node):  # it goes wherever the node that made the tuple goes
            producer = node.args[0].meta.get(DELEGATION_TAG)  # type: ignore[union-attr]
            if producer is not None and producer in partition_tags:
                members.setdefault(producer, []).append(node.name)
            continue
        tag = node.meta.get(DELEGATION_TAG)
        if tag is not None and tag in partition_tags:
            members.setdefault(tag, []).append(node.name)
        spec = partition_tags.get(tag) if tag is not None else None
        backend = spec.backend_id if spec is not None else None
        decisions.append(
            NodeDecision(node.name, op_name(node), backend, tag if backend else None, {} if backend else left)
        )
    partitions = [PlannedPartition(tag, partition_tags[tag].backend_id, nodes) for tag, nodes in members.items()]
    return PartitionPlan(decisions, partitions)
