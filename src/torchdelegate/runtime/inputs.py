"""A method's calling convention and input checks, from its exported signature.

Inputs are bound the way the exported module binds them: positional and keyword
arguments by the forward's parameter names, then flattened to the exported structure.
Each leaf is checked against its placeholder: kind, dtype, device, rank, static sizes,
and the range (and equalities) of dynamic sizes. Errors name the method and the argument.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree

from torchdelegate.errors import FormatError, ProgramInputError
from torchdelegate.runtime.arguments import Dim, bound_arguments, check_sizes, dim_of, sizes_text
from torchdelegate.serialize.runnable_graph import ConstantValue, ResidualGraph, SymbolicValue, TensorValue


@dataclass(frozen=True)
class _Leaf:
    name: str
    kind: str  # "tensor", "int", "float", "bool" or "constant"
    dtype: torch.dtype | None = None
    device: torch.device | None = None
    dims: tuple[Dim, ...] = ()
    constant: Any = None
    static_shape: tuple[int, ...] | None = None  # every size fixed: one comparison checks them all


def _leaf(
    name: str, value: TensorValue | SymbolicValue | ConstantValue, ranges: Mapping[str, tuple[int | None, int | None]]
) -> _Leaf:
    """What a user input may be: a tensor, a symbolic number, or the one value it was exported with."""
    if isinstance(value, TensorValue):
        dims = tuple(dim_of(s, ranges) for s in value.sizes)
        sizes = tuple(d.value for d in dims if d.value is not None)
        static = sizes if len(sizes) == len(dims) else None
        return _Leaf(name, "tensor", value.dtype, value.device, dims, static_shape=static)
    if isinstance(value, SymbolicValue):
        return _Leaf(name, value.kind)
    return _Leaf(name, "constant", constant=value.value)  # specialized when exported: must be equal


_PYTHON_TYPES: dict[str, type | tuple[type, ...]] = {"int": int, "bool": bool, "float": (float, int)}


class MethodInputs:
    """Binds a call's arguments to a method's flat user inputs, checking each one."""

    def __init__(self, method: str, graph: ResidualGraph) -> None:
        self.method = method
        self.in_spec = graph.in_spec
        self.arg_names: list[str] = list(graph.arg_names)
        children = self.in_spec.children() if self.in_spec.type is tuple else []
        if len(children) != 2 or children[0].type is not tuple or children[1].type is not dict:
            raise FormatError(f"method {method!r}: its input structure {self.in_spec} is not (args, kwargs)")
        args_spec, kwargs_spec = children
        # Exported with plain positional leaves only: calls need no tree flattening.
        self._flat_positional = kwargs_spec.num_children == 0 and all(c.is_leaf() for c in args_spec.children())
        self.positional_count = args_spec.num_children
        self.keyword_names: list[str] = list(kwargs_spec.context or [])
        self.leaves = [_leaf(i.name, i.value, graph.ranges) for i in graph.inputs if i.kind == "user_input"]

    def parameters(self) -> list[str]:
        """Each user input as ``name: float32[1, 8]`` (``s0`` for a symbolic size), in call order;
        a tensor that must live elsewhere than the CPU says so: ``name: float32[1, 8] on cuda``."""
        described = []
        for leaf in self.leaves:
            if leaf.kind == "tensor":
                dtype = str(leaf.dtype).removeprefix("torch.")
                device = f" on {leaf.device.type}" if leaf.device is not None and leaf.device.type != "cpu" else ""
                described.append(f"{leaf.name}: {dtype}[{sizes_text(leaf.dims)}]{device}")
            elif leaf.kind == "constant":
                described.append(f"{leaf.name} = {leaf.constant!r}")
            else:
                described.append(f"{leaf.name}: {leaf.kind}")
        return described

    def describe(self) -> str:
        """The call signature, for messages: ``decode(input_ids, cache_position)``."""
        return f"{self.method}({', '.join(self.arg_names or [leaf.name for leaf in self.leaves])})"

    def flatten(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> list[Any]:
        """The flat user inputs of a call, checked."""
        if self._flat_positional and not kwargs and len(args) == self.positional_count:
            if all(type(a) is torch.Tensor for a in args):  # the common call: no tree to walk
                flat = list(args)
                self._check(flat)
                return flat
        if kwargs or len(args) != self.positional_count or self.keyword_names:
            args, kwargs = self._bind(args, kwargs)
        flat, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
        if spec != self.in_spec:
            raise self._structure_error(args, kwargs)
        self._check(flat)
        return flat

    def _structure_error(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> ProgramInputError:
        """Name the first argument whose nesting (tensor, list, dict...) differs from the export's."""
        args_spec, kwargs_spec = self.in_spec.children()
        names = self.arg_names or [f"#{i}" for i in range(len(args))]
        pairs = [(names[i], value, args_spec.child(i)) for i, value in enumerate(args)]
        pairs += [(key, kwargs[key], kwargs_spec.child(i)) for i, key in enumerate(self.keyword_names)]
        for name, value, expected in pairs:
            got = pytree.tree_structure(value)
            if got != expected:
                want = "a single value (a tensor or a number)" if expected.is_leaf() else f"nested as {expected}"
                return ProgramInputError(
                    f"method {self.method!r}: argument {name!r} must be {want}, got a {type(value).__name__} "
                    f"nested as {got}"
                )
        return ProgramInputError(f"method {self.method!r}: the inputs do not match {self.describe()}")

    def _bind(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return bound_arguments(
            self.method, self.arg_names, self.positional_count, self.keyword_names, args, kwargs, self.describe()
        )

    def _check(self, flat: Sequence[Any]) -> None:
        sizes: dict[str, tuple[int, str]] = {}
        for leaf, value in zip(self.leaves, flat, strict=True):
            if leaf.kind == "tensor":
                self._check_tensor(leaf, value, sizes)
            elif leaf.kind in ("int", "bool", "float"):
                expected = _PYTHON_TYPES[leaf.kind]
                if not isinstance(value, expected) or (leaf.kind == "int" and isinstance(value, bool)):
                    raise ProgramInputError(
                        f"method {self.method!r}: argument {leaf.name!r} must be a Python {leaf.kind}, "
                        f"got {type(value).__name__}"
                    )
            elif type(value) is not type(leaf.constant) or value != leaf.constant:
                raise ProgramInputError(
                    f"method {self.method!r}: argument {leaf.name!r} was the constant {leaf.constant!r} when "
                    f"exported, got {value!r}"
                )

    def _check_tensor(self, leaf: _Leaf, value: Any, sizes: dict[str, tuple[int, str]]) -> None:
        if (
            leaf.static_shape is not None
            and type(value) is torch.Tensor
            and value.dtype is leaf.dtype
            and value.shape == leaf.static_shape
            and (leaf.device is None or value.device.type == leaf.device.type)
        ):
            return  # the common case, checked at once; anything else is looked at size by size below
        where = f"method {self.method!r}: argument {leaf.name!r}"
        if not isinstance(value, torch.Tensor):
            raise ProgramInputError(f"{where} must be a tensor, got {type(value).__name__}")
        if value.dtype != leaf.dtype:
            raise ProgramInputError(f"{where} must have dtype {leaf.dtype}, got {value.dtype}")
        if leaf.device is not None and value.device.type != leaf.device.type:
            raise ProgramInputError(f"{where} must be on {leaf.device}, got {value.device}")
        check_sizes(where, leaf.name, value.shape, leaf.dims, sizes)
