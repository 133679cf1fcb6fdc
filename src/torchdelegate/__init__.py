"""torchdelegate: hand parts of a torch.export program to the backends that run them best."""

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from typing import TYPE_CHECKING, Any

from torchdelegate.version import __version__ as __version__

if sys.byteorder != "little":  # pragma: no cover - every platform torch ships for is little-endian
    raise ImportError("torchdelegate files store little-endian data; this machine is big-endian")

if TYPE_CHECKING:
    from torchdelegate.cache.compile_cache import CompileCache
    from torchdelegate.compile.options import preprocessing
    from torchdelegate.delegate.array_runtime import ArrayRuntime
    from torchdelegate.delegate.backend_details import (
        BackendDetails,
        PreprocessResult,
        SharedDataBackend,
        get_backend,
        register_backend,
        registered_backend_ids,
        shared_named_data,
        with_named_data,
    )
    from torchdelegate.delegate.compile_units import current_partition
    from torchdelegate.delegate.delegate_mapping import DelegateMappingBuilder
    from torchdelegate.delegate.lowered_module import LoweredBackendModule, call_delegate, run_original_subprograms
    from torchdelegate.delegate.named_data import (
        DataEntry,
        NamedDataMap,
        NamedDataStore,
        NamedDataStoreOutput,
        NamedDataSummary,
    )
    from torchdelegate.delegate.specs import CompileSpec, DelegationSpec
    from torchdelegate.delegate.trust import TRUSTED_BACKENDS_VARIABLE
    from torchdelegate.errors import (
        BackendNotFoundError,
        BackendRegistrationError,
        BackendUnavailableError,
        CheckpointError,
        DelegateExecutionError,
        FormatError,
        GraphChangedError,
        MethodExecutionError,
        NamedDataConflictError,
        OperatorNotFoundError,
        PartitionError,
        PreprocessError,
        ProgramClosedError,
        ProgramInputError,
        QuantizationError,
        SerializationError,
        TorchDelegateError,
        UntrustedCodeError,
    )
    from torchdelegate.exported.safetensors_weights import SafetensorsWeights
    from torchdelegate.exported.structural_copy import copy_program
    from torchdelegate.exported.weightless_export import bind_weights, export_lazily, weightless
    from torchdelegate.lowering.edge_program_manager import EdgeProgramManager, to_edge, to_edge_transform_and_lower
    from torchdelegate.lowering.lowering_report import LoweringReport, lowering_report
    from torchdelegate.lowering.to_backend import to_backend
    from torchdelegate.lowering.validation import disable_validation, validation_disabled
    from torchdelegate.partition import (
        DELEGATION_TAG,
        NO_COPY,
        CapabilityPartitioner,
        GroupBasedPartitioner,
        Partitioner,
        PartitionPlan,
        PartitionResult,
        Pattern,
        PatternMatch,
        PatternPartitioner,
        find_pattern_matches,
        generate_grouped_partitions_from_list_of_nodes,
        generate_partitions_from_list_of_nodes,
        tag_constant_data,
        tag_mutated_buffers,
    )
    from torchdelegate.quantization.recipes import quantize as quantize
    from torchdelegate.report.inspection import (
        DelegationInfo,
        LoweredSubmodule,
        OperatorDelegation,
        delegate_calls,
        delegation_info,
        format_delegated_graph,
        lowered_module_of,
        lowered_modules,
        lowered_submodules,
        print_delegated_graph,
        undelegated_nodes,
    )
    from torchdelegate.report.structure import graph_structure_difference, same_graph_structure
    from torchdelegate.runtime.program import Program, load

