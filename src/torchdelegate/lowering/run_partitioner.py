"""Running a method's partitioner: on a structural copy of its program, its result checked.

A partitioner may only tag (checked node by node unless validation is disabled; inside
``validation_disabled()`` a changed program is completed and verified instead). A
``DelegationSpec`` in a partitioner's place tags the whole method for one backend.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch.export import ExportedProgram

from torchdelegate.delegate.specs import DelegationSpec
from torchdelegate.errors import GraphChangedError, PartitionError, TorchDelegateError
from torchdelegate.exported.programs import DELEGATION_TAG
from torchdelegate.exported.structural_copy import copy_program
from torchdelegate.lowering.gc_pause import cyclic_gc_paused
from torchdelegate.lowering.validation import complete_changed_program, first_graph_difference, validation_enabled
from torchdelegate.partition.capability import CapabilityPartitioner
from torchdelegate.partition.contract import Partitioner, PartitionResult
from torchdelegate.partition.tagging import tag_constant_data

WHOLE_PROGRAM_TAG = "whole_program"

PartitionerLike = Partitioner | DelegationSpec


def partition_method(method: str, program: ExportedProgram, partitioner: PartitionerLike) -> PartitionResult:
    """Run the partitioner on a structural copy; check it only tagged the graph."""
    with cyclic_gc_paused():
        tagged = copy_program(program)
    if isinstance(partitioner, DelegationSpec):
        return _tag_whole_program(tagged, partitioner)
    if isinstance(partitioner, type) and issubclass(partitioner, Partitioner):
        raise TypeError(
            f"method {method!r}: got the class {partitioner.__name__}; pass an instance: {partitioner.__name__}(...)"
        )
    if not isinstance(partitioner, Partitioner):
        hint = ""
        if isinstance(partitioner, str):
            hint = f"; for the whole method on one backend: DelegationSpec({partitioner!r})"
        elif isinstance(partitioner, (list, tuple)):
            hint = (
                "; partitioners applied in order (a list) go to EdgeProgramManager.to_backend or "
                "to_edge_transform_and_lower, or join their backends in one CapabilityPartitioner"
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
        with cyclic_gc_paused():
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
        with cyclic_gc_paused():
            complete_changed_program(result.tagged_exported_program, name, method)
    return result


def proposing_backends(partitioner: PartitionerLike, result: PartitionResult) -> list[str]:
    """The backends a partitioner asked, in priority order: a capability partitioner's, else those its
    tags name (else its default spec's), which is who a report says left a node."""
    if isinstance(partitioner, DelegationSpec):
        return [partitioner.backend_id]
    if isinstance(partitioner, CapabilityPartitioner):
        return list(dict.fromkeys(spec.backend_id for _, spec in partitioner.backends))
    named = list(dict.fromkeys(spec.backend_id for spec in result.partition_tags.values()))
    if not named and hasattr(partitioner, "spec"):
        named = [partitioner.spec.backend_id]
    return named


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
