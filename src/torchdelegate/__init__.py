"""torchdelegate: hand parts of a torch.export program to the backends that run them best."""

from typing import TYPE_CHECKING

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
from torchdelegate.runtime.program import Program, load
from torchdelegate.specs import CompileSpec, DelegationSpec
from torchdelegate.structure import graph_structure_difference, same_graph_structure
from torchdelegate.trust import TRUSTED_BACKENDS_VARIABLE
from torchdelegate.version import __version__ as __version__

if TYPE_CHECKING:
    from torchdelegate.quantization.recipes import quantize as quantize


def __getattr__(name: str) -> object:
    """``quantize``, imported when first asked for: a process that only loads and runs files does
    not import the quantization code (with it imported, 400 loads of a file left 1-2 MiB more
    resident memory behind, torch 2.13)."""
    if name == "quantize":
        from torchdelegate.quantization.recipes import quantize

        return quantize
    raise AttributeError(f"module 'torchdelegate' has no attribute {name!r}")


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
