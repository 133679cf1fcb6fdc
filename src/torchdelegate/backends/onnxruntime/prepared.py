"""The machine cache's entries of models optimized and their weights packed on this machine: their
key, a session made from one, and the settings that make a session write one (``session.prepare_model``
builds that session).
"""

from __future__ import annotations

import hashlib
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any

from torchdelegate.backends.onnxruntime.blob_header import external_keys, initializer_table
from torchdelegate.backends.onnxruntime.settings import SMALLEST_SHARED, Options, require
from torchdelegate.cache.machine_cache import EntryCheck, entry_key
from torchdelegate.delegate.named_data import NamedDataMap
from torchdelegate.errors import first_line

PREPARED = "onnxruntime"
_PREPARED_MODEL, _PREPARED_WEIGHTS = "model.onnx", "weights.data"


def prepared_key(header: dict[str, Any], model: memoryview, settings: Options, named_data: NamedDataMap) -> str:
    """What a prepared model is made from: the model, every weight's bytes (by digest: a model names its
    weights by key, and a file's key says nothing of its bytes), the settings and ONNX Runtime's build."""
    ort = require("onnxruntime")
    content = {
        "onnxruntime": [ort.__version__, ort.get_build_info()],
        "optimization": settings.level,
        "header": header,
        "model": hashlib.sha256(model).hexdigest(),
        "weights": {key: named_data.digest(key) for key in external_keys(initializer_table(header))},
    }
    return entry_key(PREPARED, content)


def prepared_session(ort: ModuleType, place: Path, settings: Options) -> Any | None:
    """A session of the model ``prepare`` optimized, its packed weights mapped from the entry's file (the
    process packs none of its own), once the entry's digests are checked (while ONNX Runtime loads it);
    None, with a warning, if the entry is damaged or ONNX Runtime refuses it."""
    options = settings.session_options()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # optimized when prepared
    check = EntryCheck(place)
    try:
        session = ort.InferenceSession(
            str(place / _PREPARED_MODEL), options, providers=["CPUExecutionProvider"], read_config_from_model=0
        )
    except Exception as e:
        check.problem()
        why: str | None = f"ONNX Runtime refused it ({first_line(e)})"
    else:
        why = check.problem()
    if why is None:
        return session
    warnings.warn(
        f"onnxruntime: the prepared model in {place} is not used: {why}; the weights are packed again; "
        "`torchdelegate prepare FILE` writes it again",
        stacklevel=2,
    )
    return None


def save_prepared(options: Any, directory: Path) -> None:
    """Have the session being built also write its optimized model and packed weights into ``directory``."""
    options.optimized_model_filepath = str(directory / _PREPARED_MODEL)
    options.add_session_config_entry("session.save_external_prepacked_constant_initializers", "1")
    options.add_session_config_entry("session.optimized_model_external_initializers_file_name", _PREPARED_WEIGHTS)
    smallest = str(SMALLEST_SHARED)
    options.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", smallest)
    options.log_severity_level = 3  # not its warning that the model suits this machine only: the entry is keyed so
