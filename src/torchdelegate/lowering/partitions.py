"""Finding partitions: one pass groups a graph's tagged nodes and checks they can be fused.

The result says, for each tag, which nodes form the partition, what flows in and out, which
tagged state (parameters, buffers, constants) it carries inside, and which buffer
mutations it owns; and it gives an order of the fused graph (each partition one step)
that is topological, found by Kahn's algorithm in ``O((nodes + edges) log nodes)``. A
partition whose fusion would create a cycle has no such order: that is reported with a
node on the cycle.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch.utils._pytree as pytree
from torch._ops import OpOverload
from torch.export.graph_signature import ExportGraphSignature, InputKind, InputSpec, OutputKind
from torch.fx import GraphModule, Node

from torchdelegate.delegate.specs import DelegationSpec
from torchdelegate.errors import PartitionError
from torchdelegate.exported.programs import STATE_KINDS, output_values
from torchdelegate.partition.contract import NO_COPY, is_tuple_item, tags_in
from torchdelegate.partition.topological_order import topological_order


@dataclass(eq=False)
class Partition:
    """The nodes of one tag in one graph, and its boundary."""

    tag: str
    spec: DelegationSpec
    nodes: list[Node] = field(default_factory=list)
    inputs: dict[Node, None] = field(default_factory=dict)
    """Values computed outside and passed in, in order of first use."""
    state: dict[Node, None] = field(default_factory=dict)
    """Tagged parameter/buffer/constant placeholders the partition carries inside."""
    attrs: dict[Node, None] = field(default_factory=dict)
    """``get_attr`` nodes (sub-graphs) the partition's nodes read, copied into it."""
    outputs: list[Node] = field(default_factory=list)
    """Member nodes whose values are used outside."""
    mutations: list[int] = field(default_factory=list)
    """Positions of the owner's outputs whose buffer mutation moves into the partition."""
    owned_buffers: list[Node] = field(default_factory=list)
    """The buffer placeholders of those mutations: their state lives in the delegate."""


Step = Node | Partition


@dataclass
class GraphPartitions:
    """Everything splicing needs about one graph's partitions."""

    partitions: list[Partition]
    order: list[Step]
    dropped: set[Node]
    """Placeholders and ``get_attr`` nodes the owner no longer needs."""
    owned_outputs: set[int]
    """Output positions (buffer mutations) that leave the owner for a delegate."""
    input_specs: dict[str, InputSpec]
    """The owner's input specs by placeholder name (empty for a sub-graph)."""
    top_level: bool = True
    """Whether the graph is the program's own (it has a signature), not a control-flow sub-graph."""


def find_partitions(
    gm: GraphModule,
    signature: ExportGraphSignature | None,
    partition_tags: Mapping[str, DelegationSpec],
    where: str,
    mutated_elsewhere: frozenset[str] = frozenset(),
    tags: Mapping[Node, str] | None = None,
) -> GraphPartitions:
    """Group ``gm``'s tagged nodes into partitions and order the fused graph (``gm`` is only read).

    ``signature`` is the program's (``None`` for a control-flow sub-graph, whose
    placeholders are all inputs). ``where`` names the graph in error messages. A buffer in
    ``mutated_elsewhere`` (written by another method) is passed in even when tagged, so the
    delegate always reads its current value. ``tags`` gives each tagged node's tag; by default
    the tags a partitioner set in ``node.meta`` (a report passes a plan's, without tagging).
    """
    specs = {s.arg.name: s for s in signature.input_specs if hasattr(s.arg, "name")} if signature else {}
    nodes = list(gm.graph.nodes)
    if tags is None:
        tags = tags_in(nodes)
    index = {node: i for i, node in enumerate(nodes)}
    groups: dict[str, Partition] = {}
    group_of: dict[Node, Partition] = {}
    tagged_state: set[Node] = set()
    mutated_here = _mutated_targets(signature)

    for node in nodes:
        tag = tags.get(node)
        if is_tuple_item(node):  # export makes tuples only as computations' outputs
            source = group_of.get(node.args[0])  # type: ignore[arg-type]
            if source is not None:
                source.nodes.append(node)
                group_of[node] = source
            continue
        if tag is None or node.op == "get_attr":
            continue
        _check_tag(tag, node, partition_tags, where)
        if node.op == "output":
            raise PartitionError(
                f"{where}: the output node {node.name!r} is tagged {tag!r}; a partition holds "
                "computations, never the graph's output: remove the tag"
            )
        if node.op == "placeholder":
            spec = specs.get(node.name)
            if spec is None or spec.kind not in STATE_KINDS:
                raise PartitionError(
                    f"{where}: user input {node.name!r} is tagged {tag!r}; inputs cannot be "
                    "delegated (their users can): remove the tag from the placeholder"
                )
            if spec.target not in mutated_elsewhere or spec.target in mutated_here:
                tagged_state.add(node)
            continue
        group = groups.get(tag)
        if group is None:
            group = groups[tag] = Partition(tag, partition_tags[tag])
        group.nodes.append(node)
        group_of[node] = group

    _check_no_copy(nodes, specs, tags, tagged_state, group_of, where)
    outputs = output_values(nodes[-1])
    owned_uses = _assign_owned_mutations(signature, specs, outputs, tags, tagged_state, group_of, where)
    for group in groups.values():
        _find_boundary(group, group_of, tagged_state, owned_uses, index, where)

    order = _fused_order(nodes, group_of, where)
    partitions = [u for u in order if isinstance(u, Partition)]
    owned_outputs = {i for p in partitions for i in p.mutations}
    dropped = _dropped(nodes, partitions, group_of, tagged_state, specs, signature, owned_outputs)
    return GraphPartitions(partitions, order, dropped, owned_outputs, specs, signature is not None)


