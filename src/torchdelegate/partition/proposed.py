"""Each backend's proposed partitioner, by backend id: what ``torchdelegate lower --backend ID`` uses.

A backend proposes its partitioner through ``BackendDetails.partitioner(compile_specs)``; the
shipped ones, and any installed through the entry-point group ``torchdelegate.backends``, are
named on the command line alike. From Python, ``CapabilityPartitioner(backend_supports(["onnxruntime",
"reference"]))`` joins several in priority order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from torchdelegate.delegate.backend_details import get_backend
from torchdelegate.delegate.specs import CompileSpec, DelegationSpec
from torchdelegate.errors import BackendUnavailableError
from torchdelegate.partition.capability import CapabilityPartitioner, OperatorSupport


def backend_support(
    backend_id: str, compile_specs: Sequence[CompileSpec] = ()
) -> tuple[OperatorSupport, DelegationSpec]:
    """``(support, DelegationSpec)`` of the partitioner ``backend_id`` proposes."""
    (support, spec), *_ = backend_partitioner(backend_id, compile_specs).backends
    return support, spec


def backend_partitioner(backend_id: str, compile_specs: Sequence[CompileSpec] = ()) -> CapabilityPartitioner:
    """The partitioner ``backend_id`` proposes (its ``ops_to_not_decompose`` included); a clear error for an
    unknown id, a backend this machine cannot run, or one that proposes none the capability engine joins."""
    backend = get_backend(backend_id)  # an unknown id raises, naming the known ones
    if not backend.is_available():
        raise BackendUnavailableError(f"backend {backend_id!r} cannot run here: {backend.needs}")
    partitioner = backend.partitioner(list(compile_specs))
    if not isinstance(partitioner, CapabilityPartitioner):
        raise ValueError(
            f"backend {backend_id!r} proposes a {type(partitioner).__name__}, which cannot be joined with other "
            "backends in priority order; lower with it from Python: to_backend(program, partitioner)"
        )
    return partitioner


def backend_supports(
    backend_ids: Sequence[str], compile_specs: Mapping[str, Sequence[CompileSpec]] | None = None
) -> list[tuple[OperatorSupport, DelegationSpec]]:
    """:func:`backend_support` of each id, in the priority order given."""
    return [p.backends[0] for p in backend_partitioners(backend_ids, compile_specs)]


def backend_partitioners(
    backend_ids: Sequence[str], compile_specs: Mapping[str, Sequence[CompileSpec]] | None = None
) -> list[CapabilityPartitioner]:
    """:func:`backend_partitioner` of each id, in the priority order given."""
    specs = compile_specs or {}
    unknown = sorted(set(specs) - set(backend_ids))
    if unknown:
        raise ValueError(f"compile specs given for {', '.join(map(repr, unknown))}, which is not among the backends")
    return [backend_partitioner(b, specs.get(b, ())) for b in backend_ids]
