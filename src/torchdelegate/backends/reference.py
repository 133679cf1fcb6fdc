"""The reference backend: any core-ATen sub-program, run with torch.

Its blob is a framed header listing the sub-program's tensors, then the sub-program in
torch.export's JSON form (zlib-compressed), without tensors; every tensor is named data keyed
by its SHA-256, so partitions and methods that use one weight store it once (the keys stay
readable outside the compressed graph: the compile cache swaps them). It runs anywhere torch
runs, which makes it the fallback of every partitioner list (put last, it claims what the
others left) and the backend of choice for checking a program's numerics after saving and
loading.
"""

from __future__ import annotations

import base64
import binascii
import threading
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.fx import Node

from torchdelegate.backends.blob import pack, table_keys, unpack, weight_table, weights
from torchdelegate.delegate.backend_details import (
    BackendDetails,
    PreprocessResult,
    get_backend,
    shared_named_data,
    with_named_data,
)
from torchdelegate.delegate.compile_units import current_partition
from torchdelegate.delegate.instance import DelegateInstance
from torchdelegate.delegate.lowered_module import LoweredBackendModule
from torchdelegate.delegate.named_data import NamedDataMap, NamedDataStore
from torchdelegate.delegate.specs import CompileSpec, DelegationSpec
from torchdelegate.delegate.trust import check_trusted, current_trust
from torchdelegate.errors import FormatError
from torchdelegate.exported.generated_source import GeneratedSource
from torchdelegate.partition.capability import CapabilityPartitioner, non_tensor_value
from torchdelegate.runtime.method import Method
from torchdelegate.serialize.allow_list import check_graph_document
from torchdelegate.serialize.call_delegate import DelegateCall, serializable_program
from torchdelegate.serialize.container import canonical_json, inflated_json
from torchdelegate.serialize.residual_graph import residual_graph

if TYPE_CHECKING:
    from torch.export import ExportedProgram

__all__ = ["BLOB_VERSION", "ReferenceBackend", "ReferencePartitioner", "reference_support"]

BLOB_VERSION = 2
_ZLIB_BLOB_VERSION = 1  # the whole blob one zlib stream (still read)
_MAX_BLOB_JSON = 1 << 28  # bytes a blob may inflate to
_CONTROL_FLOW = frozenset({torch.ops.higher_order.cond, torch.ops.higher_order.while_loop})


class ReferenceBackend(BackendDetails):
    """Runs sub-programs with torch; weights are named data shared by content."""

    backend_id = "reference"
    thread_safe_execute = True  # a handle that owns state locks itself
    needs = "torch itself is missing"

    @classmethod
    def partitioner(cls, compile_specs: list[CompileSpec] | None = None) -> ReferencePartitioner:
        """Every core-ATen computation, for this backend (a subclass proposes it under its own id)."""
        return ReferencePartitioner(compile_specs, backend_id=cls.backend_id)

    compile_cache_version = f"blob {BLOB_VERSION}"
    weights_by_reference = True  # a weight is its table's key, nothing else

    @classmethod
    def preprocess(cls, edge_program: ExportedProgram, compile_specs: list[CompileSpec]) -> PreprocessResult:  # type: ignore[override]
        """The sub-program's graph, its weights as named data (shared by content with every partition's)."""
        return with_named_data(lambda store: _blob(edge_program, store, current_partition()))

    @classmethod
    def link_results(
        cls, results: list[PreprocessResult], compile_specs: list[list[CompileSpec]]
    ) -> list[PreprocessResult]:
        return shared_named_data(results)

    @classmethod
    def named_data_keys(cls, processed: memoryview, compile_specs: list[CompileSpec]) -> list[str] | None:
        try:
            return table_keys(_read_blob(processed).get("tensors"))
        except (FormatError, AttributeError):
            return None  # init reports a damaged blob

    @classmethod
    def check_blob(cls, processed: memoryview, compile_specs: list[CompileSpec], named_data: NamedDataMap) -> None:
        """What ``init`` checks before it builds: the blob's form, its graph against the allow-list, its
        weights against the named data, and each nested delegate: trusted as ``init`` would make it (a
        native-code backend only under a trust that names it), and checked by its own backend."""
        blob, graph, tensors = _blob_parts(processed)
        check_graph_document(graph, "reference blob")
        weights(tensors, named_data, "reference")
        for nested in _nested(blob.get("delegates", [])):
            check_trusted(nested.backend, current_trust(), f"delegate {nested.name!r} (nested)")
            nested.backend.check_blob(memoryview(nested.blob), nested.compile_specs, named_data)

    @classmethod
    def init(cls, processed: memoryview, compile_specs: list[CompileSpec], named_data: NamedDataMap) -> Any:
        return _ReferenceHandle(processed, named_data)

    @classmethod
    def execute(cls, handle: Any, inputs: list[Any]) -> list[torch.Tensor]:
        return handle(inputs)

    @classmethod
    def destroy(cls, handle: Any) -> None:
        handle.source.forget()