_EXPORTS = {
    "ArrayRuntime": "torchdelegate.delegate.array_runtime",
    "BackendDetails": "torchdelegate.delegate.backend_details",
    "BackendNotFoundError": "torchdelegate.errors",
    "BackendRegistrationError": "torchdelegate.errors",
    "BackendUnavailableError": "torchdelegate.errors",
    "bind_weights": "torchdelegate.exported.weightless_export",
    "call_delegate": "torchdelegate.delegate.lowered_module",
    "CapabilityPartitioner": "torchdelegate.partition",
    "CheckpointError": "torchdelegate.errors",
    "CompileCache": "torchdelegate.cache.compile_cache",
    "CompileSpec": "torchdelegate.delegate.specs",
    "copy_program": "torchdelegate.exported.structural_copy",
    "DataEntry": "torchdelegate.delegate.named_data",
    "DelegateMappingBuilder": "torchdelegate.delegate.delegate_mapping",
    "delegate_calls": "torchdelegate.report.inspection",
    "DelegateExecutionError": "torchdelegate.errors",
    "delegation_info": "torchdelegate.report.inspection",
    "DELEGATION_TAG": "torchdelegate.partition",
    "DelegationInfo": "torchdelegate.report.inspection",
    "DelegationSpec": "torchdelegate.delegate.specs",
    "disable_validation": "torchdelegate.lowering.validation",
    "EdgeProgramManager": "torchdelegate.lowering.edge_program_manager",
    "export_lazily": "torchdelegate.exported.weightless_export",
    "find_pattern_matches": "torchdelegate.partition",
    "generate_grouped_partitions_from_list_of_nodes": "torchdelegate.partition",
    "generate_partitions_from_list_of_nodes": "torchdelegate.partition",
    "GroupBasedPartitioner": "torchdelegate.partition",
    "format_delegated_graph": "torchdelegate.report.inspection",
    "FormatError": "torchdelegate.errors",
    "get_backend": "torchdelegate.delegate.backend_details",
    "graph_structure_difference": "torchdelegate.report.structure",
    "GraphChangedError": "torchdelegate.errors",
    "load": "torchdelegate.runtime.program",
    "lowered_module_of": "torchdelegate.report.inspection",
    "lowered_modules": "torchdelegate.report.inspection",
    "lowered_submodules": "torchdelegate.report.inspection",
    "LoweredBackendModule": "torchdelegate.delegate.lowered_module",
    "LoweredSubmodule": "torchdelegate.report.inspection",
    "MethodExecutionError": "torchdelegate.errors",
    "NamedDataConflictError": "torchdelegate.errors",
    "NamedDataMap": "torchdelegate.delegate.named_data",
    "NamedDataStore": "torchdelegate.delegate.named_data",
    "NamedDataStoreOutput": "torchdelegate.delegate.named_data",
    "NamedDataSummary": "torchdelegate.delegate.named_data",
    "NO_COPY": "torchdelegate.partition",
    "OperatorDelegation": "torchdelegate.report.inspection",
    "OperatorNotFoundError": "torchdelegate.errors",
    "Partitioner": "torchdelegate.partition",
    "PartitionError": "torchdelegate.errors",
    "PartitionPlan": "torchdelegate.partition",
    "PartitionResult": "torchdelegate.partition",
    "Pattern": "torchdelegate.partition",
    "PatternMatch": "torchdelegate.partition",
    "PatternPartitioner": "torchdelegate.partition",
    "PreprocessError": "torchdelegate.errors",
    "preprocessing": "torchdelegate.compile.options",
    "PreprocessResult": "torchdelegate.delegate.backend_details",
    "print_delegated_graph": "torchdelegate.report.inspection",
    "Program": "torchdelegate.runtime.program",
    "ProgramClosedError": "torchdelegate.errors",
    "ProgramInputError": "torchdelegate.errors",
    "QuantizationError": "torchdelegate.errors",
    "quantize": "torchdelegate.quantization.recipes",
    "register_backend": "torchdelegate.delegate.backend_details",
    "registered_backend_ids": "torchdelegate.delegate.backend_details",
    "run_original_subprograms": "torchdelegate.delegate.lowered_module",
    "SafetensorsWeights": "torchdelegate.exported.safetensors_weights",
    "same_graph_structure": "torchdelegate.report.structure",
    "SerializationError": "torchdelegate.errors",
    "SharedDataBackend": "torchdelegate.delegate.backend_details",
    "shared_named_data": "torchdelegate.delegate.backend_details",
    "with_named_data": "torchdelegate.delegate.backend_details",
    "current_partition": "torchdelegate.delegate.compile_units",
    "tag_constant_data": "torchdelegate.partition",
    "tag_mutated_buffers": "torchdelegate.partition",
    "to_backend": "torchdelegate.lowering.to_backend",
    "to_edge": "torchdelegate.lowering.edge_program_manager",
    "to_edge_transform_and_lower": "torchdelegate.lowering.edge_program_manager",
    "TorchDelegateError": "torchdelegate.errors",
    "TRUSTED_BACKENDS_VARIABLE": "torchdelegate.delegate.trust",
    "undelegated_nodes": "torchdelegate.report.inspection",
    "LoweringReport": "torchdelegate.lowering.lowering_report",
    "lowering_report": "torchdelegate.lowering.lowering_report",
    "UntrustedCodeError": "torchdelegate.errors",
    "validation_disabled": "torchdelegate.lowering.validation",
    "weightless": "torchdelegate.exported.weightless_export",
}
"""Each public name and the module that defines it. The package imports none of them until one is
asked for: ``torchdelegate --help``, or a process that only runs a file, does not pay for torch's
export machinery, the lowering pipeline or the quantization code (with that imported, 400 loads
of a file left 1-2 MiB more resident memory behind, torch 2.13)."""


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'torchdelegate' has no attribute {name!r}")
    try:
        value = getattr(importlib.import_module(module), name)
    except ModuleNotFoundError as e:
        if (e.name or "").partition(".")[0] != "torch":
            raise
        from torchdelegate.errors import TorchRequiredError

        # torchdelegate-runtime installs no torch: lowering and the torch-side names say what to install
        raise TorchRequiredError(
            f"torchdelegate.{name} needs torch, which cannot be imported here ({e}): pip install torchdelegate "
            "(the full distribution; torchdelegate-runtime only runs files)"
        ) from e
    globals()[name] = value
    return value


