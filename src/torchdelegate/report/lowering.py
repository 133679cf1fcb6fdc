"""Lowering with a capability partitioner, and the report of what went where.

The plan of each method is made once from the manager's programs (which planning does not
change), the lowering applies the same partitioner, and the report then gets each
partition's compiled size and its backend's ``delegate_info`` from the delegates it made.
"""

from __future__ import annotations

from torchdelegate.lowering.edge_program_manager import EdgeProgramManager
from torchdelegate.partition.capability import CapabilityPartitioner
from torchdelegate.report.data import LoweringReport, method_report, state_bytes


def plan_report(manager: EdgeProgramManager, partitioner: CapabilityPartitioner) -> LoweringReport:
    """What ``partitioner`` would do to every method of ``manager``, without lowering."""
    if not isinstance(partitioner, CapabilityPartitioner):
        raise TypeError(
            f"a partition report needs one CapabilityPartitioner, got {type(partitioner).__name__}; for backends "
            "in priority order, join their partitioners' (support, spec) pairs: "
            "CapabilityPartitioner([*OnnxRuntimePartitioner().backends, *ReferencePartitioner().backends])"
        )
    backends = [spec.backend_id for _, spec in partitioner.backends]
    programs = {method: manager.exported_program(method) for method in manager.methods}
    methods = {
        method: method_report(method, program, partitioner.plan(program)) for method, program in programs.items()
    }
    per_method, unique = state_bytes(programs)
    return LoweringReport(backends, methods, per_method, unique)


def lower_with_report(
    manager: EdgeProgramManager, partitioner: CapabilityPartitioner
) -> tuple[EdgeProgramManager, LoweringReport]:
    """``manager.to_backend(partitioner)`` and its report, blob sizes and compile cache answers included."""
    report = plan_report(manager, partitioner)
    lowered = manager.to_backend(partitioner)
    delegates = lowered.delegates()
    sizes = {m: {str(d.meta.get("tag")): len(d.processed_bytes) for d in ds} for m, ds in delegates.items()}
    cache = {m: {str(d.meta.get("tag")): d.meta.get("compile_cache") for d in ds} for m, ds in delegates.items()}
    info = {m: {str(d.meta.get("tag")): d.meta.get("delegate_info") for d in ds} for m, ds in delegates.items()}
    return lowered, report.with_blob_sizes(sizes, cache, info)
