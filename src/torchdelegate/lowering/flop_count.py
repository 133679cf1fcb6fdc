"""A computation's FLOPs as torch counts them (``torch.utils.flop_counter``), for the report.

Matrix products, convolutions and attention count; element-wise work weighs nothing. The count is
read from the shapes export recorded, at the sizes it traced with (a dynamic dimension at its
example's size, without adding a guard that would make it static); a node without shapes, or one
torch's counter cannot read, counts zero. A linear layer kept whole through decomposition counts
as the ``addmm`` it becomes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.fx import Node
from torch.utils.flop_counter import flop_registry


def _at_example_sizes(value: Any) -> Any:
    """A tensor of symbolic sizes as a meta tensor of the sizes export traced with (its example's).

    FLOPs are counted at those sizes. Reading a symbolic size as an int would instead add a guard to
    the program's shape environment and make the caller's dynamic dimension static."""
    if not isinstance(value, torch.Tensor) or all(isinstance(size, int) for size in value.shape):
        return value
    return torch.empty(_shape(value), dtype=value.dtype, device="meta")


class _NoExampleSize(Exception):
    pass


def _example_value(argument: Any) -> Any:
    return _at_example_sizes(argument.meta.get("val")) if isinstance(argument, Node) else argument


def _linear_flops(node: Node) -> int:
    """A linear layer kept whole through decomposition (torch counts it as the ``addmm`` it becomes):
    two FLOPs per input feature of each output value."""
    try:
        output, weight = _example_value(node), _example_value(node.args[1])
    except _NoExampleSize:
        return 0
    if not isinstance(output, torch.Tensor) or not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        return 0
    return 2 * output.numel() * weight.shape[1]


def _mapped(function: Callable[[Any], Any], value: Any) -> Any:
    """``function`` applied to every leaf of the lists, tuples and dicts in ``value`` (a node's arguments)."""
    if isinstance(value, list):  # fx keeps a list argument as a list type of its own
        return [_mapped(function, item) for item in value]
    if type(value) is tuple:
        return tuple(_mapped(function, item) for item in value)
    if isinstance(value, dict):
        return {key: _mapped(function, item) for key, item in value.items()}
    return function(value)


def node_flops(node: Node) -> int:
    """torch's FLOP count for ``node`` from the shapes export recorded; 0 when it has none."""
    target = node.target
    if target is torch.ops.aten.linear.default:
        return _linear_flops(node)
    packet = getattr(target, "overloadpacket", None)
    count = flop_registry.get(packet) if packet is not None else None
    if count is None or "val" not in node.meta:
        return 0

    formula = getattr(count, "__wrapped__", None)  # torch's formula on shapes, inside its pytree-walking wrapper
    try:
        if formula is not None:
            args = _mapped(_example_shape, node.args)
            kwargs = _mapped(_example_shape, node.kwargs)
            return int(formula(*args, **kwargs, out_shape=_mapped(_shape, node.meta["val"])))
        args = _mapped(_example_value, node.args)
        kwargs = _mapped(_example_value, node.kwargs)
        output = _mapped(_at_example_sizes, node.meta["val"])
        return int(count(*args, **kwargs, out_val=output))
    except Exception:  # a shape torch's counter cannot read: count nothing
        return 0


def _shape(value: Any) -> Any:
    """A tensor's sizes at the example export traced with; other values as they are."""
    if not isinstance(value, torch.Tensor):
        return value
    sizes = tuple(size if isinstance(size, int) else size.node.hint for size in value.shape)
    if any(size is None for size in sizes):  # data-dependent: no example size
        raise _NoExampleSize
    return sizes


def _example_shape(argument: Any) -> Any:
    return _shape(argument.meta.get("val")) if isinstance(argument, Node) else argument
