"""Every exception that can reach a caller of the package is a ``TorchDelegateError``, so one
``except torchdelegate.TorchDelegateError`` catches whatever the package raises on purpose."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import torchdelegate
from torchdelegate.errors import TorchDelegateError

# Raised and caught inside the package; none reaches a caller (the place that catches each is named).
CAUGHT_INSIDE = {
    "torchdelegate.backends.onnxruntime.branches.CombineError": "linking.combined_model",
    "torchdelegate.backends.onnxruntime.model_proto.ModelProtoError": "confinement, session",
    "torchdelegate.backends.onnxruntime.onnx_export.FusionError": "onnx_export (a Refused)",
    "torchdelegate.backends.onnxruntime.onnx_export.Refused": "onnx_export, linking",
    "torchdelegate.cache.compiled_entry.EntryError": "compile_cache.look_up",
    "torchdelegate.cli.command.CommandError": "cli.main: printed, exit code 2",
    "torchdelegate.cli.command.UsageError": "cli.main: printed, exit code 2",
    "torchdelegate.compile.key_form.Unkeyable": "unit_form, equal_programs",
    "torchdelegate.serialize.bounded_json.JsonLimitError": "every reader of bounded JSON",
    "torchdelegate.serialize.call_plan.NeedsTorch": "call_plan, runtime.engine",
    "torchdelegate.serialize.container.ChangedDataError": "serialize.writer",
}


def _package_exceptions() -> dict[str, type[BaseException]]:
    found: dict[str, type[BaseException]] = {}
    for info in pkgutil.walk_packages(torchdelegate.__path__, "torchdelegate."):
        if info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        for name, value in inspect.getmembers(module, inspect.isclass):
            if issubclass(value, BaseException) and value.__module__ == info.name and not name.startswith("_"):
                found[f"{info.name}.{name}"] = value
    return dict(sorted(found.items()))


def test_every_exception_a_caller_can_meet_is_a_torchdelegate_error() -> None:
    exceptions = _package_exceptions()
    assert "torchdelegate.runtime.backend_options.BackendOptionError" in exceptions
    outside = sorted(name for name, cls in exceptions.items() if not issubclass(cls, TorchDelegateError))
    assert outside == sorted(name for name in CAUGHT_INSIDE if name in exceptions)
    assert set(CAUGHT_INSIDE) <= set(exceptions), "a class named in CAUGHT_INSIDE no longer exists"


def test_the_errors_named_in_the_issue_keep_their_builtin_bases() -> None:
    from torchdelegate.cache.store import StoreError
    from torchdelegate.compile.worker import WorkerError
    from torchdelegate.llm.serving.openai_requests import RequestError
    from torchdelegate.runtime.backend_options import BackendOptionError

    assert issubclass(BackendOptionError, ValueError) and issubclass(StoreError, ValueError)
    assert issubclass(WorkerError, RuntimeError)
    assert all(issubclass(c, TorchDelegateError) for c in (BackendOptionError, StoreError, WorkerError, RequestError))