# Modules that moved into their layer's folder: the old path is the new module, with a warning, until
# the next release.
_MOVED_MODULES = {
    "torchdelegate.backends.linear": "torchdelegate.backends.linear_recomposition",
    "torchdelegate.cli.model_explorer": "torchdelegate.cli.explorer_server",
    "torchdelegate.demo.checkpoint": "torchdelegate.demo.gpt2_checkpoint",
    "torchdelegate.demo.session": "torchdelegate.demo.walkthrough",
    "torchdelegate.partition.partitioner": "torchdelegate.partition.contract",
    "torchdelegate.backends.support": "torchdelegate.partition.proposed",
    "torchdelegate.backend": "torchdelegate.delegate.backend_details",
    "torchdelegate.compile.cache": "torchdelegate.cache.compile_cache",
    "torchdelegate.compile.entry": "torchdelegate.cache.compiled_entry",
    "torchdelegate.data": "torchdelegate.delegate.named_data",
    "torchdelegate.edge_program_manager": "torchdelegate.lowering.edge_program_manager",
    "torchdelegate.inspection": "torchdelegate.report.inspection",
    "torchdelegate.lowered_module": "torchdelegate.delegate.lowered_module",
    "torchdelegate.lowering.compile_units": "torchdelegate.delegate.compile_units",
    "torchdelegate.compile.units": "torchdelegate.delegate.compile_units",
    "torchdelegate.lowering.exported_programs": "torchdelegate.exported.programs",
    "torchdelegate.lowering.structural_copy": "torchdelegate.exported.structural_copy",
    "torchdelegate.machine_cache": "torchdelegate.cache.machine_cache",
    "torchdelegate.progress": "torchdelegate.delegate.progress",
    "torchdelegate.report.data": "torchdelegate.lowering.lowering_report",
    "torchdelegate.serialize.generated_source": "torchdelegate.exported.generated_source",
    "torchdelegate.specs": "torchdelegate.delegate.specs",
    "torchdelegate.structure": "torchdelegate.report.structure",
    "torchdelegate.torch_warnings": "torchdelegate.exported.torch_warnings",
    "torchdelegate.trust": "torchdelegate.delegate.trust",
}


