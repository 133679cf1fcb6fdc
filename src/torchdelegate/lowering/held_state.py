"""The bytes of state each method holds, a tensor several names or methods hold counted once.

Read when lowering, keyed by the memory each tensor reads (:data:`Memory`), so that a report made
later keeps these counts and not the caller's tensors (tied embeddings, weights ``prefill`` and
``decode`` share: one entry).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch.export import ExportedProgram

Memory = tuple[int, int, torch.dtype, tuple[int, ...]]  # what a tensor reads: see _memory


def held_state(programs: Mapping[str, ExportedProgram]) -> dict[str, dict[Memory, int]]:
    """Per method, the bytes of each parameter, buffer and constant it holds, keyed by the memory
    the tensor reads (two names of one tensor are one entry). Read when lowering: a report made
    later keeps these counts, not the tensors."""
    held = {}
    for method, program in programs.items():
        values = (*program.state_dict.values(), *program.constants.values())
        held[method] = {_memory(v): v.nbytes for v in values if isinstance(v, torch.Tensor)}
    return held


def state_totals(held: Mapping[str, Mapping[Memory, int]]) -> tuple[dict[str, int], int]:
    """Bytes per method, and in all: a tensor that several names or methods hold (tied embeddings,
    weights shared by prefill and decode) counts once."""
    union: dict[Memory, int] = {}
    for tensors in held.values():
        union.update(tensors)
    return {method: sum(tensors.values()) for method, tensors in held.items()}, sum(union.values())


def state_bytes(programs: Mapping[str, ExportedProgram]) -> tuple[dict[str, int], int]:
    """Bytes of parameters, buffers and constants per method, and in all (see :func:`state_totals`)."""
    return state_totals(held_state(programs))


def _memory(tensor: torch.Tensor) -> Memory:
    """What a tensor reads: equal for two names of one tensor, different for two copies."""
    return tensor.untyped_storage().data_ptr(), int(tensor.storage_offset()), tensor.dtype, tuple(tensor.shape)
