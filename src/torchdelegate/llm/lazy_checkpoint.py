"""A transformers checkpoint's model built without its weights: over fake tensors, each state
entry matched to its tensor in the checkpoint's safetensors files (read by memory map when a
later stage reads it), and the buffers its constructor computes (rotary frequencies) made for
real, as transformers makes them after loading.

Where that cannot be done (weights not in safetensors, names the files do not hold, a buffer
the model's own initialization does not compute) the caller loads the checkpoint whole and says
why; the result is the same program either way.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

from torchdelegate.errors import CheckpointError, first_line
from torchdelegate.exported.safetensors_weights import SafetensorsWeights
from torchdelegate.exported.weightless_export import weightless


def weightless_model(
    transformers: Any, directory: Path, config: Any, trust_remote_code: bool = False
) -> tuple[tuple[Any, dict[str, torch.Tensor]] | None, str | None]:
    """(the model over fake tensors, each ``state_dict`` name's tensor in the files), or (None, why not).
    The checkpoint's own model class (its ``auto_map``) is used only where ``trust_remote_code``."""
    try:
        files = SafetensorsWeights(directory)
    except CheckpointError as e:
        return None, str(e)
    try:
        with weightless():
            model = transformers.AutoModelForCausalLM.from_config(
                config, dtype=torch.float32, trust_remote_code=trust_remote_code
            ).eval()
    except Exception as e:
        raise CheckpointError(
            f"{directory}: {type(config).__name__} cannot be built from its config "
            f"({type(e).__name__}: {first_line(e)})"
        ) from e
    weights, missing = _matched(model, files)
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        return None, f"the safetensors files hold no tensor for {shown}"
    uncomputed = _computed_buffers(model)
    if uncomputed:
        return None, f"the model's initialization does not compute its buffer {uncomputed}"
    return (model, weights), None


def _matched(model: Any, files: SafetensorsWeights) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Each persistent state name's tensor in ``files``: by its own name, without or with the base
    model's prefix, or by the name of a tensor tied to it; the names none of these find."""
    prefix = getattr(model, "base_model_prefix", "") or ""
    state = model.state_dict(keep_vars=True)
    by_tensor: dict[int, list[str]] = {}
    for name, tensor in state.items():
        by_tensor.setdefault(id(tensor), []).append(name)
    found: dict[str, torch.Tensor] = {}
    missing = []
    for name, tensor in state.items():
        stored = next(
            (
                candidate
                for tied in by_tensor[id(tensor)]
                for candidate in (tied, tied.removeprefix(prefix + "."), f"{prefix}.{tied}")
                if candidate in files.locations
            ),
            None,
        )
        if stored is None:
            missing.append(name)
        else:
            found[name] = files[stored]
    return found, missing


def _computed_buffers(model: Any) -> str | None:
    """Make real the buffers the model's constructor computes and its checkpoint does not hold, by
    transformers' own initialization of their modules; the first it leaves unset, if any."""
    owners: dict[str, Any] = {}
    for name, buffer in list(model.named_buffers()):
        module_name, _, attribute = name.rpartition(".")
        module = model.get_submodule(module_name)
        if attribute not in module._non_persistent_buffers_set or not isinstance(buffer, FakeTensor):
            continue
        if not buffer.is_floating_point():
            return name
        module._buffers[attribute] = torch.full(buffer.shape, math.nan, dtype=buffer.dtype)
        owners[module_name] = module
    for module_name, module in owners.items():
        try:
            model._init_weights(module)
        except Exception:
            return module_name or type(module).__name__
    for module_name, module in owners.items():
        for attribute in module._non_persistent_buffers_set:
            value = module._buffers.get(attribute)
            if isinstance(value, torch.Tensor) and value.is_floating_point() and bool(value.isnan().any()):
                return f"{module_name}.{attribute}".lstrip(".")
    return None
