"""How the commands describe a method's outputs: the container type, each output's place in it, its values."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

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


def output_names(paths: list[tuple[Any, ...]]) -> list[str]:
    """Each output's place in the method's output structure (``logits``, ``past_key_values.0.1``);
    none for a flat tuple, whose places are the outputs' numbers."""
    if all(len(path) == 1 and isinstance(path[0], torch.utils._pytree.SequenceKey) for path in paths):
        return [""] * len(paths)
    names = []
    for path in paths:
        parts = []
        for key in path:
            for attribute in ("key", "idx", "name"):  # MappingKey, SequenceKey, GetAttrKey
                if hasattr(key, attribute):
                    parts.append(str(getattr(key, attribute)))
                    break
        names.append(".".join(parts))
    return names


def as_array(value: Any) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    return np.asarray(value)


def describe_value(value: Any) -> str:
    if not isinstance(value, torch.Tensor):
        return repr(value)
    dtype = str(value.dtype).removeprefix("torch.")
    head = np.array2string(value.detach().reshape(-1)[:6].numpy(), precision=4, separator=", ", max_line_width=10**4)
    more = " ..." if value.numel() > 6 else ""
    return f"{dtype}[{', '.join(map(str, value.shape))}] {head}{more}"