def _blob(program: ExportedProgram, store: NamedDataStore, where: str) -> bytes:
    """The sub-program's graph as JSON, and its weight table (named data by content)."""
    from torchdelegate.serialize.graph import program_to_json  # torch.export's writer: lowering only

    mutated = set(program.graph_signature.buffers_to_mutate.values())
    tensors = weight_table(program, store, where)
    for entry in tensors:
        entry["mutable"] = entry["name"] in mutated
    inner: dict[LoweredBackendModule, int] = {}
    serializable, calls = serializable_program(program, lambda module: inner.setdefault(module, len(inner)))
    graph = program_to_json(serializable, where)
    delegates = {inner[c.module]: _inner_delegate(c, store) for c in calls}
    program_part: dict[str, Any] = {"graph": graph}
    if delegates:
        program_part["delegates"] = [delegates[i] for i in range(len(delegates))]
    # Graph JSON is repetitive: compressed, it is about a tenth of its size.
    return pack({"version": BLOB_VERSION, "tensors": tensors}, zlib.compress(canonical_json(program_part), 9))


def _inner_delegate(call: DelegateCall, store: NamedDataStore) -> dict[str, Any]:
    """A delegate inside the sub-program (nested delegation): its blob, specs and calling form; its data joins ours."""
    module = call.module
    store.merge(module.named_data)
    return {
        "name": module.name,
        "backend_id": module.backend_id,
        "blob": base64.b64encode(module.processed_bytes).decode("ascii"),
        "compile_specs": [[spec.key, base64.b64encode(spec.value).decode("ascii")] for spec in module.compile_specs],
        "inputs": call.input_kinds,
        "outputs": call.output_count,
    }


@dataclass(frozen=True)
class _Nested:
    """A nested delegate as its blob lists it."""

    backend: type[BackendDetails]
    blob: bytes
    compile_specs: list[CompileSpec]
    inputs: str
    outputs: int
    name: str


def _nested(entries: Any) -> list[_Nested]:
    """The nested delegates a blob lists; a ``FormatError`` naming the first malformed one."""
    found = []
    for index, entry in enumerate(entries if isinstance(entries, list) else [None]):
        try:
            blob = base64.b64decode(entry["blob"], validate=True)
            specs = [CompileSpec(key, base64.b64decode(value, validate=True)) for key, value in entry["compile_specs"]]
            found.append(
                _Nested(
                    get_backend(entry["backend_id"]),
                    blob,
                    specs,
                    entry["inputs"],
                    int(entry["outputs"]),
                    str(entry["name"]),
                )
            )
        except (KeyError, TypeError, ValueError, binascii.Error) as e:
            raise FormatError(f"reference blob: nested delegate {index} is malformed ({e})") from None
    return found


def _inner_delegates(entries: Any, named_data: NamedDataMap) -> tuple[dict[int, DelegateInstance], dict[int, str]]:
    """The nested delegates a blob lists, bound to their backends, and the kinds of their inputs."""
    instances: dict[int, DelegateInstance] = {}
    kinds: dict[int, str] = {}
    for index, nested in enumerate(_nested(entries)):
        kinds[index] = nested.inputs
        instances[index] = DelegateInstance(
            nested.backend,
            nested.blob,
            nested.compile_specs,
            lambda: named_data,
            name=f"{nested.name} (nested)",
            output_count=nested.outputs,
        )
    return instances, kinds


