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

__version__ = "0.1.0"

__all__ = [
    "DELEGATION_TAG",
    "NO_COPY",
    "CapabilityPartitioner",
    "PartitionPlan",
    "BackendDetails",
    "BackendNotFoundError",
    "BackendRegistrationError",
    "BackendUnavailableError",
    "CompileSpec",
    "DataEntry",
    "DelegateExecutionError",
    "DelegationSpec",
    "EdgeProgramManager",
    "FormatError",
    "GraphChangedError",
    "LoweredBackendModule",
    "MethodExecutionError",
    "NamedDataConflictError",
    "NamedDataMap",
    "NamedDataStore",
    "NamedDataStoreOutput",
    "NamedDataSummary",
    "PartitionError",
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
    "disable_validation",
    "get_backend",
    "load",
    "register_backend",
    "registered_backend_ids",
    "run_original_subprograms",
    "tag_constant_data",
    "tag_mutated_buffers",
    "to_backend",
    "to_edge",
    "to_edge_transform_and_lower",
    "validation_disabled",
]
