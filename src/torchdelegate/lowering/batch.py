"""The batch algorithm behind every form of ``to_backend``.

1. partition: each method's partitioner tags a structural copy of its program (``run_partitioner.py``);
2. extract: one pass per graph groups the tagged nodes (``partitions.py``); each group becomes a
   sub-program (``subprogram.py``);
3. preprocess: grouped by backend id, one ``preprocess_multimethod`` call per backend (``preprocess.py``);
4. splice: each graph is rebuilt with delegate calls in place of its groups (``splice.py``);
5. report: what steps 1-3 decided and made, gathered as they went (``lowering_report.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.fx import GraphModule

from torchdelegate.delegate.named_data import NamedDataStore, NamedDataStoreOutput
from torchdelegate.delegate.specs import DelegationSpec
from torchdelegate.errors import PartitionError
from torchdelegate.exported.programs import DELEGATION_TAG, build_program
from torchdelegate.exported.structural_copy import (
    MutableStateCopies,
    copy_module_call_graph,
    fetch_attr,
    make_graph_module,
    with_state,
)
from torchdelegate.lowering.gc_pause import cyclic_gc_paused
from torchdelegate.lowering.held_state import held_state, state_totals
from torchdelegate.lowering.lowering_report import DeferredReport
from torchdelegate.lowering.method_report import Boundary, ReportedProgram, method_report
from torchdelegate.lowering.partitions import GraphPartitions, Partition, find_partitions
from torchdelegate.lowering.preprocess import (
    PartitionJob,
    delegate_name,
    make_delegate,
    merge_named_data,
    preprocess_jobs,
)
from torchdelegate.lowering.report_data import LoweringReport
from torchdelegate.lowering.run_partitioner import PartitionerLike, partition_method, proposing_backends
from torchdelegate.lowering.splice import dropped_targets, rename_signature, splice
from torchdelegate.lowering.subprogram import build_subprogram
from torchdelegate.lowering.validation import validation_enabled
from torchdelegate.partition.plan import PartitionPlan, plan_from_tags


@dataclass(eq=False)
class _GraphPlan:
    gm: GraphModule
    found: GraphPartitions
    children: dict[str, _GraphPlan] = field(default_factory=dict)
    ordered_jobs: list[PartitionJob] = field(default_factory=list)
    """This graph's jobs and its sub-graphs', in topological order."""


@dataclass(eq=False)
class _MethodPlan:
    method: str
    program: ExportedProgram
    root: _GraphPlan
    backends: list[str]
    reported: ReportedProgram  # what the report reads of the caller's program (or of the tagged one, unchecked)
    plan: PartitionPlan
    boundaries: dict[str, Boundary]


@dataclass
class Lowering:
    """What one batch lowering produced: every method's program, the merged named data, the report
    (made when first asked for) and the methods it lowered."""

    programs: dict[str, ExportedProgram]
    named_data: NamedDataStoreOutput
    report: DeferredReport
    lowered_methods: list[str]


def lower(
    programs: Mapping[str, ExportedProgram],
    partitioners: Mapping[str, PartitionerLike],
    *,
    named_data: NamedDataStore | None = None,
    copy_mutable_state: bool = True,
    stage: int = 0,
) -> Lowering:
    """The batch algorithm: partition and extract every method, preprocess once per backend, splice;
    the lowered programs and the named data the backends produced.

    ``named_data`` is the program's live store: results are merged into it and every
    delegate reads it at ``init``, so delegates of several stages see each other's data.
    With ``copy_mutable_state``, buffers any method writes get private copies in every
    method (one per tensor), so the programs returned never write into the caller's.
    ``stage`` (from 1) names the stage of a partitioner list in messages.
    """
    if not isinstance(programs, Mapping) or not isinstance(partitioners, Mapping):
        raise TypeError("to_backend(method_to_program, method_to_partitioner) takes two mappings")
    unknown = [m for m in partitioners if m not in programs]
    if unknown:
        raise PartitionError(
            f"partitioners given for unknown method(s) {', '.join(map(repr, unknown))}; "
            f"the methods are {', '.join(map(repr, programs))}"
        )
    for method, program in programs.items():
        checked_program(program, f"method {method!r}")
    mutated = {m: frozenset(p.graph_signature.buffers_to_mutate.values()) for m, p in programs.items()}
    plans: list[_MethodPlan] = []
    jobs: list[PartitionJob] = []
    state_copies = MutableStateCopies(enabled=copy_mutable_state)
    for method, program in programs.items():
        if method in partitioners:
            elsewhere = frozenset().union(*(f for m, f in mutated.items() if m != method))
            plans.append(_plan_method(method, program, partitioners[method], jobs, state_copies, elsewhere))
    _check_owned_buffers_not_shared(jobs, programs)
    preprocess_jobs(jobs)
    store = named_data if named_data is not None else NamedDataStore()
    merge_named_data(store, jobs, stage)
    for job in jobs:
        job.delegate = make_delegate(job, store)
    all_mutated = frozenset().union(*mutated.values())
    lowered = dict(programs)
    with cyclic_gc_paused():
        for plan in plans:
            lowered[plan.method] = _splice_method(plan, state_copies, all_mutated)
        if copy_mutable_state:
            for method, program in programs.items():
                if method not in partitioners:
                    lowered[method] = with_state(program, lambda fqn, t: state_copies(t) if fqn in all_mutated else t)
    report = _report(programs, plans, jobs)
    return Lowering(lowered, store.get_named_data_store_output(), report, [plan.method for plan in plans])


def _report(
    programs: Mapping[str, ExportedProgram], plans: list[_MethodPlan], jobs: list[PartitionJob]
) -> DeferredReport:
    """The methods' reports, with what each partition compiled to and how the compile cache answered;
    what compiled is read now, the rest when the report is first asked for."""
    sizes: dict[str, dict[str, int]] = {}
    cache: dict[str, dict[str, str | None]] = {}
    info: dict[str, dict[str, Any]] = {}
    for job in jobs:
        assert job.delegate is not None
        tag, meta = job.partition.tag, job.delegate.meta
        sizes.setdefault(job.method, {})[tag] = len(job.delegate.processed_bytes)
        cache.setdefault(job.method, {})[tag] = meta.get("compile_cache")
        info.setdefault(job.method, {})[tag] = meta.get("delegate_info")
    facts = [(plan.method, plan.reported, plan.plan, plan.boundaries) for plan in plans]
    held = held_state(programs)
    backends = list(dict.fromkeys(backend for plan in plans for backend in plan.backends))

    def make() -> LoweringReport:
        with cyclic_gc_paused():
            methods = {method: method_report(method, read, plan, found) for method, read, plan, found in facts}
        per_method, unique = state_totals(held)
        return LoweringReport(backends, methods, per_method, unique).with_blob_sizes(sizes, cache, info)

    return DeferredReport(make, held)


def _check_owned_buffers_not_shared(jobs: list[PartitionJob], programs: Mapping[str, ExportedProgram]) -> None:
    """A delegate's own state is private: no other method may use that buffer."""
    buffers = {m: set(p.graph_signature.inputs_to_buffers.values()) for m, p in programs.items()}
    for job in jobs:
        owned = job.subprogram.graph_signature.buffers_to_mutate.values()
        for fqn in owned:
            other = next((m for m in programs if m != job.method and fqn in buffers[m]), None)
            if other is not None:
                raise PartitionError(
                    f"buffer {fqn!r} would be the private state of delegate {delegate_name(job)!r}, but method "
                    f"{other!r} uses it too and would not see its updates; leave the buffer untagged (the "
                    "delegate then returns its new value and the methods share it)"
                )


