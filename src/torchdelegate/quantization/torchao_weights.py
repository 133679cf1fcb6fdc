"""A float weight quantized by torchao itself, by a recipe (:class:`QuantizedWeights`): once however many
methods and layers read it alike, a slice of rows at a time, into tensors spilled to a file.

The weight goes through ``torchao.quantization.quantize_`` on a stand-in linear layer that shares its
storage, so its integers, scales and zero points are exactly those of a model quantized with torchao
before export. Memory stays bounded: torchao's temporaries are a few times a slice, the quantized
tensors are written to an unlinked file as made, and a mapped weight's pages are let go once read.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

import torch

from torchdelegate.errors import QuantizationError, first_line
from torchdelegate.exported.freed_memory import return_freed_memory
from torchdelegate.exported.mapped_pages import release_buffer
from torchdelegate.exported.operator_libraries import LIBRARY_MODULES
from torchdelegate.exported.spilled_tensors import SpilledTensors
from torchdelegate.exported.torch_warnings import import_noise_quieted
from torchdelegate.quantization.recipe_table import Recipe

_SLICE_BYTES = 64 * 1024 * 1024  # float32 bytes of a weight quantized at a time
_Quantized = tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]
WeightsMade = dict[tuple[torch.Tensor, int, int | None, bool], _Quantized]
"""The quantized tensors one ``quantize`` call made, keyed by the weight and how it is quantized."""


class QuantizedWeights:
    """Each float weight's quantized tensors, made once however many methods and layers read it alike:
    ``made`` is shared by a call's recipes, keyed by the weight and how it is quantized."""

    def __init__(self, recipe: Recipe, group_size: int | None, made: WeightsMade) -> None:
        self.recipe, self.group_size = recipe, group_size
        self._made = made
        self._spilled = SpilledTensors()

    def quantized(self, weight: torch.Tensor, where: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """(integers as int8, scales, zero points, group size) of ``weight`` [out, in].

        One weight at a time: a weight stored in another float dtype (a bfloat16 checkpoint's) is
        converted to float32 here, its quantized tensors are spilled to a file as they are made, and
        the pages of a weight mapped from a checkpoint are let go once it is read."""
        key = (weight, self.recipe.weight_bits, self.group_size, self.recipe.symmetric)
        made = self._made.get(key)
        if made is None:
            made = self._made[key] = self._quantized_by_rows(weight, where)
        return made

    def _quantized_by_rows(
        self, weight: torch.Tensor, where: str
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """``weight`` quantized a slice of rows at a time (each row's groups are its own), into
        tensors spilled to a file: torchao's temporaries stay a few times a slice, not the weight."""
        rows = int(weight.shape[0])
        step = max(1, _SLICE_BYTES // max(1, 4 * int(weight[0].numel()))) if weight.dim() else 1
        parts: list[torch.Tensor] = []
        group = 0
        for start in range(0, rows, step):
            qdata, scale, zero_point, group = self._quantize(weight[start : start + step], where)
            if not parts:
                parts = [self._spilled.empty((rows, *t.shape[1:]), t.dtype) for t in (qdata, scale, zero_point)]
            for whole, part in zip(parts, (qdata, scale, zero_point), strict=True):
                whole[start : start + step] = part
                if part.nbytes:
                    release_buffer(whole[start : start + step])
            del qdata, scale, zero_point
            if weight.nbytes:
                release_buffer(weight[start : start + step])
            return_freed_memory()  # torchao's temporaries, a few times the slice
        return parts[0], parts[1], parts[2], group

    def _quantize(self, weight: torch.Tensor, where: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        columns = int(weight.shape[1])
        group = self.group_size or columns
        if columns % group:
            raise QuantizationError(
                f"{where}: group size {group} does not divide its {columns} inputs; choose a group size that "
                "divides the inputs of every layer quantized, or keep this layer in float (keep_float / --keep-float)"
            )
        torchao = torchao_quantization()
        holder = torch.nn.Linear(columns, int(weight.shape[0]), bias=False, device="meta")
        as_float = weight.detach() if weight.dtype == torch.float32 else weight.detach().float()
        holder.weight = torch.nn.Parameter(as_float, requires_grad=False)  # shared, not copied, when float32
        try:
            torchao.quantize_(holder, _torchao_config(torchao, self.recipe, group, columns))
        except Exception as e:
            raise QuantizationError(
                f"{where}: torchao could not quantize it ({type(e).__name__}: {first_line(e)}); keep it in float "
                "(keep_float / --keep-float)"
            ) from e
        quantized: Any = holder.weight  # torchao's IntxUnpackedToInt8Tensor
        return quantized.qdata, quantized.scale, quantized.zero_point, group


def torchao_quantization() -> ModuleType:
    """``torchao.quantization``, imported without the warnings torchao logs about the GPU kernels a
    CPU build cannot load; an ``ImportError`` saying what to install."""
    try:
        with import_noise_quieted():
            return importlib.import_module(LIBRARY_MODULES["torchao"])
    except ImportError as e:
        raise ImportError(
            "quantizing needs torchao: pip install 'torchdelegate[quantize]' (a lowered file runs without it)"
        ) from e


def _torchao_config(torchao: ModuleType, recipe: Recipe, group: int, columns: int) -> Any:
    """torchao's config of ``recipe`` for groups of ``group`` of ``columns`` inputs."""
    dtype = getattr(torch, "int4") if recipe.weight_bits == 4 else torch.int8  # noqa: B009  (typeshed lacks it)
    granularity = torchao.PerGroup(group) if group != columns or recipe.grouped else torchao.PerAxis(0)
    mapping = torchao.MappingType.SYMMETRIC if recipe.symmetric else torchao.MappingType.ASYMMETRIC
    if recipe.dynamic_int8_activation:
        return torchao.Int8DynamicActivationIntxWeightConfig(
            weight_dtype=dtype, weight_granularity=granularity, weight_mapping_type=mapping
        )
    return torchao.IntxWeightOnlyConfig(weight_dtype=dtype, granularity=granularity, mapping_type=mapping)
