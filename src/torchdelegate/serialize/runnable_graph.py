"""What a loaded program runs of a method: a torch.fx graph, its inputs and outputs, and its calling
convention (:class:`ResidualGraph`), whichever reader read it.

``residual_graph.py`` reads a saved graph's nodes straight into this form; a graph only torch's
deserializer reads (control flow, constant inputs, an older writer's document) is :func:`described`
the same way from the program torch rebuilt, so the runtime (``runtime/inputs.py``, ``runtime/method.py``)
has one kind of input. A tensor input's sizes are ints, a symbol's name, or None for a size derived
from symbols; a symbol's range is None where unbounded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.utils._pytree as pytree
from torch.fx import GraphModule

from torchdelegate.errors import FormatError

if TYPE_CHECKING:
    from torch.export import ExportedProgram


@dataclass(frozen=True)
class TensorValue:
    """What a tensor input is: its dtype, device and sizes (an int, a symbol's name, or None for a
    size derived from symbols)."""

    dtype: torch.dtype
    device: torch.device
    sizes: tuple[int | str | None, ...]


@dataclass(frozen=True)
class SymbolicValue:
    kind: str  # "int", "float" or "bool"


@dataclass(frozen=True)
class ConstantValue:
    value: Any  # the value an input was specialized to when exported


@dataclass(frozen=True)
class GraphInput:
    """One placeholder: a user input, or the state entry (``target``) it reads."""

    kind: str  # "user_input", "parameter", "buffer" or "tensor_constant"
    name: str
    target: str | None
    value: TensorValue | SymbolicValue | ConstantValue


@dataclass(frozen=True)
class GraphOutput:
    """One value the graph returns: a user output, or what it writes into a buffer or a user input."""

    kind: str  # "user_output", "buffer_mutation" or "user_input_mutation"
    target: str | None


@dataclass(frozen=True)
class ResidualGraph:
    """A method's graph as it runs. A delegate call node carries ``meta["output_count"]``."""

    graph_module: GraphModule
    inputs: list[GraphInput]
    outputs: list[GraphOutput]
    ranges: dict[str, tuple[int | None, int | None]]  # a symbol's bounds, None when unbounded
    in_spec: pytree.TreeSpec
    out_spec: pytree.TreeSpec
    arg_names: list[str]

    @property
    def buffers_to_mutate(self) -> list[str]:
        return [o.target for o in self.outputs if o.kind == "buffer_mutation" and o.target is not None]


def described(program: ExportedProgram, where: str) -> ResidualGraph:
    """A program torch's deserializer read, described as :func:`residual_graph` describes a document."""
    import sympy

    from torchdelegate.serialize.call_delegate import saved_call_nodes

    ranges = {
        str(symbol): (_finite(bounds.lower), _finite(bounds.upper))
        for symbol, bounds in program.range_constraints.items()
    }
    placeholders = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    inputs = [
        GraphInput(
            spec.kind.name.lower() if spec.kind.name != "CONSTANT_TENSOR" else "tensor_constant",
            spec.arg.name,
            spec.target,
            _value_of(placeholders[spec.arg.name].meta.get("val"), sympy),
        )
        for spec in program.graph_signature.input_specs
    ]
    outputs = [GraphOutput(spec.kind.name.lower(), spec.target) for spec in program.graph_signature.output_specs]
    for _, node in saved_call_nodes(program.graph_module):
        values = node.meta.get("val")
        node.meta["output_count"] = len(values) if isinstance(values, (list, tuple)) else None
    for entry in program.module_call_graph:
        signature = entry.signature
        if entry.fqn == "" and signature is not None and signature.in_spec is not None and signature.out_spec:
            return ResidualGraph(
                program.graph_module,
                inputs,
                outputs,
                ranges,
                signature.in_spec,
                signature.out_spec,
                list(signature.forward_arg_names or []),
            )
    raise FormatError(f"{where}: the graph has no calling convention (a root module call signature)")


def _finite(bound: Any) -> int | None:
    from torch.utils._sympy.numbers import int_oo

    return None if bound in (int_oo, -int_oo) or not getattr(bound, "is_finite", True) else int(bound)


def _value_of(value: Any, sympy: Any) -> TensorValue | SymbolicValue | ConstantValue:
    if isinstance(value, torch.Tensor):
        return TensorValue(value.dtype, value.device, tuple(_size(s, sympy) for s in value.shape))
    if isinstance(value, torch.SymBool):
        return SymbolicValue("bool")
    if isinstance(value, torch.SymInt):
        return SymbolicValue("int")
    if isinstance(value, torch.SymFloat):
        return SymbolicValue("float")
    return ConstantValue(value)


def _size(size: Any, sympy: Any) -> int | str | None:
    if isinstance(size, int):
        return size
    expr = size.node.expr
    if isinstance(expr, sympy.Integer):
        return int(expr)
    return str(expr) if isinstance(expr, sympy.Symbol) else None