def checked_program(program: Any, what: str) -> ExportedProgram:
    if not isinstance(program, ExportedProgram):
        raise TypeError(f"{what} must be a torch.export.ExportedProgram, got {type(program).__name__}")
    return program


def _plan_method(
    method: str,
    program: ExportedProgram,
    partitioner: PartitionerLike,
    jobs: list[PartitionJob],
    state_copies: MutableStateCopies,
    mutated_elsewhere: frozenset[str],
) -> _MethodPlan:
    result = partition_method(method, program, partitioner)
    tagged = result.tagged_exported_program
    where = f"method {method!r}"
    context = _PlanContext(method, tagged, result.partition_tags, state_copies, mutated_elsewhere)
    backends = proposing_backends(partitioner, result)
    with cyclic_gc_paused():
        root = _plan_graph(context, tagged.graph_module, True, where)
        plan = result.plan
        if plan is None or not plan.matches_tags(tagged):
            plan = plan_from_tags(tagged, result.partition_tags, type(partitioner).__name__, backends)
        boundaries = {partition.tag: Boundary.of(partition) for partition in root.found.partitions}
    jobs.extend(root.ordered_jobs)
    # Checked to be the caller's graph, tags aside: the report reads that one, which outlives this lowering.
    reported = ReportedProgram.of(program if validation_enabled() else tagged)
    return _MethodPlan(method, tagged, root, backends, reported, plan, boundaries)


