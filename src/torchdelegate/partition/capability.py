"""The capability partitioner: nodes to backends by what each backend supports, in priority order.

A backend is described by an *operator support*: a set of ops, or a callable on a node that
answers ``True``/``None`` (supported), ``False`` or a string (not supported, and why, in
the backend's own words: op, dtype, shape). Backends are taken in priority order; each claims
the nodes it supports that no earlier backend took, in as few cycle-free groups as it finds, then
groups smaller than ``min_partition_size`` computations are given back for later backends.

Fusing claimed nodes into one delegate must not create a cycle through a node left outside
(A -> outside -> B with A and B in one partition). Groups are first found with *levels*, over
a graph in which every group of an earlier backend is one block, since it will be one delegate
call. A block's level counts the blocks this backend does not take on the longest path reaching
it; claimed blocks of equal level can share a partition, because levels never decrease along
an edge and rise after an outside block, so a path that leaves a level never comes back to it.
A forward pass gives each block its lowest level; a backward pass then raises each claimed block
as far as its users allow, so that a node feeding only a later group (``permute(weight)``
before an ``addmm`` that follows a size computation) joins that group instead of making one
of its own. Levels are cycle-free but not always as few as can be, so groups are then joined
wherever their union stays cycle-free (``partition/merging.py``), starting once from whole
levels and once from their connected pieces, and the fewer groups win. Two groups that touch
but stay apart are recorded with a node on the path between them, which is what a report
shows as "would have made a cycle". Each backend's pass costs its topological order
(``O((nodes + edges) log nodes)``), linear passes over nodes and edges, and one pass over the
nodes per join.

The shipped partitioners (``ReferencePartitioner``, ``OnnxRuntimePartitioner``,
``InductorPartitioner``) are this partitioner with their backend's support and spec.

:meth:`CapabilityPartitioner.plan` returns the decisions as data (:class:`PartitionPlan`):
for every computation, its partition or the reason it was not delegated by each backend.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind
from torch.fx import Graph, Node

from torchdelegate.delegate.specs import DelegationSpec
from torchdelegate.exported.programs import DELEGATION_TAG
from torchdelegate.partition.components import components
from torchdelegate.partition.contract import Partitioner, PartitionResult, is_tuple_item
from torchdelegate.partition.merging import merge_groups
from torchdelegate.partition.plan import NodeDecision, PartitionPlan, PlannedPartition, op_name
from torchdelegate.partition.tagging import tag_constant_data
from torchdelegate.partition.topological_order import topological_order

SupportAnswer = bool | str | None
OperatorSupport = Collection[object] | Callable[[Node], SupportAnswer]
"""A set of op targets, or ``node -> True/None`` (supported) ``| False | "why not"``."""

UNSUPPORTED = "unsupported"
CLAIMED_EARLIER = "claimed by a higher-priority backend"
TOO_SMALL = "partition smaller than min_partition_size"
CYCLE = "would have made a cycle"


def why_unsupported(support: OperatorSupport, node: Node) -> str | None:
    """None if ``support`` takes ``node``, else why not (in the support's words, or "unsupported: <op>")."""
    if callable(support):
        answer = support(node)
        if answer is True or answer is None:
            return None
        return answer if isinstance(answer, str) and answer else f"{UNSUPPORTED}: {op_name(node)}"
    return None if node.target in support else f"{UNSUPPORTED}: {op_name(node)}"


def values_made(node: Node) -> tuple[object, ...]:
    """The values ``node`` makes, as export traced them: its ``val``, or each item of a tuple or list."""
    value = node.meta.get("val")
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def non_tensor_value(node: Node) -> str | None:
    """Why a backend that takes and returns only tensors cannot run ``node``: a value it makes
    that is not a tensor; None if all are."""
    for made in values_made(node):
        if not isinstance(made, torch.Tensor):
            return f"makes a non-tensor value ({type(made).__name__})"
    return None


class UnitGraph:
    """The graph's computations as blocks: a node with its tuple items, a group of an earlier backend,
    or an *atom* (nodes that must stay together, such as a pattern's match). A block is named by the
    graph position of its first node."""

    def __init__(self, graph: Graph, atoms: Sequence[Sequence[Node]] = ()) -> None:
        self.nodes = list(graph.nodes)
        self.index = {node: i for i, node in enumerate(self.nodes)}
        self.block: dict[Node, int] = {}
        self.members: dict[int, list[Node]] = {}
        self.taken: set[int] = set()  # blocks that are groups of an earlier backend
        for index, node in enumerate(self.nodes):
            head = self.block[node.args[0]] if is_tuple_item(node) else index  # type: ignore[index]
            self.block[node] = head
            self.members.setdefault(head, []).append(node)
        for atom in atoms:
            self.join(sorted({self.block[node] for node in atom}))

    def order(self) -> tuple[list[int], dict[int, list[int]]]:
        """The blocks in a topological order (Kahn, ties in graph order), and each block's successors."""
        successors: dict[int, dict[int, None]] = {u: {} for u in self.members}
        for node in self.nodes:
            target = self.block[node]
            for source in node.all_input_nodes:
                origin = self.block[source]
                if origin != target:
                    successors[origin][target] = None
        order = topological_order(successors)
        return order, {u: list(s) for u, s in successors.items()}

    def join(self, blocks: list[int]) -> int:
        """Make ``blocks`` one block (named by the first); returns it."""
        head = min(blocks)
        for block in blocks:
            if block == head:
                continue
            for node in self.members.pop(block):
                self.block[node] = head
                self.members[head].append(node)
        self.members[head].sort(key=self.index.__getitem__)
        return head

    def merge(self, blocks: list[int]) -> None:
        """Make ``blocks`` one block: a backend's group, which will be one delegate call."""
        self.taken.add(self.join(blocks))


@dataclass(frozen=True)
class AtomCycle:
    """A cycle of a graph whose atoms are contracted: the atoms on it (by index, as the cycle was
    found) and, in the order a path from the first of them takes, the nodes outside every atom that
    it goes through."""

    atoms: list[int]
    through: list[Node]


def atoms_on_a_cycle(graph: Graph, atoms: Sequence[Sequence[Node]]) -> AtomCycle | None:
    """One cycle of ``graph`` with each atom (disjoint node lists) contracted to one block; None if the
    contracted graph is acyclic. An atom two of whose nodes a path outside it joins is a cycle of its own."""
    blocks = UnitGraph(graph, atoms)
    order, successors = blocks.order()
    if len(order) == len(blocks.members):
        return None
    left = set(blocks.members) - set(order)
    predecessors: dict[int, list[int]] = {block: [] for block in left}
    for block in sorted(left):
        for successor in successors[block]:
            if successor in left:
                predecessors[successor].append(block)
    seen: dict[int, int] = {}
    path: list[int] = []
    block = min(left)
    while block not in seen:  # every block left over has a predecessor left over: walk back until one repeats
        seen[block] = len(path)
        path.append(block)
        block = predecessors[block][0]
    atom_of = {node: index for index, atom in enumerate(atoms) for node in atom}
    walked = [blocks.members[head][0] for head in path[seen[block] :]]  # the cycle, walked backwards
    found = list(dict.fromkeys(atom_of[node] for node in walked if node in atom_of))
    forward = walked[::-1]
    start = next(i for i, node in enumerate(forward) if atom_of.get(node) == found[0])  # it holds an atom
    forward = forward[start:] + forward[:start]
    return AtomCycle(found, [node for node in forward if node not in atom_of])


class CapabilityPartitioner(Partitioner):
    """Partitions by operator support, for one backend or several in priority order.

    ``CapabilityPartitioner(support, spec)`` or ``CapabilityPartitioner([(support_a, spec_a),
    (support_b, spec_b)])``: a node goes to the first backend that supports it and no earlier
    backend took. Tags are ``{backend_id}_{n}``, numbered in graph order. Constant data used
    only by one partition's nodes goes inside it (:func:`tag_constant_data`).
    """

    def __init__(
        self,
        support: OperatorSupport | Sequence[tuple[OperatorSupport, DelegationSpec]],
        spec: DelegationSpec | None = None,
        *,
        min_partition_size: int = 1,
    ) -> None:
        if spec is not None:
            backends = [(support, spec)]
        elif isinstance(support, Sequence) and all(
            isinstance(b, tuple) and len(b) == 2 and isinstance(b[1], DelegationSpec) for b in support
        ):
            backends = list(support)  # type: ignore[arg-type]
        else:
            raise TypeError(
                "CapabilityPartitioner takes (support, DelegationSpec) or a list of (support, DelegationSpec) "
                "pairs in priority order"
            )
        if not backends:
            raise ValueError("CapabilityPartitioner needs at least one backend")
        ids = [spec.backend_id for _, spec in backends]
        repeated = sorted({i for i in ids if ids.count(i) > 1})
        if repeated:  # tags and reasons are per backend id: one entry each, with one support
            raise ValueError(
                f"CapabilityPartitioner: backend {', '.join(map(repr, repeated))} is listed more than once; "
                "give each backend one entry whose support covers everything it takes"
            )
        if min_partition_size < 1:
            raise ValueError(f"min_partition_size must be at least 1, got {min_partition_size}")
        self.min_partition_size = min_partition_size
        self._supports = [support for support, _ in backends]
        self._specs = [spec for _, spec in backends]
        super().__init__(self._specs[0] if len(backends) == 1 else None)

    @property
    def backends(self) -> list[tuple[OperatorSupport, DelegationSpec]]:
        """``(support, spec)`` per backend, in priority order; a single backend's spec is
        :attr:`~torchdelegate.Partitioner.spec`, so a partitioner given another ``spec`` after it
        was made tags for that one."""
        specs = [self.spec] if len(self._specs) == 1 else self._specs
        return list(zip(self._supports, specs, strict=True))

    def partition(self, exported_program: ExportedProgram) -> PartitionResult:
        plan = self.plan(exported_program)
        nodes = {n.name: n for n in exported_program.graph.nodes}
        tags: dict[str, DelegationSpec] = {}
        specs = {spec.backend_id: spec for _, spec in self.backends}
        for partition in plan.partitions:
            for name in partition.nodes:
                nodes[name].meta[DELEGATION_TAG] = partition.tag
            tags[partition.tag] = specs[partition.backend_id]
        tag_constant_data(exported_program)
        return PartitionResult(exported_program, tags, plan)

    def plan(self, exported_program: ExportedProgram) -> PartitionPlan:
        """Where each computation of ``exported_program`` goes, and why; the program is not changed."""
        token = _PLANNED.set(exported_program)
        try:
            return self._plan_blocks(UnitGraph(exported_program.graph), self.backends)
        finally:
            _PLANNED.reset(token)

    def _plan_blocks(
        self, blocks: UnitGraph, backends: Sequence[tuple[OperatorSupport, DelegationSpec]]
    ) -> PartitionPlan:
        """The plan over ``blocks`` (whose atoms must contract to an acyclic graph), backends in priority order."""
        reasons: dict[Node, dict[str, str]] = {}
        groups: list[_Group] = []
        for support, spec in backends:
            backend = spec.backend_id
            claimed: dict[int, None] = {}
            for block, members in blocks.members.items():
                head = members[0]
                if head.op != "call_function":
                    continue
                if block in blocks.taken:  # taken by an earlier backend: say so where this one could have
                    for node in members:
                        if not is_tuple_item(node) and why_unsupported(support, node) is None:
                            reasons.setdefault(node, {})[backend] = CLAIMED_EARLIER
                    continue
                why = why_unsupported(support, head)
                if why is None:
                    claimed[block] = None
                else:
                    reasons.setdefault(head, {})[backend] = why
            for group in self._groups(blocks, claimed, backend):
                computations = sum(not is_tuple_item(n) for n in group.nodes)
                if computations < self.min_partition_size:
                    small = f"{TOO_SMALL} ({computations} < {self.min_partition_size})"
                    if group.apart:
                        other, via = group.apart[0]
                        small = f"{small}; joining the group holding {other.name} {CYCLE} through {via.name}"
                    for node in group.nodes:
                        reasons.setdefault(node, {})[backend] = small
                    continue
                groups.append(group)
                blocks.merge(sorted({blocks.block[n] for n in group.nodes}))
        return self._decisions(blocks, groups, reasons)

    def _groups(self, blocks: UnitGraph, claimed: dict[int, None], backend: str) -> list[_Group]:
        """The claimed blocks in cycle-free groups, as few as levels and joins find, in order of their first node."""
        order, successors = blocks.order()
        seeds = [sorted(seed, key=lambda members: members[0]) for seed in _levels(blocks, claimed, order, successors)]
        levels, (merged, refusals) = min(
            ((seed, merge_groups(successors, seed)) for seed in seeds), key=lambda found: len(found[1][0])
        )
        group_of = {index: position for position, indices in enumerate(merged) for index in indices}
        index = blocks.index
        found = [
            _Group(
                backend,
                sorted((n for i in indices for u in levels[i] for n in blocks.members[u]), key=index.__getitem__),
            )
            for indices in merged
        ]
        for refusal in refusals:
            mine, theirs = found[group_of[refusal.group]], found[group_of[refusal.other]]
            via = blocks.members[refusal.via][0]  # type: ignore[index]
            mine.apart.append((theirs.nodes[0], via))
            theirs.apart.append((mine.nodes[0], via))
        return sorted(found, key=lambda group: index[group.nodes[0]])

    def _decisions(self, blocks: UnitGraph, groups: list[_Group], reasons: dict[Node, dict[str, str]]) -> PartitionPlan:
        ordered = sorted(groups, key=lambda group: blocks.index[group.nodes[0]])
        counters: dict[str, int] = {}
        placed: dict[Node, tuple[str, str]] = {}  # node -> (backend id, tag)
        for group in ordered:
            tag = f"{group.backend}_{counters.setdefault(group.backend, 0)}"
            counters[group.backend] += 1
            placed.update(dict.fromkeys(group.nodes, (group.backend, tag)))
        partitions = []
        for group in ordered:
            apart = {placed[first][1]: via.name for first, via in group.apart if first in placed}
            nodes = [n.name for n in group.nodes]
            partitions.append(
                PlannedPartition(placed[group.nodes[0]][1], group.backend, nodes, dict(sorted(apart.items())))
            )
        decisions = []
        for node in blocks.nodes:
            if node.op != "call_function" or is_tuple_item(node):
                continue
            where, label = placed.get(node, (None, None))
            decisions.append(NodeDecision(node.name, op_name(node), where, label, dict(reasons.get(node, {}))))
        return PartitionPlan(decisions, partitions)


@dataclass
class _Group:
    """Nodes one backend takes as one delegate call, and the groups of its own it could not join."""

    backend: str
    nodes: list[Node]
    apart: list[tuple[Node, Node]] = field(default_factory=list)  # (first node of the other group, node between)


def _levels(
    blocks: UnitGraph, claimed: dict[int, None], order: list[int], successors: dict[int, list[int]]
) -> tuple[list[list[int]], list[list[int]]]:
    """The claimed blocks grouped by level, and the same cut where no edge joins them: both cycle-free."""
    level: dict[int, int] = {}
    for block in order:
        level.setdefault(block, 0)
        # a computation this backend does not take
        outside = block not in claimed and (block in blocks.taken or blocks.members[block][0].op == "call_function")
        for successor in successors[block]:
            level[successor] = max(level.get(successor, 0), level[block] + outside)
    top = max(level.values(), default=0)
    for block in reversed(order):  # raise each claimed block as far as its users allow
        if block in claimed:
            lowest = min((level[s] for s in successors[block]), default=top)  # no users: any level will do
            level[block] = max(level[block], lowest)
    by_level: dict[int, list[int]] = {}
    for block in claimed:
        by_level.setdefault(level[block], []).append(block)
    return [sorted(members) for members in by_level.values()], _components(claimed, level, successors)


def _components(claimed: dict[int, None], level: dict[int, int], successors: dict[int, list[int]]) -> list[list[int]]:
    """Each level's blocks split where no edge within the level joins them."""
    pairs = (
        (block, successor)
        for block in claimed
        for successor in successors[block]
        if successor in claimed and level[successor] == level[block]
    )
    return components(claimed, pairs)


_PLANNED: ContextVar[ExportedProgram | None] = ContextVar("torchdelegate_planned_program", default=None)


def planned_program() -> ExportedProgram | None:
    """The program a capability partitioner is planning now, for an operator support that needs more
    than the node it is asked about (which placeholders are the program's weights); None outside."""
    return _PLANNED.get()


def is_state_placeholder(node: Node) -> bool:
    """Whether ``node`` is a placeholder of the planned program's parameters, buffers or constants."""
    program = planned_program()
    if program is None or node.op != "placeholder":
        return False
    return any(s.arg.name == node.name and s.kind != InputKind.USER_INPUT for s in program.graph_signature.input_specs)
