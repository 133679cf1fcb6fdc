"""Partitions from op patterns: "addmm followed by relu" as one block that a backend fuses.

A pattern is one of:

- a **sequence of ops**, ``[aten.addmm.default, aten.relu.default]``: each op's value feeds
  the next op and nothing else (the last one's may go anywhere). A step is an overload, a
  packet (``aten.relu``: any of its overloads) or a set of them (alternatives:
  ``{aten.relu.default, aten.gelu.default}``);
- a **graph** (``torch.fx.Graph`` or ``GraphModule``) whose placeholders stand for any value:
  matched by torch.fx's ``SubgraphMatcher`` (the same targets, equal literal arguments, and
  values inside the match used only inside it, except the pattern's outputs);
- a **function** with example inputs, ``Pattern.from_function(lambda x, w: (x @ w).relu(),
  (x, w))``: exported and decomposed to core ATen like the programs it is matched in, then
  matched as a graph.

:func:`find_pattern_matches` resolves the matches in three deterministic steps: (1) every
match of every pattern, patterns in the order given and each pattern's matches in graph
order; (2) a match sharing a node with a match taken before it is dropped (earlier patterns
win, then earlier matches: list the longest patterns first); (3) the matches must contract to
an acyclic graph, alone and together (an op sequence cannot fail this alone, having one exit;
a graph pattern with several outputs can: a path outside its match may join two of its
nodes): while they do not, the last-taken match on a cycle is dropped. A dropped match is not
reconsidered.

:class:`PatternPartitioner` gives the surviving matches to one backend as *atoms* (never
split) and then groups them, with any single nodes its ``op_support`` accepts, exactly as
:class:`~torchdelegate.partition.capability.CapabilityPartitioner` groups what a backend
supports: cycle-free partitions, as few as it finds, ``min_partition_size``, and a
:class:`~torchdelegate.partition.plan.PartitionPlan` saying why each node went where.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch._ops import OpOverload, OpOverloadPacket
from torch.export import ExportedProgram
from torch.fx import Graph, GraphModule, Node

from torchdelegate.delegate.specs import DelegationSpec
from torchdelegate.partition.capability import (
    CYCLE,
    CapabilityPartitioner,
    OperatorSupport,
    UnitGraph,
    atoms_on_a_cycle,
    why_unsupported,
)
from torchdelegate.partition.contract import overloads_of
from torchdelegate.partition.plan import PartitionPlan, op_name

NOT_MATCHED = "in no match of the patterns"

PatternStep = OpOverload | OpOverloadPacket | Collection[OpOverload | OpOverloadPacket]
"""One step of an op sequence: an op, a packet (any of its overloads), or a set of alternatives."""


@dataclass(frozen=True, eq=False)
class Pattern:
    """An op sequence (``steps``) or a graph to match; ``name`` says which in plans and errors."""

    name: str
    steps: tuple[frozenset[OpOverload], ...] = ()
    graph: Graph | None = None

    @classmethod
    def sequence(cls, *steps: PatternStep, name: str | None = None) -> Pattern:
        """Ops in a chain: each step's value feeds the next step only."""
        if not steps:
            raise ValueError("Pattern.sequence needs at least one op")
        resolved = tuple(_step(step, index) for index, step in enumerate(steps))
        return cls(name or "+".join("|".join(sorted({_short(op) for op in step})) for step in resolved), resolved)

    @classmethod
    def from_graph(cls, graph: Graph | GraphModule, name: str | None = None) -> Pattern:
        """A graph whose placeholders match any value; its computations are the pattern."""
        if isinstance(graph, GraphModule):
            graph = graph.graph
        if not isinstance(graph, Graph):
            raise TypeError(f"Pattern.from_graph takes a torch.fx Graph or GraphModule, got {type(graph).__name__}")
        ops = [node for node in graph.nodes if node.op == "call_function"]
        if not ops:
            raise ValueError("Pattern.from_graph: the graph has no call_function node to match")
        return cls(name or "+".join(_short(node.target) for node in ops), graph=graph)

    @classmethod
    def from_function(
        cls, function: Callable[..., Any], example_inputs: tuple[Any, ...], name: str | None = None
    ) -> Pattern:
        """A function of tensors, exported with ``example_inputs`` and decomposed to core ATen."""

        class _Function(torch.nn.Module):
            def forward(self, *args: Any) -> Any:
                return function(*args)

        program = torch.export.export(_Function(), tuple(example_inputs)).run_decompositions()
        label = getattr(function, "__name__", "")
        return cls.from_graph(program.graph_module, name or (label if label.isidentifier() else None))


