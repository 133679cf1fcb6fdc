"""The ONNX Runtime backend as torchdelegate calls it: each hook handed to the module that does that work."""

from __future__ import annotations

from dataclasses import replace
from importlib import metadata
from typing import TYPE_CHECKING, Any

import torch

from torchdelegate.backends.onnxruntime.array_hooks import OnnxRuntimeArrays
from torchdelegate.backends.onnxruntime.blob_header import blob_description, named_data_keys, unpacked
from torchdelegate.backends.onnxruntime.branches import branch_name
from torchdelegate.backends.onnxruntime.session import branch_seconds, check_blob, delegate_handle, prepare_model
from torchdelegate.backends.onnxruntime.settings import BACKEND_ID, BLOB_VERSION
from torchdelegate.delegate.backend_details import BackendDetails, PreprocessResult, shared_named_data, with_named_data
from torchdelegate.delegate.compile_units import current_partition
from torchdelegate.delegate.named_data import NamedDataMap
from torchdelegate.delegate.specs import CompileSpec

if TYPE_CHECKING:
    from torch.export import ExportedProgram

    from torchdelegate.backends.onnxruntime.partitioner import OnnxRuntimePartitioner


def _version(distribution: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "absent"


class OnnxRuntimeBackend(BackendDetails):
    """Runs partitions with ONNX Runtime (CPU provider); weights are shared named data."""

    backend_id = BACKEND_ID
    thread_safe_execute = True  # InferenceSession.run may be called from several threads
    compile_cache_version = (
        f"blob {BLOB_VERSION}, weights lifted, GroupQueryAttention, quantized layers joined, info, float32 scales, "
        "row blocks, packed query key value, float row blocks, 8-bit int8 arithmetic, joined by setting"
    )
    weights_by_reference = True  # weights are graph inputs while the model is optimized and fused
    load_options = OnnxRuntimeArrays.load_options

    @classmethod
    def compile_cache_identity(cls) -> dict[str, str] | None:
        """The blob's version and every library that writes the model."""
        versions = {name: _version(name) for name in ("onnxruntime", "onnx", "onnxscript", "onnx_ir")}
        return {"compiler": str(cls.compile_cache_version), **versions}

    @classmethod
    def is_available(cls) -> bool:
        return OnnxRuntimeArrays.is_available()

    needs = "install its runtime with pip install 'torchdelegate[onnxruntime]'"
    array_runtime = "torchdelegate.backends.onnxruntime.array_hooks:OnnxRuntimeArrays"

    @classmethod
    def partitioner(cls, compile_specs: list[CompileSpec] | None = None) -> OnnxRuntimePartitioner:
        from torchdelegate.backends.onnxruntime.partitioner import OnnxRuntimePartitioner

        return OnnxRuntimePartitioner(compile_specs=compile_specs)

    @classmethod
    def warm_up(cls) -> None:
        """Export and check a one-operation model: what torch's exporter, onnxscript's fusions and
        ONNX Runtime build once per process."""
        from torchdelegate.backends.onnxruntime.onnx_export import warm_up_exporter

        warm_up_exporter()

    @classmethod
    def preprocess(cls, edge_program: ExportedProgram, compile_specs: list[CompileSpec]) -> PreprocessResult:  # type: ignore[override]
        """The partition's blob, its weights as named data, and as its ``delegate_info`` the fusions its
        model got and why any layer's attention was left unfused (the lowering's report shows them;
        ``inspect`` prints them from a file)."""
        # Imported here, as in link_results: a process that only runs files needs no exporter.
        from torchdelegate.backends.onnxruntime.onnx_export import export_partition

        result = with_named_data(
            lambda store: export_partition(edge_program, compile_specs, store, current_partition())
        )
        return replace(result, delegate_info=blob_description(memoryview(result.processed_bytes)))

    @classmethod
    def link_results(
        cls, results: list[PreprocessResult], compile_specs: list[list[CompileSpec]]
    ) -> list[PreprocessResult]:
        """Every partition's weights in one store; partitions that run with the same session settings and
        read weights in common become branches of one model, run by one session."""
        from torchdelegate.backends.onnxruntime.linking import link_partitions

        linked = shared_named_data(results, lambda blobs, store: link_partitions(blobs, compile_specs, store))
        return [_with_branch_node_names(result) for result in linked]

    @classmethod
    def profile(cls, handle: Any) -> dict[str, float] | None:
        """Seconds per ONNX node of this delegate's branch, where it was loaded with the ``profile`` option."""
        return branch_seconds(handle)

    @classmethod
    def named_data_keys(cls, processed: memoryview, compile_specs: list[CompileSpec]) -> list[str] | None:
        return named_data_keys(processed)

    @classmethod
    def check_blob(cls, processed: memoryview, compile_specs: list[CompileSpec], named_data: NamedDataMap) -> None:
        check_blob(processed, named_data)

    @classmethod
    def init(cls, processed: memoryview, compile_specs: list[CompileSpec], named_data: NamedDataMap) -> Any:
        return delegate_handle(processed, compile_specs, named_data)

    @classmethod
    def prepare(cls, processed: memoryview, compile_specs: list[CompileSpec], named_data: NamedDataMap) -> str | None:
        """The model optimized and its weights packed for this machine, kept in the machine cache: a
        later load maps the packed weights from there instead of packing its own copy."""
        return prepare_model(processed, compile_specs, named_data)

    @classmethod
    def accept_donated_inputs(cls, handle: Any, donated: dict[int, int]) -> None:
        """Outputs the model makes by scattering into a donated input (a KV cache) are written into it."""
        handle.accept(donated)

    @classmethod
    def execute(cls, handle: Any, inputs: list[Any]) -> list[torch.Tensor]:
        """The session runs on numpy views of the tensors (no copy); an output it wrote in place is the
        input tensor itself."""
        arrays = [_array_view(value) for value in inputs]
        outputs = handle(arrays)
        return [
            inputs[j] if (j := handle.written.get(k)) is not None and output is arrays[j] else torch.from_numpy(output)
            for k, output in enumerate(outputs)
        ]


def _array_view(value: Any) -> Any:
    """A tensor's memory as a numpy array (a Python int, a symbolic size, as it is)."""
    if isinstance(value, torch.Tensor):
        return value.detach().numpy()
    return value


def _with_branch_node_names(result: PreprocessResult) -> PreprocessResult:
    """``result`` with its debug handle map naming ONNX nodes as the model its branch joined names them."""
    header, _ = unpacked(memoryview(result.processed_bytes))
    if not result.debug_handle_map or header.get("model") is None:
        return result
    renamed = {branch_name(header["branch"], str(key)): value for key, value in result.debug_handle_map.items()}
    return replace(result, debug_handle_map=renamed)
