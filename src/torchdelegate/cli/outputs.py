"""How the commands describe a method's outputs: the container type, each output's place in it, its values.

Outputs are numpy arrays (a file run without torch, or inputs given as arrays) or torch tensors (the
caller's choice where torch is imported); neither this module nor what it calls imports torch.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

_PLAIN_OUTPUTS = (None, "builtins.tuple", "builtins.list", "builtins.dict")


def named_output_type(output_type: str | None, plain_types: dict[str, str]) -> tuple[str | None, str | None]:
    """A method's output container worth naming (not a plain tuple, list or dict), and the plain
    type it is read as when this process has not registered it."""
    if output_type in _PLAIN_OUTPUTS:
        return None, None
    return output_type, plain_types.get(output_type or "")


def container_phrase(output_type: str | None, plain_types: dict[str, str]) -> str:
    """How the outputs came back, when it is more than a tuple: ", a T (returned as a dict)"."""
    named, plain = named_output_type(output_type, plain_types)
    if named is None:
        return ""
    return f", a {named}" + (f" (returned as a {plain}: not registered in this process)" if plain else "")


def flat_outputs(outputs: Any) -> list[tuple[tuple[Any, ...], Any]]:
    """Each output of a method's output structure with its path there, in the structure's order.

    Where torch is imported its pytree flattens them, so types registered there (a transformers
    ``ModelOutput``) are walked as torch walks them; otherwise tuples, lists and dicts are (the
    containers a file run without torch returns), a path being positions and keys."""
    torch = sys.modules.get("torch")
    if torch is not None:
        return list(torch.utils._pytree.tree_flatten_with_path(outputs)[0])
    flat: list[tuple[tuple[Any, ...], Any]] = []
    _walk(outputs, (), flat)
    return flat


def _walk(value: Any, path: tuple[Any, ...], flat: list[tuple[tuple[Any, ...], Any]]) -> None:
    if isinstance(value, dict):
        for key, item in value.items():
            _walk(item, (*path, key), flat)
    elif isinstance(value, (tuple, list)):
        names = getattr(value, "_fields", None) or range(len(value))  # a named tuple's fields by name
        for name, item in zip(names, value, strict=True):
            _walk(item, (*path, name), flat)
    else:
        flat.append((path, value))


def output_names(paths: list[tuple[Any, ...]]) -> list[str]:
    """Each output's place in the method's output structure (``logits``, ``past_key_values.0.1``);
    none for a flat tuple, whose places are the outputs' numbers. A path's keys are positions and
    names, or torch's pytree keys."""
    if all(len(path) == 1 and _is_position(path[0]) for path in paths):
        return [""] * len(paths)
    return [".".join(_key_name(key) for key in path) for path in paths]


def _is_position(key: Any) -> bool:
    return (isinstance(key, int) and not isinstance(key, bool)) or hasattr(key, "idx")  # torch's SequenceKey


def _key_name(key: Any) -> str:
    for attribute in ("key", "idx", "name"):  # torch's MappingKey, SequenceKey, GetAttrKey
        if hasattr(key, attribute):
            return str(getattr(key, attribute))
    return str(key)


def _is_torch_tensor(value: Any) -> bool:
    """Whether ``value`` is a torch tensor, asked without importing torch (a tensor means it is imported)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def as_array(value: Any) -> np.ndarray:
    if _is_torch_tensor(value):
        return value.detach().cpu().numpy()
    return np.asarray(value)


def describe_value(value: Any) -> str:
    """``float32[2, 4] [0.1, ...]``: an array's or tensor's dtype, shape and first values; other values' repr."""
    if _is_torch_tensor(value):
        dtype, flat = str(value.dtype).removeprefix("torch."), value.detach().reshape(-1)
        first, count = flat[:6].numpy(), flat.numel()
    elif isinstance(value, np.ndarray):
        dtype, first, count = str(value.dtype), value.reshape(-1)[:6], value.size
    else:
        return repr(value)
    head = np.array2string(first, precision=4, separator=", ", max_line_width=10**4)
    more = " ..." if count > 6 else ""
    return f"{dtype}[{', '.join(map(str, value.shape))}] {head}{more}"