PatternLike = Pattern | Sequence[PatternStep] | Graph | GraphModule
"""What a partitioner's pattern list holds: a Pattern, a sequence of ops, or a graph."""


def as_pattern(pattern: PatternLike) -> Pattern:
    """``pattern`` as a :class:`Pattern` (a list or tuple of ops is a sequence)."""
    if isinstance(pattern, Pattern):
        return pattern
    if isinstance(pattern, (Graph, GraphModule)):
        return Pattern.from_graph(pattern)
    if isinstance(pattern, (list, tuple)):
        return Pattern.sequence(*pattern)
    raise TypeError(
        f"a pattern is a Pattern, a list of ops ([aten.addmm.default, aten.relu.default]) or a torch.fx Graph, "
        f"got {type(pattern).__name__}"
    )


def _step(step: Any, index: int) -> frozenset[OpOverload]:
    ops = step if isinstance(step, Collection) and not isinstance(step, (str, OpOverloadPacket)) else [step]
    found: set[OpOverload] = set()
    for op in ops:
        overloads = overloads_of(op)
        if overloads is None:
            raise TypeError(
                f"pattern step {index} holds {op!r}, which is not a torch op; use an overload "
                "(torch.ops.aten.relu.default), a packet (torch.ops.aten.relu) or a set of them"
            )
        found.update(overloads)
    if not found:
        raise ValueError(f"pattern step {index} is empty; give at least one op")
    return frozenset(found)


def _short(target: Any) -> str:
    """``addmm`` for ``aten.addmm.default``: pattern names read like the ops."""
    if isinstance(target, OpOverload):
        return str(target.overloadpacket.__name__)
    return getattr(target, "__name__", str(target))


@dataclass(frozen=True)
class PatternMatch:
    """One match of a pattern: its nodes, in graph order."""

    pattern: str
    nodes: tuple[Node, ...]


def find_pattern_matches(
    program: ExportedProgram | GraphModule | Graph, patterns: Sequence[PatternLike]
) -> list[PatternMatch]:
    """The matches of ``patterns`` in a program's graph that a partitioner can use, in graph order.

    Overlaps, matches that would make a cycle, and matches that would make one together are
    resolved as the module's docstring says. Control-flow sub-graphs are not searched.
    """
    graph = _graph(program)
    return _resolve(graph, [as_pattern(p) for p in patterns])[0]


def _graph(program: ExportedProgram | GraphModule | Graph) -> Graph:
    if isinstance(program, (ExportedProgram, GraphModule)):
        return program.graph
    if isinstance(program, Graph):
        return program
    raise TypeError(
        f"find_pattern_matches takes an ExportedProgram, a GraphModule or a Graph, got {type(program).__name__}"
    )


def _resolve(graph: Graph, patterns: Sequence[Pattern]) -> tuple[list[PatternMatch], dict[Node, str]]:
    """The matches kept, in graph order, and for the nodes of matches dropped, why (the first reason)."""
    index = {node: position for position, node in enumerate(graph.nodes)}
    taken: dict[Node, PatternMatch] = {}
    kept: list[PatternMatch] = []
    refused: dict[Node, str] = {}
    for pattern in patterns:
        for nodes in _candidates(pattern, graph, index):
            match = PatternMatch(pattern.name, nodes)
            first = next((taken[node] for node in nodes if node in taken), None)
            if first is not None:
                why = f"overlaps the match of {first.pattern!r} at {first.nodes[0].name!r}, taken first"
                _refuse(refused, match, why)
                continue
            kept.append(match)
            taken.update(dict.fromkeys(nodes, match))
    while True:
        cycle = _cycle_of_matches(graph, kept)
        if not cycle:
            break
        last = max(cycle, key=kept.index)
        other = next((m for m in cycle if m is not last), None)
        kept.remove(last)
        for node in last.nodes:
            del taken[node]
        if other is None:  # a graph match two of whose nodes a path outside it joins
            why = f"{CYCLE} on its own"
        else:
            why = f"together with the match of {other.pattern!r} at {other.nodes[0].name!r} {CYCLE}"
        _refuse(refused, last, why)
    return sorted(kept, key=lambda m: index[m.nodes[0]]), refused


def _refuse(refused: dict[Node, str], match: PatternMatch, why: str) -> None:
    for node in match.nodes:
        refused.setdefault(node, f"its match of pattern {match.pattern!r} at {match.nodes[0].name!r} {why}")