class _MovedModule(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds a moved module under its old name: the module itself, after a ``DeprecationWarning``."""

    def __init__(self) -> None:
        self._originals: dict[str, tuple[str, Any]] = {}

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if _MOVED_MODULES.get(fullname) is None:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        moved = _MOVED_MODULES[spec.name]
        warnings.warn(
            f"{spec.name} moved to {moved}; import from there (the old name goes in the next release)",
            DeprecationWarning,
            stacklevel=2,
        )
        module = importlib.import_module(str(moved))
        self._originals[spec.name] = (module.__name__, module.__spec__)
        return module

    def exec_module(self, module: Any) -> None:
        # the moved module has run already; importing it under its old name renamed it: name it back
        module.__name__, module.__spec__ = self._originals.pop(module.__spec__.name)


sys.meta_path.append(_MovedModule())


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


__all__ = [
    "DELEGATION_TAG",
    "NO_COPY",
    "ArrayRuntime",
    "BackendDetails",
    "BackendNotFoundError",
    "BackendRegistrationError",
    "BackendUnavailableError",
    "CapabilityPartitioner",
    "CheckpointError",
    "SafetensorsWeights",
    "bind_weights",
    "export_lazily",
    "weightless",
    "DelegateMappingBuilder",
    "CompileCache",
    "CompileSpec",
    "DataEntry",
    "DelegateExecutionError",
    "DelegationInfo",
    "DelegationSpec",
    "EdgeProgramManager",
    "FormatError",
    "GraphChangedError",
    "LoweredBackendModule",
    "LoweredSubmodule",
    "LoweringReport",
    "MethodExecutionError",
    "NamedDataConflictError",
    "NamedDataMap",
    "NamedDataStore",
    "NamedDataStoreOutput",
    "NamedDataSummary",
    "OperatorDelegation",
    "OperatorNotFoundError",
    "GroupBasedPartitioner",
    "PartitionError",
    "PartitionPlan",
    "PartitionResult",
    "Partitioner",
    "Pattern",
    "PatternMatch",
    "PatternPartitioner",
    "PreprocessError",
    "PreprocessResult",
    "QuantizationError",
    "Program",
    "ProgramClosedError",
    "ProgramInputError",
    "SerializationError",
    "SharedDataBackend",
    "shared_named_data",
    "with_named_data",
    "current_partition",
    "TorchDelegateError",
    "TRUSTED_BACKENDS_VARIABLE",
    "UntrustedCodeError",
    "call_delegate",
    "copy_program",
    "delegate_calls",
    "delegation_info",
    "disable_validation",
    "find_pattern_matches",
    "format_delegated_graph",
    "generate_grouped_partitions_from_list_of_nodes",
    "generate_partitions_from_list_of_nodes",
    "get_backend",
    "graph_structure_difference",
    "load",
    "lowered_module_of",
    "lowered_modules",
    "lowering_report",
    "lowered_submodules",
    "preprocessing",
    "print_delegated_graph",
    "quantize",
    "register_backend",
    "registered_backend_ids",
    "run_original_subprograms",
    "same_graph_structure",
    "tag_constant_data",
    "tag_mutated_buffers",
    "to_backend",
    "to_edge",
    "to_edge_transform_and_lower",
    "undelegated_nodes",
    "validation_disabled",
]
