"""``to_backend`` in its three forms (the public entry point; the work is in ``batch.py``)."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from torch.export import ExportedProgram

from torchdelegate.delegate.backend_details import get_backend
from torchdelegate.delegate.compile_units import CompileUnit, compile_in_process
from torchdelegate.delegate.lowered_module import LoweredBackendModule
from torchdelegate.delegate.preprocess_checks import checked_result
from torchdelegate.delegate.specs import CompileSpec
from torchdelegate.exported.structural_copy import copy_program
from torchdelegate.lowering.batch import Lowering, checked_program, lower
from torchdelegate.lowering.lowering_report import attach_report
from torchdelegate.lowering.preprocess import check_unchanged, delegate_meta
from torchdelegate.lowering.run_partitioner import WHOLE_PROGRAM_TAG, PartitionerLike
from torchdelegate.lowering.validation import program_fingerprint


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
    program = copy_program(checked_program(edge_program, "edge_program"))
    before = program_fingerprint(program)
    result = checked_result(
        compile_in_process(backend, CompileUnit("forward", WHOLE_PROGRAM_TAG, program, tuple(specs))),
        backend_id,
        "forward",
    )
    check_unchanged(program, before, backend_id, "the whole program", "forward")
    return LoweredBackendModule(
        backend_id,
        result.processed_bytes,
        specs,
        program,
        result.data_store_output,
        meta=delegate_meta(result, "forward", WHOLE_PROGRAM_TAG, backend_id),
        name=f"forward:{WHOLE_PROGRAM_TAG}",
    )


@to_backend.register
def _(edge_program: ExportedProgram, partitioner: PartitionerLike) -> ExportedProgram:
    return _reported(lower({"forward": edge_program}, {"forward": partitioner}))["forward"]


@to_backend.register(Mapping)
def _(
    method_to_program: Mapping[str, ExportedProgram], method_to_partitioner: Mapping[str, PartitionerLike]
) -> dict[str, ExportedProgram]:
    return _reported(lower(method_to_program, method_to_partitioner))


def _reported(lowering: Lowering) -> dict[str, ExportedProgram]:
    """The lowered programs, each remembered with the report (``lowering_report(program)``)."""
    for method in lowering.lowered_methods:
        attach_report(lowering.programs[method], lowering.report, method)
    return lowering.programs


def _compile_spec_list(compile_specs: Any, backend_id: str) -> list[CompileSpec]:
    specs = list(compile_specs or ())
    for spec in specs:
        if not isinstance(spec, CompileSpec):
            raise TypeError(
                f"compile_specs for backend {backend_id!r} must be CompileSpec objects, got {type(spec).__name__}"
            )
    return specs
