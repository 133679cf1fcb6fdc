"""``to_backend`` in its three forms, and the batch algorithm behind them.

1. partition: each method's partitioner tags a structural copy of its program;
2. extract: one pass per graph groups the tagged nodes; each group becomes a sub-program;
3. preprocess: grouped by backend id, one ``preprocess_multimethod`` call per backend;
4. splice: each graph is rebuilt with delegate calls in place of its groups.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.fx import GraphModule

from torchdelegate.backend import BackendDetails, PreprocessResult, checked_delegate_info, get_backend
from torchdelegate.data import NamedDataStore, NamedDataStoreOutput
from torchdelegate.errors import (
    BackendNotFoundError,
    GraphChangedError,
    NamedDataConflictError,
    PartitionError,
    PreprocessError,
    TorchDelegateError,
)
from torchdelegate.lowered_module import LoweredBackendModule
from torchdelegate.lowering.exported_programs import build_program
from torchdelegate.lowering.partitions import GraphPartitions, Partition, find_partitions
from torchdelegate.lowering.splice import dropped_targets, rename_signature, splice
from torchdelegate.lowering.structural_copy import (
    MutableStateCopies,
    copy_module_call_graph,
    copy_program,
    fetch_attr,
    make_graph_module,
    with_state,
)
from torchdelegate.lowering.subprogram import build_subprogram
from torchdelegate.lowering.validation import (
    complete_changed_program,
    first_graph_difference,
    program_fingerprint,
    validation_enabled,
)
from torchdelegate.partition.partitioner import DELEGATION_TAG, Partitioner, PartitionResult
from torchdelegate.partition.tagging import tag_constant_data
from torchdelegate.progress import expect_partitions, partition_compiled, partitions_compiled_until, steps_done
from torchdelegate.specs import CompileSpec, DelegationSpec

WHOLE_PROGRAM_TAG = "whole_program"

PartitionerLike = Partitioner | DelegationSpec


@dataclass(eq=False)
class _Job:
    """One partition on its way to a backend and back."""

    method: str
    partition: Partition
    subprogram: ExportedProgram
    result: PreprocessResult | None = None
    delegate: LoweredBackendModule | None = None


@dataclass(eq=False)
class _GraphPlan:
    gm: GraphModule
    found: GraphPartitions
    children: dict[str, _GraphPlan] = field(default_factory=dict)
    ordered_jobs: list[_Job] = field(default_factory=list)
    """This graph's jobs and its sub-graphs', in topological order."""


@dataclass(eq=False)
class _MethodPlan:
    method: str
    program: ExportedProgram
    root: _GraphPlan


@functools.singledispatch
def to_backend(*args: Any, **kwargs: Any) -> Any:
    """Lower to backends; dispatches on the first argument.

    - ``to_backend(backend_id, edge_program, compile_specs) -> LoweredBackendModule``:
      the whole program to one backend;
    - ``to_backend(edge_program, partitioner) -> ExportedProgram``: the partitions a
      partitioner tags (a ``DelegationSpec`` instead lowers the whole graph);
    - ``to_backend(method_to_program, method_to_partitioner) -> dict``: several methods at
      once, one ``preprocess_multimethod`` call per backend; methods without a partitioner
      come back unchanged.
    """
    first = args[0] if args else None
    raise TypeError(
        "to_backend(x, ...): x must be a backend id (str), an ExportedProgram, or a mapping of "
        f"method names to ExportedPrograms; got {type(first).__name__}"
    )


@to_backend.register
def _(backend_id: str, edge_program: ExportedProgram, compile_specs: Any = ()) -> LoweredBackendModule:
    backend = get_backend(backend_id)
    specs = _compile_spec_list(compile_specs, backend_id)
    program = copy_program(_check_program(edge_program, "edge_program"))
    before = program_fingerprint(program)
    result = _check_result(
        _preprocess_one(backend, program, specs, "forward", WHOLE_PROGRAM_TAG), backend_id, "forward"
    )
    _check_unchanged(program, before, backend_id, "the whole program", "forward")
    return LoweredBackendModule(
        backend_id,
        result.processed_bytes,
        specs,
        program,
        result.data_store_output,
        meta=_delegate_meta(result, "forward", WHOLE_PROGRAM_TAG, backend_id),
        name=f"forward:{WHOLE_PROGRAM_TAG}",
    )


@to_backend.register
def _(edge_program: ExportedProgram, partitioner: PartitionerLike) -> ExportedProgram:
    return lower_methods({"forward": edge_program}, {"forward": partitioner})["forward"]


@to_backend.register(Mapping)
def _(
    method_to_program: Mapping[str, ExportedProgram], method_to_partitioner: Mapping[str, PartitionerLike]
) -> dict[str, ExportedProgram]:
    return lower_methods(method_to_program, method_to_partitioner)


def lower_methods(
    programs: Mapping[str, ExportedProgram], partitioners: Mapping[str, PartitionerLike]
) -> dict[str, ExportedProgram]:
    """The batch algorithm: partition and extract every method, preprocess once per backend, splice.

    Every delegate sees, at run time, the named data of all results of this lowering.
    """
    return lower(programs, partitioners).programs


@dataclass
class Lowering:
    """What one batch lowering produced: every method's program and the merged named data."""

    programs: dict[str, ExportedProgram]
    named_data: NamedDataStoreOutput


