"""Preprocess: each partition's sub-program handed to its backend, and what comes back checked.

Partitions are grouped by backend id in order of first appearance: one
``preprocess_multimethod`` call per backend that overrides it; else each partition is a unit
compiled on its own (``compile/units.py``: perhaps in parallel, perhaps from the compile
cache) and the backend's ``link_results`` sees them all. Results are checked (type, count, bytes,
``delegate_info``), and so is each sub-program, which stays the delegate's
``original_module``. Named data from every result merges into one store.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch.export import ExportedProgram

from torchdelegate.compile.units import CompileUnit, compile_units, failures_named
from torchdelegate.delegate.backend_details import BackendDetails, PreprocessResult, checked_delegate_info, get_backend
from torchdelegate.delegate.lowered_module import LoweredBackendModule
from torchdelegate.delegate.named_data import NamedDataStore, NamedDataStoreOutput
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
            _preprocess_units(backend, backend_jobs)
        for job, fingerprint in zip(backend_jobs, before, strict=True):
            check_unchanged(job.subprogram, fingerprint, backend_id, f"partition {job.partition.tag!r}", job.method)


def _overrides_multimethod(backend: type[BackendDetails]) -> bool:
    return backend.preprocess_multimethod.__func__ is not BackendDetails.preprocess_multimethod.__func__  # type: ignore[attr-defined]


def check_unchanged(program: ExportedProgram, before: object, backend_id: str, what: str, method: str) -> None:
    if program_fingerprint(program) != before:
        raise PreprocessError(
            f"backend {backend_id!r} changed the sub-program of {what} (method {method!r}) that it was given; "
            "it is kept as the delegate's original_module, so preprocess must leave it unchanged: transform "
            "a structural copy instead (torchdelegate.copy_program(edge_program))"
        )


def preprocess_one(
    backend: type[BackendDetails], program: ExportedProgram, specs: list[CompileSpec], method: str, tag: str
) -> Any:
    with failures_named(backend, f"partition {tag!r} of method {method!r}"):
        return backend.preprocess(program, specs)


def _preprocess_units(backend: type[BackendDetails], jobs: list[PartitionJob]) -> None:
    units = [CompileUnit(j.method, j.partition.tag, j.subprogram, tuple(j.partition.spec.compile_specs)) for j in jobs]
    compiled = compile_units(backend, units)
    for job, unit in zip(jobs, compiled, strict=True):
        checked_result(unit.result, backend.backend_id, job.method)
        job.cache = unit.cache
    specs = [list(unit.compile_specs) for unit in units]
    try:
        linked = backend.link_results([unit.result for unit in compiled], specs)
    except Exception as e:
        raise PreprocessError(
            f"backend {backend.backend_id!r} failed to link its {len(jobs)} partition(s): {type(e).__name__}: {e}"
        ) from e
    if not isinstance(linked, (list, tuple)) or len(linked) != len(jobs):
        raise PreprocessError(
            f"backend {backend.backend_id!r}: link_results returned {type(linked).__name__}; expected a list "
            f"of {len(jobs)} PreprocessResult, one per partition in the order given"
        )
    for job, result in zip(jobs, linked, strict=True):
        job.result = checked_result(result, backend.backend_id, job.method)


def _preprocess_multimethod(backend: type[BackendDetails], jobs: list[PartitionJob]) -> None:
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
        job.result = checked_result(method_results[position[job.method]], backend_id, job.method)
        position[job.method] += 1


def checked_result(result: Any, backend_id: str, method: str) -> PreprocessResult:
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
