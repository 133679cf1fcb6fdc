"""A capability partitioner's plan as a report, without lowering: what it would do, and why.

Lowering emits its own report (``EdgeProgramManager.report``); this is the dry run, for a page
of decisions before anything compiles. Each planned partition's boundary is found by lowering's
own rules over the program with the plan's tags.
"""

from __future__ import annotations

import warnings

from torch.export import ExportedProgram

from torchdelegate.delegate.specs import DelegationSpec
from torchdelegate.lowering.edge_program_manager import EdgeProgramManager
from torchdelegate.lowering.held_state import state_bytes
from torchdelegate.lowering.method_report import Boundary, method_report
from torchdelegate.lowering.partitions import find_partitions
from torchdelegate.lowering.report_data import LoweringReport
from torchdelegate.partition.capability import CapabilityPartitioner
from torchdelegate.partition.plan import PartitionPlan
from torchdelegate.partition.tagging import constant_data_tags


def plan_report(manager: EdgeProgramManager, partitioner: CapabilityPartitioner) -> LoweringReport:
    """What ``partitioner`` would do to every method of ``manager``, without lowering."""
    if not isinstance(partitioner, CapabilityPartitioner):
        raise TypeError(
            f"a partition report needs one CapabilityPartitioner, got {type(partitioner).__name__}; for backends "
            "in priority order, join their partitioners' (support, spec) pairs: "
            "CapabilityPartitioner([*OnnxRuntimePartitioner().backends, *ReferencePartitioner().backends])"
        )
    backends = list(dict.fromkeys(spec.backend_id for _, spec in partitioner.backends))
    programs = {method: manager.exported_program(method) for method in manager.methods}
    methods = {}
    for method, program in programs.items():
        plan = partitioner.plan(program)
        methods[method] = method_report(method, program, plan, _partitions(method, program, plan))
    per_method, unique = state_bytes(programs)
    return LoweringReport(backends, methods, per_method, unique)


def _partitions(method: str, program: ExportedProgram, plan: PartitionPlan) -> dict[str, Boundary]:
    """Each planned partition's boundary by lowering's own rules (inputs, weights carried inside,
    outputs), found over ``program`` with the plan's tags, nothing tagged; a plan lowering would
    refuse (an in-place write into a partition's input) raises the same PartitionError here."""
    nodes = {node.name: node for node in program.graph.nodes}
    tags = {nodes[name]: p.tag for p in plan.partitions for name in p.nodes}
    tags.update(constant_data_tags(program, tags))
    specs = {p.tag: DelegationSpec(p.backend_id) for p in plan.partitions}
    found = find_partitions(program.graph_module, program.graph_signature, specs, f"method {method!r}", tags=tags)
    return {partition.tag: Boundary.of(partition) for partition in found.partitions}


def lower_with_report(
    manager: EdgeProgramManager, partitioner: CapabilityPartitioner
) -> tuple[EdgeProgramManager, LoweringReport]:
    """Deprecated: ``manager.to_backend(partitioner)`` carries its report, ``lowered.report``."""
    warnings.warn(
        "lower_with_report(manager, partitioner) is deprecated: lowered = manager.to_backend(partitioner) "
        "carries its report as lowered.report",
        DeprecationWarning,
        stacklevel=2,
    )
    lowered = manager.to_backend(partitioner)
    assert lowered.report is not None
    return lowered, lowered.report
