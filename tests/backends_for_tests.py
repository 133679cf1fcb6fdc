"""Backends and partitioners used by the tests (never shipped)."""

from __future__ import annotations

import hashlib
import io
import json
import mmap
import os
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.export import ExportedProgram

from torchdelegate import (
    DELEGATION_TAG,
    BackendDetails,
    CompileSpec,
    DelegationSpec,
    NamedDataMap,
    NamedDataStore,
    Partitioner,
    PartitionResult,
    PreprocessResult,
    tag_constant_data,
)
from torchdelegate.backends.reference import ReferenceBackend, ReferencePartitioner
from torchdelegate.delegate.named_data import tensor_bytes
from torchdelegate.exported.structural_copy import with_identifier_state_names, with_state


class TorchExportBackend(BackendDetails):
    """Compiles a sub-program with torch.export's serializer; runs it with torch."""

    backend_id = "TestTorchExport"
    calls: list[str] = []

    @staticmethod
    def preprocess(edge_program: ExportedProgram, compile_specs: list[CompileSpec]) -> PreprocessResult:
        buffer = io.BytesIO()
        # init runs module(), which reads state as attributes: names such as `lambda` go by a stand-in
        torch.export.save(with_identifier_state_names(edge_program)[0], buffer)
        return PreprocessResult(processed_bytes=buffer.getvalue())

    @classmethod
    def init(cls, processed: memoryview, compile_specs: list[CompileSpec], named_data: NamedDataMap) -> Any:
        cls.calls.append("init")
        program = torch.export.load(io.BytesIO(bytes(processed)))
        return program.module(), program.call_spec.in_spec

    @classmethod
    def execute(cls, handle: Any, inputs: list[Any]) -> list[torch.Tensor]:
        cls.calls.append("execute")
        module, in_spec = handle
        args, kwargs = pytree.tree_unflatten(inputs, in_spec)  # execute gets flat inputs
        return pytree.tree_leaves(module(*args, **kwargs))

    @classmethod
    def destroy(cls, handle: Any) -> None:
        cls.calls.append("destroy")


class OpSetPartitioner(Partitioner):
    """Tags maximal runs of supported call_function nodes, one tag per connected run.

    Simple on purpose: consecutive supported nodes (in graph order) that are connected by
    an edge share a tag; an unsupported node ends the run.
    """

    def __init__(
        self,
        supported: Iterable[Any] | Callable[[torch.fx.Node], bool],
        backend_id: str = TorchExportBackend.backend_id,
        tag_constants: bool = True,
    ) -> None:
        self.is_supported = supported if callable(supported) else (lambda n, s=frozenset(supported): n.target in s)
        self.spec = DelegationSpec(backend_id, [CompileSpec("test", b"1")])
        self.tag_constants = tag_constants

    def partition(self, exported_program: ExportedProgram) -> PartitionResult:
        tags: dict[str, DelegationSpec] = {}
        current: str | None = None
        members: set[torch.fx.Node] = set()
        for node in exported_program.graph.nodes:
            if node.op != "call_function" or not self.is_supported(node):
                if node.op == "call_function":
                    current = None
                continue
            connected = any(inp in members for inp in node.all_input_nodes)
            if current is None or not connected:
                current = f"tag{len(tags)}"
                tags[current] = self.spec
                members = set()
            node.meta[DELEGATION_TAG] = current
            members.add(node)
        if self.tag_constants:
            tag_constant_data(exported_program)
        return PartitionResult(exported_program, tags)


class FunctionPartitioner(Partitioner):
    """Tags nodes with whatever ``tagger(node)`` returns (None: untagged)."""

    def __init__(self, tagger: Callable[[torch.fx.Node], str | None], backend_id: str = TorchExportBackend.backend_id):
        self.tagger = tagger
        self.backend_id = backend_id

    def partition(self, exported_program: ExportedProgram) -> PartitionResult:
        tags: dict[str, DelegationSpec] = {}
        for gm in exported_program.graph_module.modules():
            if not isinstance(gm, torch.fx.GraphModule):
                continue
            for node in gm.graph.nodes:
                tag = self.tagger(node)
                if tag is not None:
                    node.meta[DELEGATION_TAG] = tag
                    tags[tag] = DelegationSpec(self.backend_id)
        return PartitionResult(exported_program, tags)


def every_op(backend_id: str, *placeholders: str) -> FunctionPartitioner:
    """One partition of every op (and of the placeholders named, e.g. a buffer) for ``backend_id``."""
    return FunctionPartitioner(
        lambda node: "ops" if node.op == "call_function" or node.name in placeholders else None, backend_id
    )


