"""ONNX Runtime's delegates on numpy arrays: the backend's run-time half, for a process without torch.

The session, the shared model, the kept IO binding and the machine cache are the ones
:class:`~torchdelegate.backends.onnxruntime.backend.OnnxRuntimeBackend` runs (``session.py``); this
class hands them arrays where that one hands them tensors' memory.
"""

from __future__ import annotations

import importlib
from typing import Any

import numpy as np

from torchdelegate.backends.onnxruntime.session import branch_seconds, delegate_handle, prepare_model
from torchdelegate.delegate.array_runtime import ArrayRuntime
from torchdelegate.delegate.named_data import NamedDataMap
from torchdelegate.delegate.specs import CompileSpec


class OnnxRuntimeArrays(ArrayRuntime):
    """Runs a file's ONNX Runtime delegates on numpy arrays (CPU provider)."""

    backend_id = "onnxruntime"
    thread_safe_execute = True
    load_options = {
        "intra_op_num_threads": "threads of ONNX Runtime's intra-op pool (an integer; 0: ONNX Runtime's choice)",
        "intra_op_spinning": (
            "1 (default): the pool's threads spin while they wait for work; 0: they sleep (faster where other "
            "processes keep the cores busy)"
        ),
        "profile": "1: ONNX Runtime times every node (Program.profile() reads it; `run --profile` prints it)",
    }
    needs = "install its runtime with pip install onnxruntime"

    @classmethod
    def is_available(cls) -> bool:
        try:
            ort = importlib.import_module("onnxruntime")
        except ImportError:
            return False
        return "CPUExecutionProvider" in ort.get_available_providers()

    @classmethod
    def init(cls, processed: memoryview, compile_specs: list[CompileSpec], named_data: NamedDataMap) -> Any:
        return delegate_handle(processed, compile_specs, named_data)

    @classmethod
    def execute(cls, handle: Any, inputs: list[Any]) -> list[np.ndarray]:
        return handle(inputs)  # type: ignore[no-any-return]

    @classmethod
    def accept_donated_inputs(cls, handle: Any, donated: dict[int, int]) -> None:
        handle.accept(donated)

    @classmethod
    def profile(cls, handle: Any) -> dict[str, float] | None:
        return branch_seconds(handle)

    @classmethod
    def prepare(cls, processed: memoryview, compile_specs: list[CompileSpec], named_data: NamedDataMap) -> str | None:
        return prepare_model(processed, compile_specs, named_data)