_gc_lock = threading.Lock()
_gc_pauses = 0
_gc_was_enabled = True


@contextlib.contextmanager
def _cyclic_gc_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector while lowering builds graphs (reentrant).

    A full collection walks every live object, and building graphs allocates enough nodes to
    trigger several: with the collector on, lowering two methods together costs 20% more
    than lowering them one by one. Reference counting still frees acyclic garbage. Never
    held around a partitioner's or a backend's code.
    """
    global _gc_pauses, _gc_was_enabled
    with _gc_lock:
        if _gc_pauses == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_pauses += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_pauses -= 1
            if _gc_pauses == 0 and _gc_was_enabled:
                gc.enable()


def lower(
    programs: Mapping[str, ExportedProgram],
    partitioners: Mapping[str, PartitionerLike],
    *,
    named_data: NamedDataStore | None = None,
    copy_mutable_state: bool = True,
    stage: int = 0,
) -> Lowering:
    """:func:`lower_methods`, also returning the named data the backends produced.

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
        _check_program(program, f"method {method!r}")
    mutated = {m: frozenset(p.graph_signature.buffers_to_mutate.values()) for m, p in programs.items()}
    plans: list[_MethodPlan] = []
    jobs: list[_Job] = []
    state_copies = MutableStateCopies(enabled=copy_mutable_state)
    for method, program in programs.items():
        if method in partitioners:
            elsewhere = frozenset().union(*(f for m, f in mutated.items() if m != method))
            plans.append(_plan_method(method, program, partitioners[method], jobs, state_copies, elsewhere))
    _check_owned_buffers_not_shared(jobs, programs)
    _preprocess(jobs)
    store = named_data if named_data is not None else NamedDataStore()
    _merge_named_data(store, jobs, stage)
    for job in jobs:
        job.delegate = _make_delegate(job, store)
    all_mutated = frozenset().union(*mutated.values())
    lowered = dict(programs)
    with _cyclic_gc_paused():
        for plan in plans:
            lowered[plan.method] = _splice_method(plan, state_copies, all_mutated)
        if copy_mutable_state:
            for method, program in programs.items():
                if method not in partitioners:
                    lowered[method] = with_state(program, lambda fqn, t: state_copies(t) if fqn in all_mutated else t)
    return Lowering(lowered, store.get_named_data_store_output())


def _check_owned_buffers_not_shared(jobs: list[_Job], programs: Mapping[str, ExportedProgram]) -> None:
    """A delegate's own state is private: no other method may use that buffer."""
    buffers = {m: set(p.graph_signature.inputs_to_buffers.values()) for m, p in programs.items()}
    for job in jobs:
        owned = job.subprogram.graph_signature.buffers_to_mutate.values()
        for fqn in owned:
            other = next((m for m in programs if m != job.method and fqn in buffers[m]), None)
            if other is not None:
                raise PartitionError(
                    f"buffer {fqn!r} would be the private state of delegate {_delegate_name(job)!r}, but method "
                    f"{other!r} uses it too and would not see its updates; leave the buffer untagged (the "
                    "delegate then returns its new value and the methods share it)"
                )


