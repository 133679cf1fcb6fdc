"""Each shipped backend's operator support, by backend id: what a CapabilityPartitioner needs.

``torchdelegate lower --backend onnxruntime --backend reference`` and the demo build their
partitioner from these; from Python, ``CapabilityPartitioner(backend_supports(["onnxruntime",
"reference"]))`` does the same.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence

from torchdelegate.delegate.backend_details import get_backend
from torchdelegate.delegate.specs import CompileSpec, DelegationSpec
from torchdelegate.errors import BackendUnavailableError
from torchdelegate.partition.capability import CapabilityPartitioner, OperatorSupport

_PARTITIONERS = {  # backend id -> (module, its partitioner), imported only when asked for
    "onnxruntime": ("torchdelegate.backends.onnxruntime", "OnnxRuntimePartitioner"),
    "inductor": ("torchdelegate.backends.inductor", "InductorPartitioner"),
    "reference": ("torchdelegate.backends.reference", "ReferencePartitioner"),
}
SHIPPED = tuple(_PARTITIONERS)
_NEEDS = {
    "onnxruntime": "install its runtime with pip install 'torchdelegate[onnxruntime]'",
    "inductor": "AOTInductor needs a C++ compiler (g++ or clang++) on PATH",
    "reference": "torch itself is missing",
}


def backend_support(
    backend_id: str, compile_specs: Sequence[CompileSpec] = ()
) -> tuple[OperatorSupport, DelegationSpec]:
    """``(support, DelegationSpec)`` of a shipped backend's partitioner; a clear error for others or
    missing runtimes."""
    (support, spec), *_ = backend_partitioner(backend_id, compile_specs).backends
    return support, spec


def backend_partitioner(backend_id: str, compile_specs: Sequence[CompileSpec] = ()) -> CapabilityPartitioner:
    """A shipped backend's own partitioner (its ``ops_to_not_decompose`` included); a clear error for
    others or missing runtimes."""
    if backend_id not in SHIPPED:
        get_backend(backend_id)  # an unknown id raises, naming the known ones
        raise ValueError(
            f"backend {backend_id!r} is registered but is not one of torchdelegate's own ({', '.join(SHIPPED)}), "
            "so its operator support is unknown here; lower it from Python with "
            f"CapabilityPartitioner(support, DelegationSpec({backend_id!r}))"
        )
    if not get_backend(backend_id).is_available():
        raise BackendUnavailableError(f"backend {backend_id!r} cannot run here: {_NEEDS[backend_id]}")
    module, name = _PARTITIONERS[backend_id]
    partitioner: CapabilityPartitioner = getattr(importlib.import_module(module), name)(
        compile_specs=list(compile_specs)
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