def _check_no_copy(
    nodes: list[Node],
    specs: Mapping[str, InputSpec],
    tags: Mapping[Node, str],
    tagged_state: set[Node],
    group_of: Mapping[Node, Partition],
    where: str,
) -> None:
    """A tagged constant marked ``no_copy`` lives only in its tag's delegate: no other node may read it."""
    for node in nodes:
        if node.op != "placeholder" or not node.meta.get(NO_COPY) or node not in tags:
            continue
        tag, spec = tags[node], specs[node.name]
        what = f"{spec.kind.name.lower().replace('_', ' ')} {spec.target!r}"
        if node not in tagged_state:
            raise PartitionError(
                f"{where}: {what} is marked no_copy and tagged {tag!r}, but another method writes it, so it is "
                "passed to the delegate as an input and cannot live only in it; remove node.meta['no_copy']"
            )
        for user in node.users:
            partition = group_of.get(user)
            if partition is not None and partition.tag == tag:
                continue
            if user.op == "output":
                reader, advice = "the program's output", ""
            else:
                place = f"in partition {partition.tag!r}" if partition else "outside every partition"
                reader, advice = f"node {user.name!r} {place}", f"tag {user.name!r} with {tag!r}, or "
            raise PartitionError(
                f"{where}: {what} is marked no_copy, so it must live only in the delegate of its tag {tag!r}, but "
                f"{reader} reads it too; {advice}remove node.meta['no_copy'] so that the program and the "
                "partitions that read it share it"
            )


def _mutated_targets(signature: ExportGraphSignature | None) -> set[str]:
    return set(signature.buffers_to_mutate.values()) if signature is not None else set()


def _check_tag(tag: Any, node: Node, partition_tags: Mapping[str, DelegationSpec], where: str) -> None:
    if not isinstance(tag, str):
        raise PartitionError(f"{where}: node {node.name!r} has a delegation tag {tag!r} that is not a str")
    if tag not in partition_tags:
        known = ", ".join(repr(t) for t in partition_tags) or "none"
        raise PartitionError(
            f"{where}: node {node.name!r} is tagged {tag!r}, which is not in the partitioner's "
            f"partition_tags (known tags: {known}); return a DelegationSpec for every tag used"
        )


def _dropped(
    nodes: list[Node],
    partitions: list[Partition],
    group_of: Mapping[Node, Partition],
    tagged_state: set[Node],
    specs: Mapping[str, InputSpec],
    signature: ExportGraphSignature | None,
    owned_outputs: set[int],
) -> set[Node]:
    """The placeholders and ``get_attr`` nodes that only partitions needed.

    A tagged state placeholder whose every user is delegated leaves (unless it is passed to
    a delegate, or the owner still writes it); so does a buffer whose state a delegate owns.
    Inputs that had no user at all stay, as they were.
    """
    passed_in = {n for p in partitions for n in p.inputs}
    owned_buffers = {n for p in partitions for n in p.owned_buffers}
    written_by_owner = {
        s.target
        for i, s in enumerate(signature.output_specs if signature else ())
        if s.kind == OutputKind.BUFFER_MUTATION and i not in owned_outputs
    }

    def only_delegated(node: Node) -> bool:
        if node.op == "get_attr":
            return True
        return node in tagged_state and specs[node.name].target not in written_by_owner

    return owned_buffers | {
        node
        for node in nodes
        if node.op in ("placeholder", "get_attr")
        and node.users
        and node not in passed_in
        and all(user in group_of for user in node.users)
        and only_delegated(node)
    }