def _check_program(program: Any, what: str) -> ExportedProgram:
    if not isinstance(program, ExportedProgram):
        raise TypeError(f"{what} must be a torch.export.ExportedProgram, got {type(program).__name__}")
    return program


def _compile_spec_list(compile_specs: Any, backend_id: str) -> list[CompileSpec]:
    specs = list(compile_specs or ())
    for spec in specs:
        if not isinstance(spec, CompileSpec):
            raise TypeError(
                f"compile_specs for backend {backend_id!r} must be CompileSpec objects, got {type(spec).__name__}"
            )
    return specs


def _partition(method: str, program: ExportedProgram, partitioner: PartitionerLike) -> PartitionResult:
    """Run the partitioner on a structural copy; check it only tagged the graph."""
    with _cyclic_gc_paused():
        tagged = copy_program(program)
    if isinstance(partitioner, DelegationSpec):
        return _tag_whole_program(tagged, partitioner)
    if isinstance(partitioner, type) and issubclass(partitioner, Partitioner):
        raise TypeError(
            f"method {method!r}: got the class {partitioner.__name__}; pass an instance: {partitioner.__name__}(...)"
        )
    if not isinstance(partitioner, Partitioner):
        hint = (
            f"; for the whole method on one backend: DelegationSpec({partitioner!r})"
            if isinstance(partitioner, str)
            else ""
        )
        raise TypeError(
            f"method {method!r}: expected a Partitioner or a DelegationSpec, got {type(partitioner).__name__}{hint}"
        )
    name = type(partitioner).__name__
    try:
        result = partitioner.partition(tagged)
    except TorchDelegateError:
        raise
    except Exception as e:
        raise PartitionError(f"partitioner {name} failed on method {method!r}: {e}") from e
    if not isinstance(result, PartitionResult) or not isinstance(result.tagged_exported_program, ExportedProgram):
        raise PartitionError(
            f"partitioner {name} returned {type(result).__name__} for method {method!r}; expected a "
            "PartitionResult holding the tagged ExportedProgram"
        )
    if not isinstance(result.partition_tags, Mapping):
        raise PartitionError(
            f"partitioner {name}: partition_tags is a {type(result.partition_tags).__name__}; expected a dict "
            "of tag -> DelegationSpec"
        )
    for tag, spec in result.partition_tags.items():
        if not isinstance(spec, DelegationSpec):
            raise PartitionError(
                f"partitioner {name}: partition_tags[{tag!r}] is a {type(spec).__name__}, expected a DelegationSpec"
            )
    if validation_enabled():
        with _cyclic_gc_paused():
            difference = first_graph_difference(
                program.graph_module, result.tagged_exported_program.graph_module, f"method {method!r}"
            )
        if difference:
            raise GraphChangedError(
                f"partitioner {name} changed the graph it may only tag: {difference}. Set only "
                "node.meta['delegation_tag']; transform the program before lowering, or lower "
                "inside torchdelegate.validation_disabled() if the change is intended"
            )
    else:
        with _cyclic_gc_paused():
            complete_changed_program(result.tagged_exported_program, name, method)
    return result


def _tag_whole_program(program: ExportedProgram, spec: DelegationSpec) -> PartitionResult:
    """Tag every computation, and the constants they alone read: one delegate for the whole graph.

    Mutated buffers stay with the program (the delegate returns their new values), so that
    methods lowered one delegate each still share them, as they do in eager.
    """
    for node in program.graph.nodes:
        if node.op in ("call_function", "get_attr"):
            node.meta[DELEGATION_TAG] = WHOLE_PROGRAM_TAG
    tag_constant_data(program)
    return PartitionResult(program, {WHOLE_PROGRAM_TAG: spec})


