"""Load-time backend options: what depends on the machine that runs a file, not the one that lowered it.

``load(path, backend_options={"onnxruntime": {"intra_op_num_threads": 4}})`` sets, for this
process, compile specs a backend declares in ``BackendDetails.load_options``: each delegate of that
backend is initialized with the option in place of the file's compile spec of the same key. The file
is not changed. An option for a backend the file does not use, or a key its backend does not
declare, is a ``BackendOptionError`` (a ``ValueError``) naming what it takes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from torchdelegate.delegate.array_runtime import array_runtime
from torchdelegate.delegate.specs import CompileSpec

BackendOptions = dict[str, dict[str, bytes]]


class BackendOptionError(ValueError):
    """A load option for a backend the file does not use, or one its backend does not declare."""


def checked_backend_options(options: Any, backend_ids: Iterable[str], where: str) -> BackendOptions:
    """``options`` (``{backend_id: {key: value}}``) as compile-spec bytes, each checked against the
    backends of the file (``backend_ids``) and the keys each declares."""
    if options is None:
        return {}
    if not isinstance(options, Mapping):
        raise TypeError(f"backend_options must map backend ids to {{key: value}}, got {type(options).__name__}")
    used = sorted(set(backend_ids))
    checked: BackendOptions = {}
    for backend_id, values in sorted(options.items(), key=lambda item: str(item[0])):
        if backend_id not in used:
            raise BackendOptionError(
                f"backend_options names backend {backend_id!r}, which no delegate of {where} uses; its backends are "
                f"{used}"
            )
        if not isinstance(values, Mapping):
            raise TypeError(f"backend_options[{backend_id!r}] must map option names to values, got {values!r:.80}")
        declared = declared_load_options(backend_id)
        checked[backend_id] = {}
        for key, value in sorted(values.items(), key=lambda item: str(item[0])):
            if key not in declared:
                known = "; ".join(f"{name}: {meaning}" for name, meaning in sorted(declared.items())) or "none"
                raise BackendOptionError(
                    f"backend_options: backend {backend_id!r} takes no load option {key!r}; its options are: {known}"
                )
            if not isinstance(value, (bool, int, float, str)):
                raise TypeError(f"backend_options[{backend_id!r}][{key!r}] must be a number, a bool or a string")
            text = ("1" if value else "0") if isinstance(value, bool) else str(value)
            checked[backend_id][key] = text.encode()
    return checked


def declared_load_options(backend_id: str) -> dict[str, str]:
    """The load options ``backend_id`` declares: its array runtime's when it has one (a process without
    torch reads them there), else its ``BackendDetails``'."""
    runtime = array_runtime(backend_id)
    if runtime is not None:
        return runtime.load_options
    from torchdelegate.delegate.backend_details import get_backend

    return get_backend(backend_id).load_options


def with_load_options(compile_specs: list[CompileSpec], values: Mapping[str, bytes]) -> list[CompileSpec]:
    """``compile_specs`` with each of ``values`` in place of the spec of its key (added if absent)."""
    if not values:
        return compile_specs
    kept = [spec for spec in compile_specs if spec.key not in values]
    return [*kept, *(CompileSpec(key, value) for key, value in sorted(values.items()))]