def _assign_owned_mutations(
    signature: ExportGraphSignature | None,
    specs: Mapping[str, InputSpec],
    outputs: Sequence[Any],
    tags: Mapping[Node, str],
    tagged_state: set[Node],
    group_of: Mapping[Node, Partition],
    where: str,
) -> dict[Node, int]:
    """Give each tagged, mutated buffer's mutation to the partition that reads and writes it.

    Returns, for each producer of an owned mutation, how many output slots it fills that way.
    """
    owned_uses: dict[Node, int] = {}
    if signature is None:
        return owned_uses
    buffer_nodes = {s.target: n for n in tagged_state if (s := specs[n.name]).kind == InputKind.BUFFER}
    for i, spec in enumerate(signature.output_specs):
        if spec.kind != OutputKind.BUFFER_MUTATION or spec.target not in buffer_nodes:
            continue
        buffer = buffer_nodes[spec.target]
        producer = outputs[i]
        group = group_of.get(producer) if isinstance(producer, Node) else None
        tag = tags[buffer]
        if group is None or group.tag != tag:
            raise PartitionError(
                f"{where}: buffer {spec.target!r} is tagged {tag!r}, so its partition would own its "
                f"state, but its new value {getattr(producer, 'name', producer)!r} is computed "
                f"outside that partition; tag the update with {tag!r}, or untag the buffer "
                "(then it is passed in and its new value returned)"
            )
        for user in buffer.users:
            if group_of.get(user) is not group:
                raise PartitionError(
                    f"{where}: buffer {spec.target!r} is tagged {tag!r} and mutated there, but node "
                    f"{user.name!r} outside the partition reads it; a delegate's state cannot be "
                    f"shared: tag {user.name!r} with {tag!r}, or untag the buffer"
                )
        group.mutations.append(i)
        group.owned_buffers.append(buffer)
        group.state[buffer] = None
        owned_uses[producer] = owned_uses.get(producer, 0) + 1
    return owned_uses


def _find_boundary(
    group: Partition,
    group_of: Mapping[Node, Partition],
    tagged_state: set[Node],
    owned_uses: Mapping[Node, int],
    index: Mapping[Node, int],
    where: str,
) -> None:
    for node in group.nodes:
        for written in _written_arguments(node):
            if group_of.get(written) is not group:
                raise PartitionError(
                    f"{where}: node {node.name!r} in partition {group.tag!r} writes in place into "
                    f"{written.name!r}, which the partition does not compute; a delegate cannot update "
                    "its inputs. Lower a functional program: run_decompositions() first"
                )
        for value in node.all_input_nodes:
            if group_of.get(value) is group:
                continue
            if value.op == "get_attr":
                group.attrs[value] = None
            elif value in tagged_state:
                group.state[value] = None
            else:
                group.inputs[value] = None
        if _used_outside(node, group, group_of, owned_uses.get(node, 0)):
            group.outputs.append(node)
    group.state = dict.fromkeys(sorted(group.state, key=index.__getitem__))


def _written_arguments(node: Node) -> list[Node]:
    """The nodes an in-place op writes into (its schema's mutable arguments)."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, OpOverload) or not target._schema.is_mutable:
        return []
    written: list[Node] = []
    for i, argument in enumerate(target._schema.arguments):
        if argument.alias_info is not None and argument.alias_info.is_write:
            value = node.args[i] if i < len(node.args) else node.kwargs.get(argument.name)
            written.extend(v for v in pytree.tree_leaves(value) if isinstance(v, Node))
    return written


def _used_outside(node: Node, group: Partition, group_of: Mapping[Node, Partition], owned: int) -> bool:
    for user in node.users:
        if group_of.get(user) is group:
            continue
        if user.op != "output" or owned == 0:
            return True
        uses = sum(1 for v in output_values(user) if v is node)
        if uses > owned:
            return True
    return False


def _fused_order(nodes: list[Node], group_of: Mapping[Node, Partition], where: str) -> list[Step]:
    """A topological order of the graph with each partition fused into one step."""
    successors: dict[Step, list[Step]] = {}
    for node in nodes:
        step: Step = group_of.get(node, node)
        targets = successors.setdefault(step, [])
        for user in node.users:
            target: Step = group_of.get(user, user)
            if target is not step:
                targets.append(target)
    order = topological_order(successors)
    if len(order) != len(successors):
        emitted = set(order)
        _raise_cycle([u for u in successors if u not in emitted], group_of, where)
    return order


def _raise_cycle(remaining: list[Step], group_of: Mapping[Node, Partition], where: str) -> None:
    """Walk predecessors among the steps Kahn's algorithm could not emit until one repeats."""
    left = set(remaining)

    def predecessor(step: Step) -> Step:
        members = step.nodes if isinstance(step, Partition) else [step]
        for node in members:
            for value in node.all_input_nodes:
                pred: Step = group_of.get(value, value)
                if pred is not step and pred in left:
                    return pred
        raise AssertionError("a step left by Kahn's algorithm has no remaining predecessor")

    seen: dict[Step, int] = {}
    path: list[Step] = []
    step = remaining[0]
    while step not in seen:
        seen[step] = len(path)
        path.append(step)
        step = predecessor(step)
    cycle = path[seen[step] :]
    partition = next(u for u in cycle if isinstance(u, Partition))
    outside = next((u for u in cycle if isinstance(u, Node)), None)
    via = (
        outside.name
        if outside is not None
        else next(p.nodes[0].name for p in cycle if isinstance(p, Partition) and p is not partition)
    )
    raise PartitionError(
        f"{where}: partition {partition.tag!r} cannot be fused into one delegate: node {via!r} "
        f"outside it both depends on the partition and feeds it, so fusing would make a cycle; "
        f"tag {via!r} with {partition.tag!r} too, or split the partition at that node"
    )
