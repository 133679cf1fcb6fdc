"""torchdelegate: hand parts of a torch.export program to the backends that run them best."""

import importlib
import sys
from typing import TYPE_CHECKING, Any

from torchdelegate.version import __version__ as __version__

if sys.byteorder != "little":  # pragma: no cover - every platform torch ships for is little-endian
    raise ImportError("torchdelegate files store little-endian data; this machine is big-endian")

if TYPE_CHECKING:
    from torchdelegate.backend import (
        BackendDetails,
        PreprocessResult,
        SharedDataBackend,
        get_backend,
        register_backend,
        registered_backend_ids,
    )
    from torchdelegate.compile.cache import CompileCache
    from torchdelegate.compile.options import preprocessing
    from torchdelegate.data import DataEntry, NamedDataMap, NamedDataStore, NamedDataStoreOutput, NamedDataSummary
    from torchdelegate.edge_program_manager import EdgeProgramManager, to_edge, to_edge_transform_and_lower
    from torchdelegate.errors import (
        BackendNotFoundError,
        BackendRegistrationError,
        BackendUnavailableError,
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
    from torchdelegate.inspection import (
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
    from torchdelegate.lowered_module import LoweredBackendModule, call_delegate, run_original_subprograms
    from torchdelegate.lowering.structural_copy import copy_program
    from torchdelegate.lowering.to_backend import to_backend
    from torchdelegate.lowering.validation import disable_validation, validation_disabled
    from torchdelegate.partition import (
        DELEGATION_TAG,
        NO_COPY,
        CapabilityPartitioner,
        Partitioner,
        PartitionPlan,
        PartitionResult,
        Pattern,
        PatternMatch,
        PatternPartitioner,
        find_pattern_matches,
        tag_constant_data,
        tag_mutated_buffers,
    )
    from torchdelegate.quantization.recipes import quantize as quantize
    from torchdelegate.runtime.program import Program, load
    from torchdelegate.specs import CompileSpec, DelegationSpec
    from torchdelegate.structure import graph_structure_difference, same_graph_structure
    from torchdelegate.trust import TRUSTED_BACKENDS_VARIABLE

_EXPORTS = {
    "BackendDetails": "torchdelegate.backend",
    "BackendNotFoundError": "torchdelegate.errors",
    "BackendRegistrationError": "torchdelegate.errors",
    "BackendUnavailableError": "torchdelegate.errors",
    "call_delegate": "torchdelegate.lowered_module",
    "CapabilityPartitioner": "torchdelegate.partition",
    "CompileCache": "torchdelegate.compile.cache",
    "CompileSpec": "torchdelegate.specs",
    "copy_program": "torchdelegate.lowering.structural_copy",
    "DataEntry": "torchdelegate.data",
    "delegate_calls": "torchdelegate.inspection",
    "DelegateExecutionError": "torchdelegate.errors",
    "delegation_info": "torchdelegate.inspection",
    "DELEGATION_TAG": "torchdelegate.partition",
    "DelegationInfo": "torchdelegate.inspection",
    "DelegationSpec": "torchdelegate.specs",
    "disable_validation": "torchdelegate.lowering.validation",
    "EdgeProgramManager": "torchdelegate.edge_program_manager",
    "find_pattern_matches": "torchdelegate.partition",
    "format_delegated_graph": "torchdelegate.inspection",
    "FormatError": "torchdelegate.errors",
    "get_backend": "torchdelegate.backend",
    "graph_structure_difference": "torchdelegate.structure",
    "GraphChangedError": "torchdelegate.errors",
    "load": "torchdelegate.runtime.program",
    "lowered_module_of": "torchdelegate.inspection",
    "lowered_modules": "torchdelegate.inspection",
    "lowered_submodules": "torchdelegate.inspection",
    "LoweredBackendModule": "torchdelegate.lowered_module",
    "LoweredSubmodule": "torchdelegate.inspection",
    "MethodExecutionError": "torchdelegate.errors",
    "NamedDataConflictError": "torchdelegate.errors",
    "NamedDataMap": "torchdelegate.data",
    "NamedDataStore": "torchdelegate.data",
    "NamedDataStoreOutput": "torchdelegate.data",
    "NamedDataSummary": "torchdelegate.data",
    "NO_COPY": "torchdelegate.partition",
    "OperatorDelegation": "torchdelegate.inspection",
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
    "PreprocessResult": "torchdelegate.backend",
    "print_delegated_graph": "torchdelegate.inspection",
    "Program": "torchdelegate.runtime.program",
    "ProgramClosedError": "torchdelegate.errors",
    "ProgramInputError": "torchdelegate.errors",
    "QuantizationError": "torchdelegate.errors",
    "quantize": "torchdelegate.quantization.recipes",
    "register_backend": "torchdelegate.backend",
    "registered_backend_ids": "torchdelegate.backend",
    "run_original_subprograms": "torchdelegate.lowered_module",
    "same_graph_structure": "torchdelegate.structure",
    "SerializationError": "torchdelegate.errors",
    "SharedDataBackend": "torchdelegate.backend",
    "tag_constant_data": "torchdelegate.partition",
    "tag_mutated_buffers": "torchdelegate.partition",
    "to_backend": "torchdelegate.lowering.to_backend",
    "to_edge": "torchdelegate.edge_program_manager",
    "to_edge_transform_and_lower": "torchdelegate.edge_program_manager",
    "TorchDelegateError": "torchdelegate.errors",
    "TRUSTED_BACKENDS_VARIABLE": "torchdelegate.trust",
    "undelegated_nodes": "torchdelegate.inspection",
    "UntrustedCodeError": "torchdelegate.errors",
    "validation_disabled": "torchdelegate.lowering.validation",
}
"""Each public name and the module that defines it. The package imports none of them until one is
asked for: ``torchdelegate --help``, or a process that only runs a file, does not pay for torch's
export machinery, the lowering pipeline or the quantization code (with that imported, 400 loads
of a file left 1-2 MiB more resident memory behind, torch 2.13)."""


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'torchdelegate' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


__all__ = [
    "DELEGATION_TAG",
    "NO_COPY",
    "BackendDetails",
    "BackendNotFoundError",
    "BackendRegistrationError",
    "BackendUnavailableError",
    "CapabilityPartitioner",
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
    "MethodExecutionError",
    "NamedDataConflictError",
    "NamedDataMap",
    "NamedDataStore",
    "NamedDataStoreOutput",
    "NamedDataSummary",
    "OperatorDelegation",
    "OperatorNotFoundError",
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
    "get_backend",
    "graph_structure_difference",
    "load",
    "lowered_module_of",
    "lowered_modules",
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