class NamedWeightsBackend(BackendDetails):
    """Stores weights once, as named data shared by all partitions; blobs carry zeros instead.

    Only the first partition's result carries the data store, so a delegate can run only if
    it sees the named data of the whole lowering. Outputs are right only if ``init`` reads
    the real weights back from its NamedDataMap.
    """

    backend_id = "TestNamedWeights"

    @classmethod
    def preprocess_multimethod(cls, edge_programs, compile_specs):  # type: ignore[no-untyped-def]
        store = NamedDataStore()
        results: dict[str, list[PreprocessResult]] = {}
        for method, programs in edge_programs.items():
            results[method] = []
            for program in programs:
                weights = {}
                for fqn, tensor in program.state_dict.items():
                    key = hashlib.sha256(bytes(tensor_bytes(tensor))).hexdigest()
                    store.add_named_data(key, tensor, alignment=64)
                    weights[fqn] = [key, str(tensor.dtype).removeprefix("torch."), list(tensor.shape)]
                blob = io.BytesIO()
                torch.export.save(_with_zero_weights(program), blob)
                header = json.dumps(weights, sort_keys=True).encode()
                results[method].append(PreprocessResult(len(header).to_bytes(8, "little") + header + blob.getvalue()))
        first = next(iter(results.values()))[0]
        first.data_store_output = store.get_named_data_store_output()
        return results

    @staticmethod
    def preprocess(edge_program, compile_specs):  # type: ignore[no-untyped-def]
        raise AssertionError("preprocess_multimethod is overridden")

    @classmethod
    def init(cls, processed, compile_specs, named_data):  # type: ignore[no-untyped-def]
        size = int.from_bytes(processed[:8], "little")
        weights = json.loads(bytes(processed[8 : 8 + size]))
        module = torch.export.load(io.BytesIO(bytes(processed[8 + size :]))).module()
        for fqn, (key, dtype, shape) in weights.items():
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # read-only view: never written
                value = torch.frombuffer(named_data.get_data(key), dtype=getattr(torch, dtype)).view(shape)
            owner, _, name = fqn.rpartition(".")
            setattr(module.get_submodule(owner), name, torch.nn.Parameter(value, requires_grad=False))
        return module

    @classmethod
    def execute(cls, handle, inputs):  # type: ignore[no-untyped-def]
        return pytree.tree_leaves(handle(*inputs))


def _with_zero_weights(program: ExportedProgram) -> ExportedProgram:
    weights = program.state_dict
    return with_state(program, lambda fqn, value: type(value)(torch.zeros_like(value)) if fqn in weights else value)


class CompileOnlyBackend(BackendDetails):
    """Accepts any sub-program and compiles it to nothing: for tests of lowering alone."""

    backend_id = "TestCompileOnly"

    @staticmethod
    def preprocess(edge_program, compile_specs):  # type: ignore[no-untyped-def]
        return PreprocessResult(b"")


class CountingReference(ReferenceBackend):
    """The reference backend, counting init and destroy calls and checking named data is mapped."""

    backend_id = "TestCounting"
    inits = 0
    destroys = 0
    mapped_views = 0
    available = True

    @classmethod
    def is_available(cls) -> bool:
        return cls.available

    @classmethod
    def init(cls, processed, compile_specs, named_data):  # type: ignore[no-untyped-def]
        cls.inits += 1
        for key in named_data.keys():
            if isinstance(named_data.get_data(key).obj, mmap.mmap):
                cls.mapped_views += 1
        return super().init(processed, compile_specs, named_data)

    @classmethod
    def destroy(cls, handle):  # type: ignore[no-untyped-def]
        cls.destroys += 1


def counting_partitioner() -> ReferencePartitioner:
    partitioner = ReferencePartitioner()
    partitioner.spec = DelegationSpec(CountingReference.backend_id)
    return partitioner


class DescribingReference(ReferenceBackend):
    """The reference backend, returning ``describe(sub-program)`` as each delegate's info."""

    backend_id = "TestDescribing"

    @staticmethod
    def describe(program: ExportedProgram) -> Any:
        ops = sorted({str(n.target) for n in program.graph.nodes if n.op == "call_function"})
        return {"ops": ops, "fused": False, "score": 0.5, "notes": None}

    @classmethod
    def preprocess(cls, edge_program, compile_specs):  # type: ignore[no-untyped-def]
        result = super().preprocess(edge_program, compile_specs)
        result.delegate_info = cls.describe(edge_program)
        return result

    @classmethod
    def preprocess_multimethod(cls, edge_programs, compile_specs):  # type: ignore[no-untyped-def]
        results = super().preprocess_multimethod(edge_programs, compile_specs)
        for method, programs in edge_programs.items():
            for program, result in zip(programs, results[method], strict=True):
                result.delegate_info = cls.describe(program)
        return results


def describing_partitioner() -> ReferencePartitioner:
    partitioner = ReferencePartitioner()
    partitioner.spec = DelegationSpec(DescribingReference.backend_id)
    return partitioner


class DyingReference(ReferenceBackend):
    """The reference backend, whose compile kills its worker process: always (compile spec
    ``die=always``), or the first time only (``die=once:MARKER``, a file it creates before dying);
    or raises (``die=raise``)."""

    backend_id = "TestDying"
    compile_cache_version = None

    @classmethod
    def preprocess(cls, edge_program: ExportedProgram, compile_specs: list[CompileSpec]) -> PreprocessResult:  # type: ignore[override]
        how = next((s.value.decode() for s in compile_specs if s.key == "die"), "")
        if how == "raise":
            raise ValueError("this partition cannot be compiled")
        if how == "always" or (how.startswith("once:") and not os.path.exists(how[5:])):
            if how.startswith("once:"):
                open(how[5:], "w").close()
            os._exit(3)
        return super().preprocess(edge_program, [s for s in compile_specs if s.key != "die"])


def installed_distribution(site: Any, package: str, source: str, backend_id: str, class_name: str) -> Any:
    """A distribution in the directory ``site`` (a ``Path``): the module ``package`` holding ``source``,
    whose entry point in ``torchdelegate.backends`` names ``backend_id`` as ``package:class_name``."""
    (site / package).mkdir(parents=True)
    (site / package / "__init__.py").write_text(source)
    info = site / f"{package}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {package.replace('_', '-')}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[torchdelegate.backends]\n{backend_id} = {package}:{class_name}\n")
    return site
