"""Partitions from groups of nodes the caller says must stay together: ExecuTorch's group-based
partitioner and its partitions-from-lists helpers, on the one capability engine.

A backend author who already knows which nodes make one fused block (a quantize-dequantize
pattern around a linear layer, an attention block) gives them as *node groups*. Each group's
supported nodes become one atom of :class:`~torchdelegate.partition.capability.UnitGraph`, never
split; the engine then joins atoms and the other supported nodes into as few cycle-free
partitions as it finds, exactly as :class:`~torchdelegate.partition.capability.CapabilityPartitioner`
groups what a backend supports. A supported node on a path that leaves a group and comes back
into it (or that joins groups waiting for each other) is taken into the group's atom, as
ExecuTorch's merges it into the partition (``partition/closure.py``). A node in two groups is an
error, and so is a group that cannot be one partition, because an unsupported node stands on
such a path: the error names that node, where ExecuTorch's would fail later, when the partitions
are fused. Placeholders and ``get_attr`` nodes the support accepts (a convolution's weight, a
constant) are in the partitions too, as torch.fx's partitioner puts them there, so that a
partitioner tagging every node of a partition lowers them inside its delegate.

The classes here work on a ``GraphModule`` and return ``torch.fx`` ``Partition`` objects, as
ExecuTorch's do (they are called inside a ``Partitioner.partition``), and say why through
:meth:`GroupBasedPartitioner.plan`, a :class:`~torchdelegate.partition.plan.PartitionPlan`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, NoReturn

from torch.fx import Graph, GraphModule, Node
from torch.fx.node import _get_qualified_name
from torch.fx.passes.infra.partitioner import Partition

from torchdelegate.delegate.specs import DelegationSpec
from torchdelegate.partition.capability import (
    CYCLE,
    CapabilityPartitioner,
    OperatorSupport,
    UnitGraph,
    why_unsupported,
)
from torchdelegate.partition.closure import Entangled, widen_groups
from torchdelegate.partition.contract import is_tuple_item
from torchdelegate.partition.plan import PartitionPlan

GROUP = "group"  # the label a plan's reasons and partitions carry: these partitions have no backend yet
NOT_LISTED = "in no list of nodes"
NOT_A_COMPUTATION = "not a computation (an OperatorSupport is asked about computations only)"
_INPUTS = ("placeholder", "get_attr")
_NON_COMPUTE = ("torch.ops.aten.view", "torch.ops.aten.view.default", "_operator.getitem")


class GroupBasedPartitioner:
    """Partitions of ``graph_module`` keeping each of ``node_groups`` whole (ExecuTorch's contract).

    ``operator_support`` says which nodes may be partitioned: a torch.fx ``OperatorSupportBase``
    (its ``is_node_supported(submodules, node)``) or an
    :data:`~torchdelegate.partition.capability.OperatorSupport` (a set of ops, or a callable on a
    node). A torch.fx support is asked about every node, placeholders included, as torch.fx asks
    it; ours about computations only. A group's unsupported nodes are left out of it. Unless
    ``allows_single_node_partition``, partitions with at most one computation are dropped, not
    counting ``non_compute_ops`` (qualified names; ``view`` and ``getitem`` always) and counting
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
        return plan_with_atoms(graph, self._atoms(), self.support)

    def propose_partitions(self) -> list[Partition]:
        """The partitions as torch.fx ``Partition`` objects, latest first (by their last node, as
        torch.fx's walk from the graph's end returns them) and numbered in that order; each
        partition's nodes in graph order, the placeholders and attributes it takes first."""
        graph = self.graph_module.graph
        nodes = {node.name: node for node in graph.nodes}
        found = [[nodes[name] for name in planned.nodes] for planned in self.plan().partitions]
        if not self.allows_single_node_partition:
            found = [members for members in found if self._computations(members) > 1]
        found = with_inputs(graph, found, self.support, self.node_groups)
        position = {node: index for index, node in enumerate(graph.nodes)}
        found.sort(key=lambda members: position[members[-1]], reverse=True)
        return [Partition(id=number, nodes=members) for number, members in enumerate(found)]

    def _atoms(self) -> list[list[Node]]:
        """Each group's supported computations, widened over the supported nodes that paths between
        them go through; a ``ValueError`` when an unsupported node stands in the way."""
        supported = self.support
        groups = [[n for n in group if n.op == "call_function" and supported(n) is None] for group in self.node_groups]
        kept = [group for group in groups if group]
        widened = widen_groups(self.graph_module.graph, kept, lambda node: supported(node) is None)
        if isinstance(widened, Entangled):
            _refuse(widened, [self.node_groups[i] for i, group in enumerate(groups) if group])
        return widened

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
    ``op_support`` accepts (placeholders included), single nodes included, latest first as
    :meth:`GroupBasedPartitioner.propose_partitions` gives them; the lists are not kept whole (see
    :func:`generate_grouped_partitions_from_list_of_nodes` for that)."""
    _require_nodes_or_support(pattern_list, op_support)
    listed = {node for nodes in pattern_list or () for node in nodes}
    return GroupBasedPartitioner(
        graph_module, _ListedOr(listed, op_support, graph_module), allows_single_node_partition=True
    ).propose_partitions()


def generate_grouped_partitions_from_list_of_nodes(
    graph_module: GraphModule,
    pattern_list: Sequence[Iterable[Node]] | None = None,
    op_support: Any = None,
) -> list[Partition]:
    """As :func:`generate_partitions_from_list_of_nodes`, each list kept whole in one partition."""
    _require_nodes_or_support(pattern_list, op_support)
    groups = [list(nodes) for nodes in pattern_list or ()]
    listed = {node for nodes in groups for node in nodes}
    return GroupBasedPartitioner(
        graph_module,
        _ListedOr(listed, op_support, graph_module),
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
    if isinstance(operator_support, _ListedOr):
        return operator_support.why_not
    if hasattr(operator_support, "is_node_supported"):
        submodules = dict(graph_module.named_modules())

        def fx_support(node: Node) -> str | None:
            if operator_support.is_node_supported(submodules, node):
                return None
            return f"{type(operator_support).__name__} does not support it"

        return fx_support

    def support(node: Node) -> str | None:
        return why_unsupported(operator_support, node) if node.op == "call_function" else NOT_A_COMPUTATION

    return support


def with_inputs(
    graph: Graph, partitions: list[list[Node]], support: Callable[[Node], str | None], groups: Sequence[Sequence[Node]]
) -> list[list[Node]]:
    """``partitions`` (graph order) with the placeholders and ``get_attr`` nodes ``support`` accepts.

    Each joins the partition of a node group it is listed in, else the partition of its first user
    (in graph order) that has one, even when a node outside reads it too: lowering shares such
    state between the program and every partition that reads it (torch.fx's partitioner leaves it
    out then, a partition of its own). One that no partition reads is left out.
    """
    position = {node: index for index, node in enumerate(graph.nodes)}
    home = {node: index for index, members in enumerate(partitions) for node in members}
    group_home: dict[Node, int] = {}
    for group in groups:
        held = [home[node] for node in group if node in home]
        if held:
            group_home.update(dict.fromkeys(group, held[0]))
    taken: list[list[Node]] = [[] for _ in partitions]
    for node in graph.nodes:
        if node.op not in _INPUTS or support(node) is not None:
            continue
        readers = sorted((user for user in node.users if user in home), key=position.__getitem__)
        found = group_home.get(node, home[readers[0]] if readers else None)
        if found is not None:
            taken[found].append(node)
    return [[*inputs, *members] for inputs, members in zip(taken, partitions, strict=True)]


def _require_nodes_or_support(pattern_list: Any, op_support: Any) -> None:
    """Neither given is a mistake; an empty list (a pattern that matched nothing) gives no partitions."""
    if pattern_list is None and op_support is None:
        raise ValueError("give a list of nodes or an operator support to partition with")


class _ListedOr:
    """Supported if listed or if ``op_support`` (optional) accepts it: asked about every node, placeholders
    included, as torch.fx asks the support ExecuTorch's helpers build from the lists."""

    def __init__(self, listed: set[Node], op_support: Any, graph_module: GraphModule) -> None:
        self.listed = listed
        self.other = _as_support(op_support, graph_module) if op_support is not None else None

    def why_not(self, node: Node) -> str | None:
        if node in self.listed:
            return None
        return NOT_LISTED if self.other is None else self.other(node)


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


def _refuse(entangled: Entangled, given: list[list[Node]]) -> NoReturn:
    """The ``ValueError`` for groups no partition can keep whole, naming the groups and the node in the way."""
    names = [_listed(given[index]) for index in entangled.groups[:2]]
    via = entangled.via.name
    if len(entangled.groups) > 1:
        raise ValueError(
            f"the node groups of {names[0]} and of {names[1]} {CYCLE} together (through {via!r}, which the "
            "operator support refuses): each depends on the other; split one of them there"
        )
    in_a_group = any(node is entangled.via for group in given for node in group)
    why = (
        f"{via!r}, which the operator support refuses (a group keeps only supported nodes); split the group there"
        if in_a_group
        else f"{via!r}, which is not in it and which the operator support refuses; split the group there"
    )
    raise ValueError(f"the node group of {names[0]} {CYCLE}: a path leaves it and comes back through {why}")


def _listed(group: list[Node]) -> str:
    """A group's first node names, and ``...`` where there are more."""
    shown = ", ".join(repr(node.name) for node in group[:4])
    return shown + ("..." if len(group) > 4 else "")
