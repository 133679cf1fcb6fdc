"""Partitions from groups of nodes the caller says must stay together: ExecuTorch's group-based
partitioner and its partitions-from-lists helpers, on the one capability engine.

A backend author who already knows which nodes make one fused block (a quantize-dequantize
pattern around a linear layer, an attention block) gives them as *node groups*. Each group's
supported nodes become one atom of :class:`~torchdelegate.partition.capability.UnitGraph`, never
split; the engine then joins atoms and the other supported nodes into as few cycle-free
partitions as it finds, exactly as :class:`~torchdelegate.partition.capability.CapabilityPartitioner`
groups what a backend supports. A node in two groups is an error, and so is a group that cannot be
one partition: one that a path through a node outside it joins (alone or together with another
group) would make the graph depend on itself, and the error names that node, where ExecuTorch's
would fail later, when the partitions are fused.

The classes here work on a ``GraphModule`` and return ``torch.fx`` ``Partition`` objects, as
ExecuTorch's do (they are called inside a ``Partitioner.partition``), and say why through
:meth:`GroupBasedPartitioner.plan`, a :class:`~torchdelegate.partition.plan.PartitionPlan`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from torch.fx import Graph, GraphModule, Node
from torch.fx.node import _get_qualified_name
from torch.fx.passes.infra.partitioner import Partition

from torchdelegate.delegate.specs import DelegationSpec
from torchdelegate.partition.capability import (
    CYCLE,
    CapabilityPartitioner,
    OperatorSupport,
    UnitGraph,
    atoms_on_a_cycle,
    why_unsupported,
)
from torchdelegate.partition.contract import is_tuple_item
from torchdelegate.partition.plan import PartitionPlan

GROUP = "group"  # the label a plan's reasons and partitions carry: these partitions have no backend yet
NOT_LISTED = "in no list of nodes"
_NON_COMPUTE = ("torch.ops.aten.view", "torch.ops.aten.view.default", "_operator.getitem")


class GroupBasedPartitioner:
    """Partitions of ``graph_module`` keeping each of ``node_groups`` whole (ExecuTorch's contract).

    ``operator_support`` says which nodes may be partitioned: a torch.fx ``OperatorSupportBase``
    (its ``is_node_supported(submodules, node)``) or an
    :data:`~torchdelegate.partition.capability.OperatorSupport` (a set of ops, or a callable on a
    node). A group's unsupported nodes are left out of it. Unless ``allows_single_node_partition``,
    partitions with at most one computation are dropped, not counting ``non_compute_ops``
    (qualified names; ``view`` and ``getitem`` always) and counting
    ``allowed_single_node_partition_ops`` twice, as ExecuTorch does.
    """

    def __init__(
        self,
        graph_module: GraphModule,
        operator_support: Any,
        allows_single_node_partition: bool = False,
        non_compute_ops: Sequence[str] | None = None,
        allowed_single_node_partition_ops: Sequence[str] | None = None,
        node_groups: Sequence[Iterable[Node]] | None = None,
    ) -> None:
        if not isinstance(graph_module, GraphModule):
            raise TypeError(f"GroupBasedPartitioner takes a torch.fx GraphModule, got {type(graph_module).__name__}")
        self.graph_module = graph_module
        self.support = _as_support(operator_support, graph_module)
        self.allows_single_node_partition = allows_single_node_partition
        self.non_compute_ops = {*_NON_COMPUTE, *(non_compute_ops or ())}
        self.allowed_single_node_partition_ops = set(allowed_single_node_partition_ops or ())
        self.node_groups = [list(group) for group in node_groups or ()]
        _check_membership(graph_module.graph, self.node_groups)

    def plan(self) -> PartitionPlan:
        """Where each computation goes and why, before single-node partitions are dropped (the
        partitions are labelled ``group_N``)."""
        graph = self.graph_module.graph
        supported = self.support
        groups = [[n for n in group if n.op == "call_function" and supported(n) is None] for group in self.node_groups]
        kept = [group for group in groups if group]
        _check_acyclic(graph, kept, [self.node_groups[i] for i, group in enumerate(groups) if group])
        return plan_with_atoms(graph, kept, self.support)

    def propose_partitions(self) -> list[Partition]:
        """The partitions, as torch.fx ``Partition`` objects numbered in graph order."""
        nodes = {node.name: node for node in self.graph_module.graph.nodes}
        found = [[nodes[name] for name in planned.nodes] for planned in self.plan().partitions]
        if not self.allows_single_node_partition:
            found = [members for members in found if self._computations(members) > 1]
        return [Partition(id=number, nodes=members) for number, members in enumerate(found)]

    def _computations(self, members: list[Node]) -> int:
        """ExecuTorch's count: a call that is not a non-compute op counts once, an allowed single op once more."""
        count = 0
        for node in members:
            if node.op != "call_function":
                continue
            name = _get_qualified_name(node.target) if callable(node.target) else str(node.target)
            count += name not in self.non_compute_ops
            count += name in self.allowed_single_node_partition_ops
        return count


def generate_partitions_from_list_of_nodes(
    graph_module: GraphModule,
    pattern_list: Sequence[Iterable[Node]] | None = None,
    op_support: Any = None,
) -> list[Partition]:
    """The largest cycle-free partitions of the nodes listed in ``pattern_list`` and those
    ``op_support`` accepts, single nodes included; the lists are not kept whole (see
    :func:`generate_grouped_partitions_from_list_of_nodes` for that)."""
    listed = {node for nodes in pattern_list or () for node in nodes}
    return GroupBasedPartitioner(
        graph_module, _listed_or(listed, op_support, graph_module), allows_single_node_partition=True
    ).propose_partitions()


def generate_grouped_partitions_from_list_of_nodes(
    graph_module: GraphModule,
    pattern_list: Sequence[Iterable[Node]] | None = None,
    op_support: Any = None,
) -> list[Partition]:
    """As :func:`generate_partitions_from_list_of_nodes`, each list kept whole in one partition."""
    groups = [list(nodes) for nodes in pattern_list or ()]
    listed = {node for nodes in groups for node in nodes}
    return GroupBasedPartitioner(
        graph_module,
        _listed_or(listed, op_support, graph_module),
        allows_single_node_partition=True,
        node_groups=groups,
    ).propose_partitions()


def plan_with_atoms(graph: Graph, atoms: Sequence[Sequence[Node]], support: OperatorSupport) -> PartitionPlan:
    """The capability engine's plan for one label over ``graph`` with ``atoms`` (supported, disjoint,
    contracting to an acyclic graph) each kept whole."""
    engine = CapabilityPartitioner(support, DelegationSpec(GROUP))
    return engine._plan_blocks(UnitGraph(graph, atoms), engine.backends)


def _as_support(operator_support: Any, graph_module: GraphModule) -> Callable[[Node], str | None]:
    """``node -> None`` (supported) ``| why not``, from a torch.fx operator support or one of ours."""
    if operator_support is None:
        raise ValueError("give an operator support (or a list of nodes) to partition with")
    if hasattr(operator_support, "is_node_supported"):
        submodules = dict(graph_module.named_modules())

        def fx_support(node: Node) -> str | None:
            if operator_support.is_node_supported(submodules, node):
                return None
            return f"{type(operator_support).__name__} does not support it"

        return fx_support
    return lambda node: why_unsupported(operator_support, node)


def _listed_or(listed: set[Node], op_support: Any, graph_module: GraphModule) -> Callable[[Node], str | None]:
    """Supported if listed or if ``op_support`` (optional) accepts it."""
    if not listed and op_support is None:
        raise ValueError("give a list of nodes or an operator support to partition with")
    other = _as_support(op_support, graph_module) if op_support is not None else None

    def support(node: Node) -> str | None:
        if node in listed:
            return None
        return NOT_LISTED if other is None else other(node)

    return support


def _check_membership(graph: Graph, groups: list[list[Node]]) -> None:
    """Every group's nodes are the graph's, and no node is in two groups."""
    owner: dict[Node, int] = {}
    for index, group in enumerate(groups):
        for node in group:
            if not isinstance(node, Node) or node.graph is not graph:
                raise ValueError(f"node group {index}: {node!r} is not a node of this graph")
            if is_tuple_item(node):
                continue  # it goes with its producer
            first = owner.setdefault(node, index)
            if first != index:
                raise ValueError(f"node {node.name!r} is in node groups {first} and {index}; give each node one group")


def _check_acyclic(graph: Graph, kept: list[list[Node]], given: list[list[Node]]) -> None:
    """Refuse groups that cannot each be one partition, naming the groups and a node on the path."""
    cycle = atoms_on_a_cycle(graph, kept)
    if cycle is None:
        return
    names = [_listed(given[index]) for index in cycle.atoms[:2]]
    if len(cycle.atoms) > 1:
        through = f" (through {cycle.through[0].name!r})" if cycle.through else ""
        raise ValueError(
            f"the node groups of {names[0]} and of {names[1]} {CYCLE} together{through}: each depends on "
            "the other; merge them into one group or split one"
        )
    via = cycle.through[0].name  # an atom alone is on a cycle only through a node outside it
    in_a_group = any(node.name == via for index in cycle.atoms for node in given[index])
    why = (
        f"{via!r}, which the operator support refuses (a group keeps only supported nodes); split the group there"
        if in_a_group
        else f"{via!r}, which is not in it; split the group there, or add that node to it"
    )
    raise ValueError(f"the node group of {names[0]} {CYCLE}: a path leaves it and comes back through {why}")


def _listed(group: list[Node]) -> str:
    """A group's first node names, and ``...`` where there are more."""
    shown = ", ".join(repr(node.name) for node in group[:4])
    return shown + ("..." if len(group) > 4 else "")
