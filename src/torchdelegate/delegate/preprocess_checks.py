"""A backend's ``preprocess`` result checked before lowering keeps it.

:func:`checked_result` says why a result is not a :class:`PreprocessResult` of bytes and named data;
:func:`checked_delegate_info` why its ``delegate_info`` is not JSON data (:func:`json_data_problem`,
which the compile cache's entries and the file writer ask too). A ``*_problem`` answers why not, or
None; a ``checked_*`` raises a ``PreprocessError`` naming the backend and the partition. None changes
a result.
"""

from __future__ import annotations

import json
import math
from typing import Any

from torchdelegate.delegate.named_data import NamedDataStoreOutput
from torchdelegate.delegate.preprocess_result import PreprocessResult
from torchdelegate.errors import PreprocessError


def json_data_problem(value: Any, path: str = "") -> str | None:
    """Why ``value`` is not JSON data (dicts with str keys, lists, str, finite numbers, bool, None), or None.

    ``path`` names where ``value`` sits (``['kernels'][0]``) in the answer.
    """
    if value is None or isinstance(value, (str, bool, int)):
        return None
    if isinstance(value, float):
        return None if math.isfinite(value) else f"{path or 'the value'} is {value}, which JSON cannot hold"
    if isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            problem = json_data_problem(item, f"{path}[{index}]")
            if problem:
                return problem
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                return f"{path or 'the dict'} has the key {key!r}, which is not a str"
            problem = json_data_problem(item, f"{path}[{key!r}]")
            if problem:
                return problem
        return None
    return f"{path or 'the value'} is a {type(value).__name__}"


def delegate_info_problem(info: Any) -> str | None:
    """Why ``info`` cannot be a delegate's info (JSON data), or None."""
    return json_data_problem(info)


def checked_delegate_info(result: PreprocessResult, backend_id: str, where: str) -> Any:
    """``result.delegate_info`` checked to be JSON data, as a copy the backend can no longer change.

    ``where`` names the partition (``partition 'tag' of method 'forward'``) in the error.
    """
    info = result.delegate_info
    if info is None:
        return None
    problem = delegate_info_problem(info)
    if problem:
        raise PreprocessError(
            f"backend {backend_id!r} returned a delegate_info for {where} that is not JSON data: {problem}; "
            "return str, int, float, bool, None, lists of them, or dicts with str keys of them"
        )
    return json.loads(json.dumps(info, allow_nan=False))


def checked_result(result: Any, backend_id: str, method: str) -> PreprocessResult:
    """``result`` if it is a ``PreprocessResult`` of bytes and named data; else a ``PreprocessError`` saying why."""
    if not isinstance(result, PreprocessResult):
        raise PreprocessError(
            f"backend {backend_id!r} returned {type(result).__name__} for method {method!r}; "
            "expected a PreprocessResult"
        )
    if not isinstance(result.processed_bytes, bytes):
        raise PreprocessError(
            f"backend {backend_id!r}: PreprocessResult.processed_bytes for method {method!r} is a "
            f"{type(result.processed_bytes).__name__}; expected bytes"
        )
    if result.data_store_output is not None and not isinstance(result.data_store_output, NamedDataStoreOutput):
        raise PreprocessError(
            f"backend {backend_id!r}: PreprocessResult.data_store_output for method {method!r} is a "
            f"{type(result.data_store_output).__name__}; use NamedDataStore.get_named_data_store_output()"
        )
    return result
