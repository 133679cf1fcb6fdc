"""Preprocess: each partition's sub-program handed to its backend, and what comes back checked.

Partitions are grouped by backend id in order of first appearance: one
``preprocess_multimethod`` call per backend, inside a compile run that says who compiles its
units (a ``preprocessing`` block's compiler, else the environment's compile cache) and names
each by its tag (``delegate/compile_units.py``). Results are checked (type, count, bytes,
``delegate_info``), and so is each sub-program, which stays the delegate's
``original_module``. Named data from every result merges into one store.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch.export import ExportedProgram

from torchdelegate.delegate.backend_details import BackendDetails, get_backend
from torchdelegate.delegate.compile_units import (
    CompileRun,
    PartitionCompiler,
    compile_run,
    current_compiler,
)
from torchdelegate.delegate.lowered_module import LoweredBackendModule
from torchdelegate.delegate.named_data import NamedDataStore
from torchdelegate.delegate.preprocess_checks import checked_delegate_info, checked_result
from torchdelegate.delegate.preprocess_result import PreprocessResult
from torchdelegate.delegate.progress import expect_partitions, partitions_compiled_until, steps_done
from torchdelegate.delegate.specs import CompileSpec
from torchdelegate.errors import BackendNotFoundError, NamedDataConflictError, PreprocessError
from torchdelegate.lowering.partitions import Partition
from torchdelegate.lowering.validation import program_fingerprint


@dataclass(eq=False)
class PartitionJob:
    """One partition on its way to a backend and back."""

    method: str
    partition: Partition
    subprogram: ExportedProgram
    result: PreprocessResult | None = None
    delegate: LoweredBackendModule | None = None
    cache: str | None = None


def preprocess_jobs(jobs: list[PartitionJob]) -> None:
    """One ``preprocess_multimethod`` call per backend, in order of first appearance."""
    by_backend: dict[str, list[PartitionJob]] = {}
    for job in jobs:
        by_backend.setdefault(job.partition.spec.backend_id, []).append(job)
    expect_partitions(len(jobs))
    compiler = _compiler() if jobs else None
    for backend_id, backend_jobs in by_backend.items():
        until = steps_done() + len(backend_jobs)
        try:
            backend = get_backend(backend_id)
        except BackendNotFoundError as e:
            job = backend_jobs[0]
            raise BackendNotFoundError(f"partition {job.partition.tag!r} of method {job.method!r}: {e}") from e
        before = [program_fingerprint(job.subprogram) for job in backend_jobs]
        _preprocess_multimethod(backend, backend_jobs, compiler)
        partitions_compiled_until(until, backend_id, f"{len(backend_jobs)} partition(s)")
        for job, fingerprint in zip(backend_jobs, before, strict=True):
            check_unchanged(job.subprogram, fingerprint, backend_id, f"partition {job.partition.tag!r}", job.method)


def _compiler() -> PartitionCompiler | None:
    """Who compiles units: a ``preprocessing`` block's compiler, else the environment's (its compile cache)."""
    compiler = current_compiler()
    if compiler is None:
        from torchdelegate.compile.options import environment_compiler  # it starts pools: imported when needed

        compiler = environment_compiler()
    return compiler


def check_unchanged(program: ExportedProgram, before: object, backend_id: str, what: str, method: str) -> None:
    if program_fingerprint(program) != before:
        raise PreprocessError(
            f"backend {backend_id!r} changed the sub-program of {what} (method {method!r}) that it was given; "
            "it is kept as the delegate's original_module, so preprocess must leave it unchanged: transform "
            "a structural copy instead (torchdelegate.copy_program(edge_program))"
        )


def _preprocess_multimethod(
    backend: type[BackendDetails], jobs: list[PartitionJob], compiler: PartitionCompiler | None
) -> None:
    programs: dict[str, list[ExportedProgram]] = {}
    specs: dict[str, list[list[CompileSpec]]] = {}
    tags: dict[str, list[str]] = {}
    for job in jobs:
        programs.setdefault(job.method, []).append(job.subprogram)
        specs.setdefault(job.method, []).append(list(job.partition.spec.compile_specs))
        tags.setdefault(job.method, []).append(job.partition.tag)
    backend_id = backend.backend_id
    try:
        with compile_run(CompileRun(compiler, tags)) as run:
            results = backend.preprocess_multimethod(programs, specs)
    except PreprocessError:
        raise  # the compile units' and the default linking's own, which name the partition
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
        job.result = checked_result(method_results[position[job.method]], backend_id, job.method)
        job.cache = run.answers.get((job.method, position[job.method]))
        position[job.method] += 1


def merge_named_data(store: NamedDataStore, jobs: list[PartitionJob], stage: int) -> None:
    """Merge every result's named data into ``store``, each output once (a backend may share one)."""
    merged: set[int] = set()
    for job in jobs:
        assert job.result is not None
        output = job.result.data_store_output
        if output is None or id(output) in merged:
            continue
        merged.add(id(output))
        backend_id = job.partition.spec.backend_id
        owner = f"{delegate_name(job)} on {backend_id}" + (f" in stage {stage}" if stage else "")
        try:
            store.merge(output, owner=owner)
        except NamedDataConflictError as e:
            raise PreprocessError(f"backend {backend_id!r}: {e}") from e


def delegate_name(job: PartitionJob) -> str:
    return f"{job.method}:{job.partition.tag}"


def delegate_meta(result: PreprocessResult, method: str, tag: str, backend_id: str) -> dict[str, Any]:
    meta = {"method": method, "tag": tag, "debug_handle_map": result.debug_handle_map}
    info = checked_delegate_info(result, backend_id, f"partition {tag!r} of method {method!r}")
    return meta if info is None else {**meta, "delegate_info": info}


def make_delegate(job: PartitionJob, named_data: NamedDataStore) -> LoweredBackendModule:
    assert job.result is not None
    spec = job.partition.spec
    return LoweredBackendModule(
        spec.backend_id,
        job.result.processed_bytes,
        spec.compile_specs,
        job.subprogram,
        job.result.data_store_output,
        named_data=named_data,
        meta=delegate_meta(job.result, job.method, job.partition.tag, spec.backend_id) | {"compile_cache": job.cache},
        name=delegate_name(job),
    )
