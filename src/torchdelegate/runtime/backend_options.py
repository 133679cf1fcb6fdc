"""Load-time backend options: what depends on the machine that runs a file, not the one that lowered it.

``load(path, backend_options={"onnxruntime": {"intra_op_num_threads": 4}})`` sets, for this
process, compile specs a backend declares in ``BackendDetails.load_options``: each delegate of that
backend is initialized with the option in place of the file's compile spec of the same key. The file
is not changed. An option for a backend the file does not use, or a key its backend does not
declare, is a ``BackendOptionError`` (a ``ValueError``) naming what it takes.

``TORCHDELEGATE_BACKEND_OPTIONS`` sets options for every load of a process and the commands it
starts, as ``OMP_NUM_THREADS`` does (``onnxruntime.intra_op_spinning=0`` on a machine other busy
processes share): ``ID.KEY=VALUE`` items separated by spaces or commas. Its options for backends a
file does not use are ignored; those ``load`` is given take their place.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

from torchdelegate.delegate.array_runtime import array_runtime
from torchdelegate.delegate.specs import CompileSpec
from torchdelegate.errors import TorchDelegateError

BackendOptions = dict[str, dict[str, bytes]]


class BackendOptionError(TorchDelegateError, ValueError):
    """A load option for a backend the file does not use, or one its backend does not declare."""


BACKEND_OPTIONS_VARIABLE = "TORCHDELEGATE_BACKEND_OPTIONS"


def parsed_option(text: str) -> tuple[str, str, str] | None:
    """``ID.KEY=VALUE`` as its three parts, stripped; None if it is not of that form."""
    name, equals, value = text.partition("=")
    backend_id, dot, key = name.partition(".")
    backend_id, key = backend_id.strip(), key.strip()
    return (backend_id, key, value.strip()) if equals and dot and backend_id and key else None


def environment_options(backend_ids: Iterable[str]) -> dict[str, dict[str, str]]:
    """``TORCHDELEGATE_BACKEND_OPTIONS``'s options for ``backend_ids`` (the others ignored); a
    ``BackendOptionError`` naming an item that is not ``ID.KEY=VALUE``."""
    used = set(backend_ids)
    options: dict[str, dict[str, str]] = {}
    for text in os.environ.get(BACKEND_OPTIONS_VARIABLE, "").replace(",", " ").split():
        parsed = parsed_option(text)
        if parsed is None:
            raise BackendOptionError(
                f"{BACKEND_OPTIONS_VARIABLE}: {text!r} is not ID.KEY=VALUE (e.g. onnxruntime.intra_op_spinning=0)"
            )
        backend_id, key, value = parsed
        if backend_id in used:
            options.setdefault(backend_id, {})[key] = value
    return options


def checked_backend_options(options: Any, backend_ids: Iterable[str], where: str) -> BackendOptions:
    """``options`` (``{backend_id: {key: value}}``) over ``TORCHDELEGATE_BACKEND_OPTIONS``'s, as
    compile-spec bytes, each checked against the backends of the file (``backend_ids``) and the keys
    each declares."""
    used = sorted(set(backend_ids))
    checked = _checked(environment_options(used), used, where, BACKEND_OPTIONS_VARIABLE)
    if options is None:
        return checked
    if not isinstance(options, Mapping):
        raise TypeError(f"backend_options must map backend ids to {{key: value}}, got {type(options).__name__}")
    for backend_id, values in _checked(options, used, where, "backend_options").items():
        checked[backend_id] = {**checked.get(backend_id, {}), **values}
    return checked


def _checked(options: Mapping[Any, Any], used: list[str], where: str, source: str) -> BackendOptions:
    checked: BackendOptions = {}
    for backend_id, values in sorted(options.items(), key=lambda item: str(item[0])):
        if backend_id not in used:
            raise BackendOptionError(
                f"{source} names backend {backend_id!r}, which no delegate of {where} uses; its backends are {used}"
            )
        if not isinstance(values, Mapping):
            raise TypeError(f"{source}[{backend_id!r}] must map option names to values, got {values!r:.80}")
        declared = declared_load_options(backend_id)
        checked[backend_id] = {}
        for key, value in sorted(values.items(), key=lambda item: str(item[0])):
            if key not in declared:
                known = "; ".join(f"{name}: {meaning}" for name, meaning in sorted(declared.items())) or "none"
                raise BackendOptionError(
                    f"{source}: backend {backend_id!r} takes no load option {key!r}; its options are: {known}"
                )
            if not isinstance(value, (bool, int, float, str)):
                raise TypeError(f"{source}[{backend_id!r}][{key!r}] must be a number, a bool or a string")
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