def _read_blob(processed: memoryview) -> dict[str, Any]:
    """A blob's tensors, graph and nested delegates, of this version or the one before; a
    ``FormatError`` if it is neither."""
    try:
        header, payload = unpack(processed, BLOB_VERSION, "reference")
    except FormatError as e:
        try:  # a whole-zlib blob of the version before
            blob = inflated_json(processed, _MAX_BLOB_JSON)
        except ValueError:
            raise e from None
        if not isinstance(blob, dict) or blob.get("version") != _ZLIB_BLOB_VERSION:
            raise e from None
        return blob
    try:
        program_part = inflated_json(payload, _MAX_BLOB_JSON)
    except ValueError as e:
        raise FormatError(f"reference blob: its graph is damaged ({e})") from None
    if not isinstance(program_part, dict):
        raise FormatError("reference blob: its graph is not a JSON object")
    return {**program_part, **header}


def _blob_parts(processed: memoryview) -> tuple[dict[str, Any], Any, Any]:
    """A blob read, with its graph and its tensor table; each entry's ``mutable`` checked to be a bool."""
    blob = _read_blob(processed)
    try:
        graph, tensors = blob["graph"], blob["tensors"]
    except KeyError as e:
        raise FormatError(f"reference blob: not a reference backend blob (no {e})") from None
    if isinstance(tensors, list) and any(type(e.get("mutable")) is not bool for e in tensors if isinstance(e, dict)):
        raise FormatError("reference blob: a tensor entry's 'mutable' is not a bool")
    return blob, graph, tensors


class _ReferenceHandle:
    """A sub-program ready to run: its tensors over named data, its own copy of any buffer it writes."""

    def __init__(self, processed: memoryview, named_data: NamedDataMap) -> None:
        blob, graph, tensors = _blob_parts(processed)
        state = weights(tensors, named_data, "reference")
        self.source = GeneratedSource()
        with self.source.recording():
            program = residual_graph(graph, state, "reference blob")
            for name in program.buffers_to_mutate:  # the graph says what it writes
                state[name] = state[name].clone()  # its own copy: named data is shared and never written
            delegates, kinds = _inner_delegates(blob.get("delegates", []), named_data)
            self._method = Method("delegate", program, state, delegates, kinds)
        has_state = bool(program.buffers_to_mutate)
        self._lock = threading.Lock() if has_state else None

    def __call__(self, inputs: list[Any]) -> list[torch.Tensor]:
        if self._lock is None:
            return self._method.run_user_outputs(inputs)
        with self._lock:
            return self._method.run_user_outputs(inputs)


class ReferencePartitioner(CapabilityPartitioner):
    """Claims every core-ATen computation (and cond / while_loop): the capability partitioner over
    :func:`reference_support`, so its groups are as few as the capability partitioner makes.

    Put last in a list of partitioners, it takes whatever the backends before it left. A subclass
    narrows what it claims by overriding :meth:`operator_support`; ``backend_id`` delegates to a
    subclass of the reference backend instead.
    """

    def __init__(
        self,
        compile_specs: list[CompileSpec] | None = None,
        *,
        min_partition_size: int = 1,
        backend_id: str = "reference",
    ) -> None:
        spec = DelegationSpec(backend_id, list(compile_specs or []))
        super().__init__(self.operator_support, spec, min_partition_size=min_partition_size)

    def operator_support(self, node: Node) -> bool | str:
        """:func:`reference_support`; a subclass narrows what it claims by overriding this."""
        return reference_support(node)


def reference_support(node: Node) -> bool | str:
    """True if ``node`` is an ATen op or control flow that makes tensors only; otherwise why not."""
    if not isinstance(node.target, torch._ops.OpOverload) and node.target not in _CONTROL_FLOW:
        return f"not an ATen operator ({getattr(node.target, '__name__', node.target)})"
    return non_tensor_value(node) or True