def _plan_method(
    method: str,
    program: ExportedProgram,
    partitioner: PartitionerLike,
    jobs: list[_Job],
    state_copies: MutableStateCopies,
    mutated_elsewhere: frozenset[str],
) -> _MethodPlan:
    result = _partition(method, program, partitioner)
    tagged = result.tagged_exported_program
    where = f"method {method!r}"
    context = _PlanContext(method, tagged, result.partition_tags, state_copies, mutated_elsewhere)
    with _cyclic_gc_paused():
        root = _plan_graph(context, tagged.graph_module, True, where)
    jobs.extend(root.ordered_jobs)
    return _MethodPlan(method, tagged, root)


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
        partition: _Job(
            context.method,
            partition,
            build_subprogram(gm, partition, found, context.program, output_specs, context.state_copies),
        )
        for partition in found.partitions
    }
    ordered: list[_Job] = []
    emitted: set[str] = set()
    for unit in found.order:
        if isinstance(unit, Partition):
            ordered.append(own_jobs[unit])
        elif unit.op == "get_attr" and str(unit.target) in children and str(unit.target) not in emitted:
            emitted.add(str(unit.target))
            ordered.extend(children[str(unit.target)].ordered_jobs)
    return _GraphPlan(gm, found, children, ordered)


def _preprocess(jobs: list[_Job]) -> None:
    """One ``preprocess_multimethod`` call per backend, in order of first appearance."""
    by_backend: dict[str, list[_Job]] = {}
    for job in jobs:
        by_backend.setdefault(job.partition.spec.backend_id, []).append(job)
    expect_partitions(len(jobs))
    for backend_id, backend_jobs in by_backend.items():
        until = steps_done() + len(backend_jobs)
        try:
            backend = get_backend(backend_id)
        except BackendNotFoundError as e:
            job = backend_jobs[0]
            raise BackendNotFoundError(f"partition {job.partition.tag!r} of method {job.method!r}: {e}") from e
        before = [program_fingerprint(job.subprogram) for job in backend_jobs]
        if _overrides_multimethod(backend):
            _preprocess_multimethod(backend, backend_jobs)
            partitions_compiled_until(until, backend_id, f"{len(backend_jobs)} partition(s)")
        else:
            for job in backend_jobs:
                specs = list(job.partition.spec.compile_specs)
                result = _preprocess_one(backend, job.subprogram, specs, job.method, job.partition.tag)
                job.result = _check_result(result, backend_id, job.method)
                partition_compiled(backend_id, f"method {job.method!r}, partition {job.partition.tag!r}")
        for job, fingerprint in zip(backend_jobs, before, strict=True):
            _check_unchanged(job.subprogram, fingerprint, backend_id, f"partition {job.partition.tag!r}", job.method)


def _overrides_multimethod(backend: type[BackendDetails]) -> bool:
    return backend.preprocess_multimethod.__func__ is not BackendDetails.preprocess_multimethod.__func__  # type: ignore[attr-defined]


def _check_unchanged(program: ExportedProgram, before: object, backend_id: str, what: str, method: str) -> None:
    if program_fingerprint(program) != before:
        raise PreprocessError(
            f"backend {backend_id!r} changed the sub-program of {what} (method {method!r}) that it was given; "
            "it is kept as the delegate's original_module, so preprocess must leave it unchanged: transform "
            "a structural copy instead (torchdelegate.copy_program(edge_program))"
        )


def _preprocess_one(
    backend: type[BackendDetails], program: ExportedProgram, specs: list[CompileSpec], method: str, tag: str
) -> Any:
    try:
        return backend.preprocess(program, specs)
    except Exception as e:
        raise PreprocessError(
            f"backend {backend.backend_id!r} failed to preprocess partition {tag!r} of method {method!r}: "
            f"{type(e).__name__}: {e}"
        ) from e


