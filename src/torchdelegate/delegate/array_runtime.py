"""A backend's run-time half without torch: blobs run on numpy arrays, in a process that never imports torch.

A :class:`~torchdelegate.delegate.backend_details.BackendDetails` is both halves of a backend, and
importing it imports torch. A backend whose runtime needs no torch (ONNX Runtime's) also offers an
:class:`ArrayRuntime`: the same ``init``/``execute``/``destroy`` contract, on numpy arrays (and
Python ints for symbolic sizes) instead of tensors, in a module that imports no torch.
``torchdelegate.load`` runs a file on array runtimes when every delegate's backend has one and its
graphs only call delegates (``serialize/call_plan.py``): such a process never imports torch.

A backend names its array runtime in the entry-point group ``torchdelegate.array_runtimes`` (the
entry point's name is the backend id) or, for a class already imported, by subclassing
:class:`ArrayRuntime` with its ``backend_id``; the shipped ones are listed here.
"""

from __future__ import annotations

import importlib
import inspect
from abc import ABC, abstractmethod
from collections.abc import Mapping
from importlib import metadata
from typing import Any, ClassVar

from torchdelegate.delegate.named_data import NamedDataMap
from torchdelegate.delegate.specs import CompileSpec
from torchdelegate.errors import BackendNotFoundError

ARRAY_RUNTIME_GROUP = "torchdelegate.array_runtimes"
_SHIPPED = {"onnxruntime": "torchdelegate.backends.onnxruntime.array_hooks:OnnxRuntimeArrays"}
_REGISTRY: dict[str, type[ArrayRuntime]] = {}


class ArrayRuntime(ABC):
    """The run-time half of a backend, on numpy arrays: what a file's delegates of ``backend_id`` run on
    where torch is not imported. Hooks and attributes mean what they mean on ``BackendDetails``;
    ``execute`` takes C-contiguous arrays (ints for symbolic sizes) and returns arrays."""

    backend_id: ClassVar[str] = ""
    thread_safe_execute: ClassVar[bool] = False
    runs_native_code: ClassVar[bool] = False
    load_options: ClassVar[dict[str, str]] = {}
    needs: ClassVar[str] = "install the backend's runtime"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.backend_id and not inspect.isabstract(cls):
            _REGISTRY[cls.backend_id] = cls

    @classmethod
    def is_available(cls) -> bool:
        return True

    @classmethod
    @abstractmethod
    def init(cls, processed: memoryview, compile_specs: list[CompileSpec], named_data: NamedDataMap) -> Any:
        """The handle ``execute`` runs (as ``BackendDetails.init``)."""

    @classmethod
    @abstractmethod
    def execute(cls, handle: Any, inputs: list[Any]) -> list[Any]:
        """One call: the sub-program's user outputs, as arrays."""

    @classmethod
    def destroy(cls, handle: Any) -> None:
        """Release the handle; by default it is dropped."""
        return None

    @classmethod
    def accept_donated_inputs(cls, handle: Any, donated: dict[int, int]) -> None:
        """As ``BackendDetails.accept_donated_inputs``: by default, no input's memory is taken."""
        return None

    @classmethod
    def profile(cls, handle: Any) -> Mapping[Any, float] | None:
        return None

    @classmethod
    def prepare(cls, processed: memoryview, compile_specs: list[CompileSpec], named_data: NamedDataMap) -> str | None:
        return None


def array_runtime(backend_id: str) -> type[ArrayRuntime] | None:
    """The torch-free runtime of ``backend_id``'s blobs, None when running them needs torch."""
    runtime = _REGISTRY.get(backend_id)
    if runtime is not None:
        return runtime
    target = _SHIPPED.get(backend_id)
    if target is None:
        entry_point = {ep.name: ep for ep in metadata.entry_points(group=ARRAY_RUNTIME_GROUP)}.get(backend_id)
        if entry_point is None:
            return None
        target = entry_point.value
    module, _, name = target.partition(":")
    loaded = getattr(importlib.import_module(module), name)
    if not (isinstance(loaded, type) and issubclass(loaded, ArrayRuntime)) or loaded.backend_id != backend_id:
        raise BackendNotFoundError(
            f"{target}, the array runtime named for backend {backend_id!r}, is not an ArrayRuntime whose "
            f"backend_id is {backend_id!r}; fix the entry point in group {ARRAY_RUNTIME_GROUP!r}"
        )
    _REGISTRY[backend_id] = loaded
    return loaded
