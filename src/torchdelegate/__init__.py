"""torchdelegate: hand parts of a torch.export program to the backends that run them best."""

from torchdelegate.backend import (
    BackendDetails,
    PreprocessResult,
    SharedDataBackend,
    get_backend,
    register_backend,
    registered_backend_ids,
)
from torchdelegate.data import DataEntry, NamedDataMap, NamedDataStore, NamedDataStoreOutput, NamedDataSummary
from torchdelegate.errors import (
    BackendNotFoundError,
    BackendRegistrationError,
    BackendUnavailableError,
    DelegateExecutionError,
    FormatError,
    GraphChangedError,
    MethodExecutionError,
    NamedDataConflictError,
    PartitionError,
    PreprocessError,
    ProgramClosedError,
    ProgramInputError,
    SerializationError,
    TorchDelegateError,
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
    tag_constant_data,
    tag_mutated_buffers,
)
from torchdelegate.program import EdgeProgramManager, to_edge, to_edge_transform_and_lower
from torchdelegate.runtime.program import Program, load
from torchdelegate.specs import CompileSpec, DelegationSpec
from torchdelegate.structure import graph_structure_difference, same_graph_structure

__version__ = "0.1.0"

__all__ = [
    "DELEGATION_TAG",
    "NO_COPY",
    "BackendDetails",
    "BackendNotFoundError",
    "BackendRegistrationError",
    "BackendUnavailableError",
    "CapabilityPartitioner",
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
    "PartitionError",
    "PartitionPlan",
    "PartitionResult",
    "Partitioner",
    "PreprocessError",
    "PreprocessResult",
    "Program",
    "ProgramClosedError",
    "ProgramInputError",
    "SerializationError",
    "SharedDataBackend",
    "TorchDelegateError",
    "call_delegate",
    "copy_program",
    "delegate_calls",
    "delegation_info",
    "disable_validation",
    "format_delegated_graph",
    "get_backend",
    "graph_structure_difference",
    "load",
    "lowered_module_of",
    "lowered_modules",
    "lowered_submodules",
    "print_delegated_graph",
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