def _preprocess_multimethod(backend: type[BackendDetails], jobs: list[_Job]) -> None:
    programs: dict[str, list[ExportedProgram]] = {}
    specs: dict[str, list[list[CompileSpec]]] = {}
    for job in jobs:
        programs.setdefault(job.method, []).append(job.subprogram)
        specs.setdefault(job.method, []).append(list(job.partition.spec.compile_specs))
    backend_id = backend.backend_id
    try:
        results = backend.preprocess_multimethod(programs, specs)
    except Exception as e:
        raise PreprocessError(
            f"backend {backend_id!r} failed in preprocess_multimethod for method(s) "
            f"{', '.join(map(repr, programs))}: {type(e).__name__}: {e}"
        ) from e
    if not isinstance(results, Mapping) or set(results) != set(programs):
        got = sorted(results) if isinstance(results, Mapping) else type(results).__name__
        raise PreprocessError(
            f"backend {backend_id!r}: preprocess_multimethod returned {got!r}; expected a dict with "
            f"exactly the methods {list(programs)!r}"
        )
    position = dict.fromkeys(programs, 0)
    for job in jobs:
        method_results = results[job.method]
        expected = len(programs[job.method])
        if not isinstance(method_results, (list, tuple)) or len(method_results) != expected:
            count = (
                f"{len(method_results)} results"
                if isinstance(method_results, (list, tuple))
                else type(method_results).__name__
            )
            raise PreprocessError(
                f"backend {backend_id!r}: preprocess_multimethod returned {count} for method "
                f"{job.method!r}; expected a list of {expected} PreprocessResult, one per partition"
            )
        job.result = _check_result(method_results[position[job.method]], backend_id, job.method)
        position[job.method] += 1


def _check_result(result: Any, backend_id: str, method: str) -> PreprocessResult:
    if not isinstance(result, PreprocessResult):
        raise PreprocessError(
            f"backend {backend_id!r} returned {type(result).__name__} for method {method!r}; "
            "expected a PreprocessResult"
        )
    if not isinstance(result.processed_bytes, bytes):
        raise PreprocessError(
            f"backend {backend_id!r}: PreprocessResult.processed_bytes for method {method!r} is a "
            f"{type(result.processed_bytes).__name__}; expected bytes"
        )
    if result.data_store_output is not None and not isinstance(result.data_store_output, NamedDataStoreOutput):
        raise PreprocessError(
            f"backend {backend_id!r}: PreprocessResult.data_store_output for method {method!r} is a "
            f"{type(result.data_store_output).__name__}; use NamedDataStore.get_named_data_store_output()"
        )
    return result


def _merge_named_data(store: NamedDataStore, jobs: list[_Job], stage: int) -> None:
    """Merge every result's named data into ``store``, each output once (a backend may share one)."""
    merged: set[int] = set()
    for job in jobs:
        assert job.result is not None
        output = job.result.data_store_output
        if output is None or id(output) in merged:
            continue
        merged.add(id(output))
        backend_id = job.partition.spec.backend_id
        owner = f"{_delegate_name(job)} on {backend_id}" + (f" in stage {stage}" if stage else "")
        try:
            store.merge(output, owner=owner)
        except NamedDataConflictError as e:
            raise PreprocessError(f"backend {backend_id!r}: {e}") from e


def _delegate_name(job: _Job) -> str:
    return f"{job.method}:{job.partition.tag}"


def _delegate_meta(result: PreprocessResult, method: str, tag: str, backend_id: str) -> dict[str, Any]:
    meta = {"method": method, "tag": tag, "debug_handle_map": result.debug_handle_map}
    info = checked_delegate_info(result, backend_id, f"partition {tag!r} of method {method!r}")
    return meta if info is None else {**meta, "delegate_info": info}


def _make_delegate(job: _Job, named_data: NamedDataStore) -> LoweredBackendModule:
    assert job.result is not None
    spec = job.partition.spec
    return LoweredBackendModule(
        spec.backend_id,
        job.result.processed_bytes,
        spec.compile_specs,
        job.subprogram,
        job.result.data_store_output,
        named_data=named_data,
        meta=_delegate_meta(job.result, job.method, job.partition.tag, spec.backend_id),
        name=_delegate_name(job),
    )


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