@dataclass(frozen=True)
class _PlanContext:
    """What planning every graph of one method needs."""

    method: str
    program: ExportedProgram
    tags: Mapping[str, DelegationSpec]
    state_copies: MutableStateCopies
    mutated_elsewhere: frozenset[str]


def _plan_graph(context: _PlanContext, gm: GraphModule, top_level: bool, where: str) -> _GraphPlan:
    """Find the partitions of ``gm`` and of the sub-graphs it keeps, and build their sub-programs.

    The plan's ``ordered_jobs`` are topological: a sub-graph's at its control-flow op.
    """
    children: dict[str, _GraphPlan] = {}
    for node in gm.graph.nodes:
        if node.op != "get_attr" or node.target in children:
            continue
        value = fetch_attr(gm, str(node.target))
        delegated_whole = any(user.meta.get(DELEGATION_TAG) is not None for user in node.users)
        if isinstance(value, GraphModule) and not delegated_whole:
            children[str(node.target)] = _plan_graph(context, value, False, f"{where}, sub-graph {node.target!r}")
    signature = context.program.graph_signature if top_level else None
    mutated_elsewhere = context.mutated_elsewhere if top_level else frozenset()
    found = find_partitions(gm, signature, context.tags, where, mutated_elsewhere)
    output_specs = signature.output_specs if signature else None
    own_jobs = {
        partition: PartitionJob(
            context.method,
            partition,
            build_subprogram(gm, partition, found, context.program, output_specs, context.state_copies),
        )
        for partition in found.partitions
    }
    ordered: list[PartitionJob] = []
    emitted: set[str] = set()
    for unit in found.order:
        if isinstance(unit, Partition):
            ordered.append(own_jobs[unit])
        elif unit.op == "get_attr" and str(unit.target) in children and str(unit.target) not in emitted:
            emitted.add(str(unit.target))
            ordered.extend(children[str(unit.target)].ordered_jobs)
    return _GraphPlan(gm, found, children, ordered)


def _splice_graph(
    plan: _GraphPlan, reserved: frozenset[str] = frozenset()
) -> tuple[torch.fx.Graph, dict[str, Any], dict[str, str]]:
    submodules = {}
    for target, child in plan.children.items():
        graph, attrs, _ = _splice_graph(child)
        submodules[target] = make_graph_module(attrs, graph, child.gm)
    delegates = {}
    for job in plan.ordered_jobs:  # the sub-graphs' too: splice looks up only its own
        assert job.delegate is not None
        delegates[job.partition] = job.delegate
    return splice(plan.gm, plan.found, delegates, submodules, reserved)


def _splice_method(plan: _MethodPlan, state_copies: MutableStateCopies, mutated: frozenset[str]) -> ExportedProgram:
    """The lowered program; buffers any method writes (``mutated``) are passed to ``state_copies``."""
    program = plan.program
    state_roots = frozenset(s.target.split(".")[0] for s in program.graph_signature.input_specs if s.target)
    graph, attrs, renamed = _splice_graph(plan.root, state_roots)
    found = plan.root.found
    dropped = set(dropped_targets(found))
    signature = rename_signature(program.graph_signature, renamed, {n.name for n in found.dropped}, found.owned_outputs)
    names = {node.name for node in graph.nodes}

    def kept(tensors: Mapping[str, Any]) -> dict[str, Any]:
        return {k: state_copies(v) if k in mutated else v for k, v in tensors.items() if k not in dropped}

    return build_program(
        program,
        attrs,
        graph,
        signature,
        kept(program.state_dict),
        kept(program.constants),
        range_constraints=dict(program.range_constraints),
        module_call_graph=_module_call_graph(program, renamed, names),
        with_meta=True,
    )


def _module_call_graph(program: ExportedProgram, renamed: Mapping[str, str], names: set[str]) -> list[Any]:
    """The module call graph with renamed values; entries of submodules whose values left are dropped."""
    entries = []
    for entry in copy_module_call_graph(program.module_call_graph, renamed):
        signature = entry.signature
        if entry.fqn and signature is not None:
            arguments = [*signature.inputs, *signature.outputs]
            if any(getattr(a, "name", None) not in (None, *names) for a in arguments):
                continue
        entries.append(entry)
    return entries
