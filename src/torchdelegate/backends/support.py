"""Each shipped backend's operator support, by backend id: what a CapabilityPartitioner needs.

``torchdelegate lower --backend onnxruntime --backend reference`` and the demo build their
partitioner from these; from Python, ``CapabilityPartitioner(backend_supports(["onnxruntime",
"reference"]))`` does the same.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from torchdelegate.backend import get_backend
from torchdelegate.errors import BackendUnavailableError
from torchdelegate.partition.capability import OperatorSupport
from torchdelegate.specs import CompileSpec, DelegationSpec

SHIPPED = ("onnxruntime", "inductor", "reference")
_NEEDS = {
    "onnxruntime": "install its runtime with pip install 'torchdelegate[onnxruntime]'",
    "inductor": "AOTInductor needs a C++ compiler (g++ or clang++) on PATH",
    "reference": "torch itself is missing",
}


def backend_support(
    backend_id: str, compile_specs: Sequence[CompileSpec] = ()
) -> tuple[OperatorSupport, DelegationSpec]:
    """``(support, DelegationSpec)`` for a shipped backend; a clear error for others or missing runtimes."""
    if backend_id not in SHIPPED:
        get_backend(backend_id)  # an unknown id raises, naming the known ones
        raise ValueError(
            f"backend {backend_id!r} is registered but is not one of torchdelegate's own ({', '.join(SHIPPED)}), "
            "so its operator support is unknown here; lower it from Python with "
            f"CapabilityPartitioner(support, DelegationSpec({backend_id!r}))"
        )
    backend = get_backend(backend_id)
    if not backend.is_available():
        raise BackendUnavailableError(f"backend {backend_id!r} cannot run here: {_NEEDS[backend_id]}")
    spec = DelegationSpec(backend_id, list(compile_specs))
    if backend_id == "onnxruntime":
        from torchdelegate.backends.onnxruntime import OnnxRuntimePartitioner

        return OnnxRuntimePartitioner().operator_support, spec
    from torchdelegate.backends.reference import reference_support

    return reference_support, spec


def backend_supports(
    backend_ids: Sequence[str], compile_specs: Mapping[str, Sequence[CompileSpec]] | None = None
) -> list[tuple[OperatorSupport, DelegationSpec]]:
    """:func:`backend_support` of each id, in the priority order given."""
    specs = compile_specs or {}
    unknown = sorted(set(specs) - set(backend_ids))
    if unknown:
        raise ValueError(f"compile specs given for {', '.join(map(repr, unknown))}, which is not among the backends")
    return [backend_support(b, specs.get(b, ())) for b in backend_ids]
