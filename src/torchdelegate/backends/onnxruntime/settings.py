"""What every part of the backend reads: the blob version, the optional dependencies, and the compile
specs parsed and checked (:class:`Options`).
"""

from __future__ import annotations

import importlib
import os
import tempfile
from types import ModuleType
from typing import Any

from torchdelegate.delegate.specs import CompileSpec

BACKEND_ID = "onnxruntime"  # the partitioner tags for it, the backend registers under it
BLOB_VERSION = 3
OLDER_BLOB_VERSIONS = (1, 2)  # still read
DYNAMIC_BLOCK_BASE = 4  # a parallel loop is split into up to 4 blocks per thread, taken as threads come free
SMALLEST_SHARED = 1024  # bytes: smaller initializers stay inside the model
_EXTRA = "pip install 'torchdelegate[onnxruntime]'"
_OPTIMIZATION_LEVELS = {"disable": "ORT_DISABLE_ALL", "basic": "ORT_ENABLE_BASIC", "extended": "ORT_ENABLE_EXTENDED"}
_OPTIMIZATION_LEVELS["all"] = "ORT_ENABLE_ALL"
# ONNX element types of the numpy dtypes initializers come in; bfloat16 travels as uint16.
ONNX_TYPES = {"float32": 1, "uint8": 2, "int8": 3, "uint16": 4, "int16": 5, "int32": 6, "int64": 7, "bool": 9}
ONNX_TYPES |= {"float16": 10, "float64": 11, "uint32": 12, "uint64": 13, "bfloat16": 16}


def require(module: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"the onnxruntime backend needs {module!r}: {_EXTRA}") from e


class Options:
    """The backend's compile specs, parsed and checked: an unknown key or a bad value is a ``ValueError``."""

    _KEYS = (
        "disable_prepacking",
        "fusions",
        "graph_optimization_level",
        "intra_op_num_threads",
        "intra_op_spinning",
        "profile",
    )

    def __init__(self, compile_specs: list[CompileSpec]) -> None:
        values = {spec.key: spec.value.decode("utf-8", "replace") for spec in compile_specs}
        unknown = sorted(set(values) - set(self._KEYS))
        if unknown:
            raise ValueError(f"unknown compile spec {', '.join(map(repr, unknown))}: the keys are {list(self._KEYS)}")
        self.threads = _integer(values, "intra_op_num_threads", 0)
        self.level = values.get("graph_optimization_level", "all")
        if self.level not in _OPTIMIZATION_LEVELS:
            raise ValueError(f"graph_optimization_level {self.level!r}: use one of {sorted(_OPTIMIZATION_LEVELS)}")
        self.fusions = _flag(values, "fusions", True)
        self.prepacking = not _flag(values, "disable_prepacking", False)
        self.spinning = _flag(values, "intra_op_spinning", True)
        self.profile = _flag(values, "profile", False)

    def session_settings(self) -> tuple[int, str, bool, bool, bool]:
        """What a session is made with: delegates whose specs give equal settings may share one."""
        return self.threads, self.level, self.prepacking, self.spinning, self.profile

    def session_options(self, pack_weights: bool = True) -> Any:
        """``pack_weights=False``: no packed copies, whatever the specs say (a session only checked)."""
        ort = require("onnxruntime")
        options = ort.SessionOptions()
        options.intra_op_num_threads = self.threads
        options.graph_optimization_level = getattr(ort.GraphOptimizationLevel, _OPTIMIZATION_LEVELS[self.level])
        options.add_session_config_entry("session.disable_prepacking", "0" if self.prepacking and pack_weights else "1")
        options.add_session_config_entry("session.load_model_format", "ONNX")  # never ORT's own format
        # Threads spin between a call's nodes, as ONNX Runtime's own default: waking a sleeping thread for
        # each of a decode step's hundreds of small nodes costs a quarter of the step. A machine shared with
        # busy processes sets intra_op_spinning=0; work split in blocks taken as threads come free helps it.
        options.add_session_config_entry("session.intra_op.allow_spinning", "1" if self.spinning else "0")
        options.add_session_config_entry("session.dynamic_block_base", str(DYNAMIC_BLOCK_BASE))
        if self.profile:  # ONNX Runtime's trace of every node's time, read by Model.node_seconds
            options.enable_profiling = True
            options.profile_file_prefix = os.path.join(tempfile.gettempdir(), f"torchdelegate-profile-{os.getpid()}")
        return options


def _integer(values: dict[str, str], key: str, default: int) -> int:
    text = values.get(key)
    if text is None:
        return default
    if not text.isdigit():
        raise ValueError(f"{key} {text!r}: use a number of threads (0: one per core)")
    return int(text)


def _flag(values: dict[str, str], key: str, default: bool) -> bool:
    text = values.get(key)
    if text is None:
        return default
    if text not in ("0", "1"):
        raise ValueError(f"{key} {text!r}: use '0' or '1'")
    return text == "1"
