"""Argument contracts of the listed operators whose kernels take their arguments on trust.

A saved graph chooses every argument of every call. Most ATen kernels check theirs against their
inputs; the few here do not, and would read memory outside their inputs (a view with caller-given
sizes and strides, per-channel tensors shorter than the channels), crash (FFT dimensions, modes
that do not exist, an integer step of 0) or hand back memory never written (``empty``). Each runs
behind its contract (:func:`contracted`), checked before the kernel runs (a ``FormatError`` naming
the operator and what is wrong) or making the result deterministic (``empty`` gives zeros); an
operator whose output's sizes come from its arguments has them checked after it runs.
``node_checks`` puts these calls into a loaded graph.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch._ops import OpOverload

from torchdelegate.errors import FormatError
from torchdelegate.serialize.operator_list import ATEN_OPERATORS

_aten = torch.ops.aten


def _viewed_span(sizes: Any, strides: Any, offset: int) -> tuple[int, int] | None:
    """The first and last storage element a view reaches; None when it has no elements."""
    if any(size == 0 for size in sizes):
        return None
    return offset, offset + sum((size - 1) * stride for size, stride in zip(sizes, strides, strict=True))


def _as_strided(op: OpOverload, x: torch.Tensor, size: Any, stride: Any, storage_offset: Any = None) -> torch.Tensor:
    sizes, strides = [int(s) for s in size], [int(s) for s in stride]
    if len(sizes) != len(strides) or any(s < 0 for s in (*sizes, *strides)):
        raise FormatError(f"aten.as_strided: sizes {sizes} and strides {strides} do not describe a view")
    offset = int(x.storage_offset()) if storage_offset is None else int(storage_offset)
    wanted = _viewed_span(sizes, strides, offset)
    if wanted is not None:
        own = _viewed_span(x.shape, x.stride(), int(x.storage_offset()))
        dense = x.is_contiguous() or x.is_contiguous(memory_format=torch.channels_last)
        if own is None or not dense or wanted[0] < own[0] or wanted[1] > own[1]:
            raise FormatError(
                f"aten.as_strided: a view of sizes {sizes}, strides {strides} and offset {offset} reaches outside "
                f"its input (sizes {list(x.shape)}, strides {list(x.stride())}, offset {x.storage_offset()})"
            )
    return op(x, size, stride, storage_offset)  # type: ignore[no-any-return]


def _zeroed(op: OpOverload, *args: Any, **kwargs: Any) -> torch.Tensor:
    result: torch.Tensor = op(*args, **kwargs)
    return result.zero_()


def _per_channel(name: str, x: torch.Tensor, tensors: dict[str, Any]) -> None:
    if x.dim() < 2:
        raise FormatError(f"aten.{name}: an input of sizes {list(x.shape)} has no channel dimension")
    channels = x.shape[1]
    for what, tensor in tensors.items():
        if tensor is not None and (tensor.dim() != 1 or tensor.numel() != channels):
            raise FormatError(
                f"aten.{name}: {what} has sizes {list(tensor.shape)}; an input of sizes {list(x.shape)} needs one "
                f"value per channel ({channels})"
            )


def _batch_norm_no_training(
    op: OpOverload, x: torch.Tensor, weight: Any, bias: Any, mean: Any, var: Any, *rest: Any
) -> Any:
    _per_channel(op._opname, x, {"weight": weight, "bias": bias, "running_mean": mean, "running_var": var})
    return op(x, weight, bias, mean, var, *rest)


def _batch_norm_no_stats(op: OpOverload, x: torch.Tensor, weight: Any, bias: Any, training: Any, *rest: Any) -> Any:
    """Without running statistics, only training mode has statistics to normalize by (its batch's)."""
    _per_channel(op._opname, x, {"weight": weight, "bias": bias})
    if not training:
        raise FormatError(f"aten.{op._opname}.no_stats: outside training, there are no statistics to normalize by")
    return op(x, weight, bias, training, *rest)


def _expand(op: OpOverload, x: torch.Tensor, size: Any, *rest: Any, **kwargs: Any) -> torch.Tensor:
    """-1 keeps a size of the input; a new leading dimension has none to keep."""
    sizes = [int(s) for s in size]
    new = len(sizes) - x.dim()
    if new < 0 or any(s < -1 or (s == -1 and number < new) for number, s in enumerate(sizes)):
        raise FormatError(f"aten.expand: sizes {sizes} do not expand an input of sizes {list(x.shape)}")
    return op(x, size, *rest, **kwargs)  # type: ignore[no-any-return]


def _pdist(op: OpOverload, x: torch.Tensor, p: Any = 2.0) -> torch.Tensor:
    """The kernel behind ``torch.pdist``, which checks what it is given; the kernel itself does not."""
    if x.dim() != 2 or not x.is_floating_point() or not float(p) >= 0:
        raise FormatError(f"aten._pdist_forward: needs rows of a 2-D float tensor and p >= 0, not {list(x.shape)}, {p}")
    return op(x.contiguous(), p)  # type: ignore[no-any-return]


def _range(op: OpOverload, start: Any, end: Any, step: Any = 1, *rest: Any, **kwargs: Any) -> torch.Tensor:
    """An integer range steps by the step made an integer: a fractional step of 0 divided by zero."""
    dtype = kwargs.get("dtype", rest[0] if rest else None)
    integral = dtype is not None and not (dtype.is_floating_point or dtype.is_complex)
    if integral and int(step) == 0:
        raise FormatError(f"aten.{op._opname}: a step of {step} is 0 as a {dtype}")
    return op(start, end, step, *rest, **kwargs)  # type: ignore[no-any-return]


def _grid_sampler(op: OpOverload, x: torch.Tensor, grid: torch.Tensor, mode: Any, padding: Any, *rest: Any) -> Any:
    """Modes are enums passed as integers; the kernels dispatch on them unchecked."""
    modes = (0, 1, 2) if op is _aten.grid_sampler_2d.default else (0, 1)
    if int(mode) not in modes or int(padding) not in (0, 1, 2):
        raise FormatError(f"aten.{op._opname}: interpolation mode {mode} or padding mode {padding} does not exist")
    return op(x, grid, mode, padding, *rest)


def _fft_dims(name: str, x: torch.Tensor, dim: Any, normalization: Any) -> None:
    dims = [int(d) for d in dim]
    rank = x.dim()
    if not dims or any(not 0 <= d < rank for d in dims) or len(set(dims)) != len(dims):
        raise FormatError(
            f"aten.{name}: dims {dims} are not distinct dimensions of an input of rank {rank}, counted from 0"
        )
    if int(normalization) not in (0, 1, 2):
        raise FormatError(f"aten.{name}: normalization {normalization} is not 0, 1 or 2")


def _fft_r2c(op: OpOverload, x: torch.Tensor, dim: Any, normalization: Any, onesided: Any) -> torch.Tensor:
    _fft_dims(op._opname, x, dim, normalization)
    return op(x, dim, normalization, onesided)  # type: ignore[no-any-return]


def _fft_c2c(op: OpOverload, x: torch.Tensor, dim: Any, normalization: Any, forward: Any) -> torch.Tensor:
    _fft_dims(op._opname, x, dim, normalization)
    return op(x, dim, normalization, forward)  # type: ignore[no-any-return]


def _noise_like_input(op: OpOverload, x: torch.Tensor, noise: torch.Tensor, *rest: Any, **kwargs: Any) -> Any:
    """In training, the kernel writes one noise value per element of the input into ``noise``."""
    if isinstance(noise, torch.Tensor) and isinstance(x, torch.Tensor) and noise.shape != x.shape:
        raise FormatError(f"aten.{op._opname}: noise of sizes {list(noise.shape)} for an input of {list(x.shape)}")
    return op(x, noise, *rest, **kwargs)


def _fft_c2r(op: OpOverload, x: torch.Tensor, dim: Any, normalization: Any, last_dim_size: Any) -> torch.Tensor:
    _fft_dims(op._opname, x, dim, normalization)
    last = x.shape[int(dim[-1])]
    if int(last_dim_size) < 1 or last != int(last_dim_size) // 2 + 1:
        raise FormatError(
            f"aten.{op._opname}: a last dimension of {last} complex values does not make {last_dim_size} real ones"
        )
    return op(x, dim, normalization, last_dim_size)  # type: ignore[no-any-return]


_CONTRACTS: dict[OpOverload, Callable[..., Any]] = {
    _aten.as_strided.default: _as_strided,
    _aten.expand.default: _expand,
    _aten._pdist_forward.default: _pdist,
    _aten.range.step: _range,
    _aten.grid_sampler_2d.default: _grid_sampler,
    _aten.grid_sampler_3d.default: _grid_sampler,
    _aten.arange.start_step: _range,
    **{op: _zeroed for op in (_aten.empty.memory_format, _aten.empty_strided.default, _aten.empty_like.default)},
    _aten.new_empty.default: _zeroed,
    _aten._native_batch_norm_legit_no_training.default: _batch_norm_no_training,
    _aten._native_batch_norm_legit.default: _batch_norm_no_training,
    _aten._native_batch_norm_legit_functional.default: _batch_norm_no_training,
    _aten._native_batch_norm_legit.no_stats: _batch_norm_no_stats,
    _aten._fft_r2c.default: _fft_r2c,
    _aten._fft_c2r.default: _fft_c2r,
    _aten._fft_c2c.default: _fft_c2c,
    _aten.rrelu_with_noise_functional.default: _noise_like_input,
}


def _output_sizes(op: OpOverload, *args: Any, **kwargs: Any) -> Any:
    """Pools and resampling take the sizes of their output from the caller: kernels kept a negative one."""
    position = next(i for i, a in enumerate(op._schema.arguments) if a.name == "output_size")
    sizes = kwargs.get("output_size") if len(args) <= position else args[position]
    if sizes is not None and any(int(size) < 0 for size in sizes):
        raise FormatError(f"aten.{op._opname}: output size {[int(size) for size in sizes]} is negative")
    return op(*args, **kwargs)


def _with_output_sizes() -> dict[OpOverload, Callable[..., Any]]:
    """A contract for every listed operator that takes its output's sizes (``output_size``)."""
    found: dict[OpOverload, Callable[..., Any]] = {}
    for entry in sorted(ATEN_OPERATORS):
        name, overload = entry.split(".")
        op = getattr(getattr(_aten, name), overload)
        if any(a.name == "output_size" for a in op._schema.arguments):
            found[op] = _CONTRACTS.get(op, _output_sizes)
    return found


_CONTRACTS.update(_with_output_sizes())


def _sized_by_arguments() -> frozenset[OpOverload]:
    """Listed operators that take sizes, paddings, kernels or strides (integer lists other than
    dimensions): kernels made tensors of negative size from negative ones."""
    found = set()
    for entry in sorted(ATEN_OPERATORS):
        name, overload = entry.split(".")
        op = getattr(getattr(_aten, name), overload)
        if any("List[int]" in str(a.type) and a.name not in ("dim", "dims") for a in op._schema.arguments):
            found.add(op)
    return frozenset(found)


_SIZED_BY_ARGUMENTS = _sized_by_arguments()


def _negative_size(outputs: Any) -> list[int] | None:
    if isinstance(outputs, torch.Tensor):
        return list(outputs.shape) if any(size < 0 for size in outputs.shape) else None
    if isinstance(outputs, (tuple, list)):
        return next((sizes for output in outputs if (sizes := _negative_size(output)) is not None), None)
    return None


@functools.cache
def contracted(op: OpOverload) -> Callable[..., Any]:
    """``op`` behind its contract, and for an operator sized by its arguments, with its outputs' sizes
    checked after it runs; ``op`` itself for any other."""
    contract = _CONTRACTS.get(op)
    sized = op in _SIZED_BY_ARGUMENTS
    if contract is None and not sized:
        return op

    def call(*args: Any, **kwargs: Any) -> Any:
        result = op(*args, **kwargs) if contract is None else contract(op, *args, **kwargs)
        if sized and (sizes := _negative_size(result)) is not None:
            raise FormatError(f"aten.{op._opname}: its arguments make a tensor of sizes {sizes}")
        return result

    return call
