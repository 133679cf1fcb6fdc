"""What each call of a loaded graph runs behind: its operator's contract, a check that the tensors it
requires are given, and size arithmetic kept within 64 bits.

Kernels dereference a required tensor argument unchecked (``aten.copy(None, None)`` crashed the
process). A tensor that is missing whatever the inputs (None, or the result of an operator that
returns nothing) is refused when the graph is loaded; one read from a tuple, which may hold None,
is checked when the call runs, at the positions that read it only. Python's integers have no bound:
``_operator.pow(10, 300000000)`` in a graph computes for minutes, so size arithmetic refuses a
result (or a power) past 64 bits.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from typing import Any

import torch
from torch._ops import OpOverload

from torchdelegate.errors import FormatError
from torchdelegate.serialize.operator_contracts import contracted

_INT64 = 1 << 63
_SIZE_ARITHMETIC: frozenset[Callable[..., Any]] = frozenset(
    {operator.add, operator.sub, operator.mul, operator.floordiv, operator.mod, operator.neg, operator.pow}
)
_MADE: dict[Callable[..., Any], Any] = {}


def operator_behind(target: Any) -> Any:
    """The operator (or builtin) a :func:`checked_call` stands for; ``target`` itself for any other."""
    return _MADE.get(target, target)


def tensor_arguments(op: OpOverload) -> tuple[str, ...]:
    """The names of ``op``'s tensor and tensor-list arguments."""
    return tuple(a.name for a in op._schema.arguments if _is_tensor(a.type) or _tensors_of(a.type))


def checked_call(target: Any, given_at: tuple[str, ...] = ()) -> Any:
    """What a loaded graph calls for ``target``: an operator behind its contract, with the tensor
    arguments named in ``given_at`` checked to be given when it runs; size arithmetic bounded; any
    other target itself."""
    target = operator_behind(target)
    if target in _SIZE_ARITHMETIC:
        return _bounded(target)
    if not isinstance(target, OpOverload):
        return target
    call = contracted(target)
    return target if call is target and not given_at else _given(target, call, given_at)


def node_target(node: torch.fx.Node) -> Any:
    """What a loaded graph's ``node`` calls (:func:`checked_call`); a ``FormatError`` now when a tensor
    it requires is missing whatever the inputs."""
    target = operator_behind(node.target)
    if not isinstance(target, OpOverload):
        return checked_call(target)
    name = missing_tensor(target, node.args, node.kwargs, _missing_in_any_run)
    if name is not None:
        raise FormatError(f"node {node.name!r} calls aten.{target._opname} without its tensor argument {name!r}")
    given = _given_arguments(target, node.args, node.kwargs)
    from_tuple = tuple(name for name, value in given.items() if _any_value(value, _read_from_tuple))
    return checked_call(target, from_tuple)


def missing_tensor(op: OpOverload, args: Any, kwargs: Any, absent: Callable[[Any], bool]) -> str | None:
    """The name of the first tensor argument of ``op`` that ``absent`` says is missing."""
    given = _given_arguments(op, args, kwargs)
    for name in tensor_arguments(op):
        if name in given and _any_value(given[name], absent):
            return name
    return None


def _given_arguments(op: OpOverload, args: Any, kwargs: Any) -> dict[str, Any]:
    return dict(zip((a.name for a in op._schema.arguments), args, strict=False)) | dict(kwargs)


def _any_value(value: Any, test: Callable[[Any], bool]) -> bool:
    return any(test(v) for v in value) if isinstance(value, (list, tuple)) else test(value)


def _is_tensor(kind: Any) -> bool:
    return isinstance(kind, torch._C.TensorType)


def _tensors_of(kind: Any) -> bool:
    return isinstance(kind, torch._C.ListType) and _is_tensor(kind.getElementType())


def _missing_in_any_run(value: Any) -> bool:
    if value is None:
        return True
    target = operator_behind(value.target) if isinstance(value, torch.fx.Node) else None
    return isinstance(target, OpOverload) and not target._schema.returns


def _read_from_tuple(value: Any) -> bool:
    return isinstance(value, torch.fx.Node) and value.target is operator.getitem


@functools.cache
def _given(op: OpOverload, call: Callable[..., Any], names: tuple[str, ...]) -> Callable[..., Any]:
    places = {a.name: number for number, a in enumerate(op._schema.arguments)}
    checked = [(name, places[name]) for name in names]

    def given(*args: Any, **kwargs: Any) -> Any:
        for name, place in checked:
            value = args[place] if place < len(args) else kwargs.get(name, ())
            if value is None or (isinstance(value, (list, tuple)) and any(v is None for v in value)):
                raise FormatError(f"aten.{op._opname}: tensor argument {name!r} is missing (None)")
        return call(*args, **kwargs)

    return _named(given, op, f"checked_{op._opname}_{op._overloadname}")


@functools.cache
def _bounded(function: Callable[..., Any]) -> Callable[..., Any]:
    def bounded(*args: Any) -> Any:
        if function is operator.pow and _too_large_a_power(*args):
            raise FormatError(f"a size computed as {args[0]} ** {args[1]} is past 64 bits")
        result = function(*args)
        if isinstance(result, int) and not -_INT64 <= result < _INT64:
            raise FormatError(f"a size computed by {function.__name__}{args} is past 64 bits")
        return result

    return _named(bounded, function, f"bounded_{function.__name__}")


def _too_large_a_power(base: Any, exponent: Any) -> bool:
    return isinstance(base, int) and isinstance(exponent, int) and abs(base) > 1 and exponent > 64


def _named(made: Callable[..., Any], behind: Any, name: str) -> Callable[..., Any]:
    made.__name__ = made.__qualname__ = name
    made.__module__ = __name__
    _MADE[made] = behind
    return made