def _candidates(pattern: Pattern, graph: Graph, index: dict[Node, int]) -> list[tuple[Node, ...]]:
    """Every match of one pattern, as nodes in graph order, the matches in graph order (duplicates once)."""
    if pattern.graph is not None:
        found = _graph_matches(pattern.graph, graph)
    else:
        found = [chain for node in graph.nodes if (chain := _chain(pattern.steps, node))]
    unique = {frozenset(nodes): tuple(sorted(nodes, key=index.__getitem__)) for nodes in found}
    return sorted(unique.values(), key=lambda nodes: [index[n] for n in nodes])


def _chain(steps: tuple[frozenset[OpOverload], ...], node: Node) -> list[Node] | None:
    """The nodes of an op sequence starting at ``node``, or None."""
    if node.op != "call_function" or node.target not in steps[0]:
        return None
    chain = [node]
    for step in steps[1:]:
        users = list(chain[-1].users)
        if len(users) != 1 or users[0].op != "call_function" or users[0].target not in step:
            return None
        chain.append(users[0])
    return chain


def _graph_matches(pattern: Graph, graph: Graph) -> list[list[Node]]:
    from torch.fx.passes.utils.matcher_utils import SubgraphMatcher

    present = {node.target for node in graph.nodes if node.op == "call_function"}
    if any(node.target not in present for node in pattern.nodes if node.op == "call_function"):
        # fx's matcher skips an output op the graph lacks instead of failing, and then finds
        # "matches" without it (or raises a KeyError): an op the graph lacks means no match.
        return []
    matcher = SubgraphMatcher(pattern, remove_overlapping_matches=False)
    return [
        [found for mine, found in match.nodes_map.items() if mine.op not in ("placeholder", "output")]
        for match in matcher.match(graph)
    ]


def _cycle_of_matches(graph: Graph, kept: list[PatternMatch]) -> list[PatternMatch]:
    """Matches on a cycle of the graph with every kept match contracted to one block; [] if it is acyclic."""
    cycle = atoms_on_a_cycle(graph, [match.nodes for match in kept])
    return [] if cycle is None else [kept[index] for index in cycle.atoms]


class PatternPartitioner(CapabilityPartitioner):
    """Claims the matches of op patterns (and, optionally, single nodes) for one backend.

    ``PatternPartitioner([[aten.addmm.default, aten.relu.default], [aten.mm.default]], spec)``:
    patterns in priority order (see the module's docstring for what a pattern is and how
    overlaps are resolved). Each match stays whole; matches and the nodes ``op_support``
    accepts (an :data:`~torchdelegate.partition.capability.OperatorSupport`) are grouped into
    cycle-free partitions as :class:`CapabilityPartitioner` groups them, with its
    ``min_partition_size``. Tags are ``{backend_id}_{n}``; constant data only a partition
    reads goes inside it.
    """

    def __init__(
        self,
        patterns: Sequence[PatternLike],
        spec: DelegationSpec,
        *,
        op_support: OperatorSupport | None = None,
        min_partition_size: int = 1,
    ) -> None:
        if not isinstance(spec, DelegationSpec):
            raise TypeError(f"PatternPartitioner takes (patterns, DelegationSpec), got a {type(spec).__name__} spec")
        self.patterns = [as_pattern(pattern) for pattern in patterns]
        if not self.patterns and op_support is None:
            raise ValueError("PatternPartitioner needs at least one pattern, or an op_support")
        self.op_support = op_support
        super().__init__(
            op_support if op_support is not None else frozenset(), spec, min_partition_size=min_partition_size
        )

    def matches(self, exported_program: ExportedProgram) -> list[PatternMatch]:
        """The matches this partitioner would claim in ``exported_program``, in graph order."""
        return _resolve(exported_program.graph, self.patterns)[0]

    def plan(self, exported_program: ExportedProgram) -> PartitionPlan:
        """Where each computation goes, and why (its match was dropped, or no pattern matched it)."""
        graph = exported_program.graph
        matches, refused = _resolve(graph, self.patterns)
        matched = {node for match in matches for node in match.nodes}
        op_support = self.op_support

        def support(node: Node) -> bool | str:
            if node in matched:
                return True
            why = refused.get(node, f"{NOT_MATCHED} ({op_name(node)})")
            if op_support is None:
                return why
            answer = why_unsupported(op_support, node)
            return True if answer is None else f"{why}; {answer}"

        return self._plan_blocks(UnitGraph(graph, [match.nodes for match in matches]), [(support, self.spec)])
