"""A sub-program as the compile cache's key covers it, read straight off its graph.

What a backend compiles from is what torch.export's serializer keeps (a unit compiled on a
worker is rebuilt from exactly that): each node's operation, target, arguments and output type,
its module path, source function and custom metadata; the signature; the shape constraints; the
calling convention; the state tensors' layouts. The form holds all of it, rendered as plain
JSON data, and leaves out what names one checkout or one process (stack traces, pass
provenance, ids). Anything it does not know how to render is rendered by type and value, so an
unknown value can only make a key miss, never make two different programs share one.

It is built in one pass over the nodes, without the serializer (whose canonicalizing copy
costs more than a warm lowering may spend).
"""

from __future__ import annotations

import enum
import re
import types
from collections.abc import Callable
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.export import ExportedProgram
from torch.fx import Graph, GraphModule, Node

from torchdelegate.delegate.named_data import content_key
from torchdelegate.exported.debug_handles import DEBUG_HANDLE, DEBUG_HANDLES
from torchdelegate.exported.programs import state_value

# Node metadata the serializer keeps ("val" is the node's output type).
_KEPT_METADATA = ("val", "nn_module_stack", "source_fn_stack", "torch_fn", "custom", DEBUG_HANDLE, DEBUG_HANDLES)
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


class Unkeyable(Exception):
    """The sub-program holds what the form does not cover (a delegate of an earlier stage)."""


def key_form(program: ExportedProgram) -> dict[str, Any]:
    """The sub-program as plain data, equal for two programs only if a backend sees them alike
    (state tensors by layout: their bytes are the digests' concern); ``Unkeyable`` if it holds
    modules other than subgraphs."""
    signature = program.graph_signature
    state = {
        spec.target: _tensor_layout(state_value(program, spec.target))
        for spec in signature.input_specs
        if spec.target is not None and spec.kind.name != "CUSTOM_OBJ"
    }
    return {
        "graph": _graph(program.graph_module, program.graph),
        "inputs": [[s.kind.name, _argument(s.arg), s.target, s.persistent] for s in signature.input_specs],
        "outputs": [[s.kind.name, _argument(s.arg), s.target] for s in signature.output_specs],
        "state": state,
        "ranges": sorted([str(symbol), str(r.lower), str(r.upper)] for symbol, r in program.range_constraints.items()),
        "calls": [[e.fqn, None if e.signature is None else _rendered(e.signature)] for e in program.module_call_graph],
        "call_spec": [str(program.call_spec.in_spec), str(program.call_spec.out_spec)],
        "dialect": program.dialect,
    }


def _graph(owner: torch.nn.Module, graph: Graph) -> list[Any]:
    nodes = []
    for node in graph.nodes:
        target: Any = node.target
        if node.op == "get_attr":
            target = _attribute(owner, str(node.target))
        metadata = [[key, _metadata(key, node.meta[key])] for key in _KEPT_METADATA if key in node.meta]
        nodes.append([node.op, node.name, _target(target), _rendered(node.args), _rendered(node.kwargs), metadata])
    return nodes


def _attribute(owner: torch.nn.Module, path: str) -> Any:
    """A ``get_attr``'s target: a subgraph's own form (control flow's branches); a tensor with its values."""
    value: Any = owner
    for part in path.split("."):
        value = getattr(value, part)
    if isinstance(value, GraphModule):
        return [path, _graph(value, value.graph)]
    if isinstance(value, torch.Tensor):
        return [path, _tensor(value)]  # not state: its digest is not among the unit's
    raise Unkeyable(f"{path!r} is a {type(value).__name__}, not a subgraph")


def _target(target: Any) -> Any:
    if isinstance(target, str | list):
        return target
    return _callable_name(target)


def _callable_name(value: Any) -> str:
    if isinstance(value, torch._ops.OpOverload | torch._ops.OpOverloadPacket | torch._ops.HigherOrderOperator):
        return f"op:{value}"
    module = getattr(value, "__module__", None) or ""
    name = getattr(value, "__qualname__", None) or getattr(value, "__name__", None) or type(value).__qualname__
    return f"{module}.{name}"


def _tensor_layout(tensor: Any) -> list[Any]:
    if not isinstance(tensor, torch.Tensor):
        return ["not a tensor", type(tensor).__qualname__]
    strides = [str(s) for s in tensor.stride()] if tensor.layout == torch.strided else str(tensor.layout)
    return [str(tensor.dtype), [str(d) for d in tensor.shape], strides, tensor.device.type]


def _argument(argument: Any) -> Any:
    name = getattr(argument, "name", None)
    return [type(argument).__name__, name if name is not None else _rendered(getattr(argument, "value", None))]


def _rendered(value: Any) -> Any:
    """``value`` as JSON data that tells every value of a different meaning apart."""
    if value is None or isinstance(value, bool | int | str):
        return value
    render = _RENDERERS.get(type(value))
    if render is not None:
        return render(value)
    for kind, render in _RENDERERS_BY_KIND:
        if isinstance(value, kind):
            return render(value)
    return ["object", f"{type(value).__module__}.{type(value).__qualname__}", _ADDRESS.sub("", repr(value))]


def _metadata(key: str, value: Any) -> Any:
    if key == "nn_module_stack" and isinstance(value, dict):
        # Keys are per-call identifiers (non-strict export makes them from id()); the paths and types count.
        return ["module stack", [_rendered(entry) for entry in value.values()]]
    return _rendered(value)


def _tensor(tensor: torch.Tensor) -> list[Any]:
    rendered = ["tensor", *_tensor_layout(tensor), tensor.requires_grad]
    if not isinstance(tensor, FakeTensor) and tensor.device.type != "meta":
        rendered.append(content_key(tensor))  # a real tensor held in the graph: its values count
    return rendered


_RENDERERS: dict[type, Callable[[Any], Any]] = {
    float: lambda v: ["float", repr(v)],
    list: lambda v: ["list", [_rendered(item) for item in v]],
    tuple: lambda v: ["tuple", [_rendered(item) for item in v]],
    Node: lambda v: ["node", v.name],
    torch.dtype: lambda v: ["dtype", str(v)],
    torch.device: lambda v: ["device", str(v)],
    torch.layout: lambda v: ["layout", str(v)],
    torch.memory_format: lambda v: ["memory format", str(v)],
    slice: lambda v: ["slice", _rendered(v.start), _rendered(v.stop), _rendered(v.step)],
    type(Ellipsis): lambda v: ["ellipsis"],
    type: lambda v: ["type", f"{v.__module__}.{v.__qualname__}"],
    torch.Size: lambda v: ["size", [str(d) for d in v]],
}
_RENDERERS_BY_KIND: list[tuple[Any, Callable[[Any], Any]]] = [
    (torch.Tensor, _tensor),
    (torch.SymInt | torch.SymFloat | torch.SymBool, lambda v: ["symbol", type(v).__name__, str(v)]),
    (dict, lambda v: ["dict", [[_rendered(k), _rendered(x)] for k, x in v.items()]]),
    (enum.Enum, lambda v: ["enum", f"{type(v).__qualname__}.{v.name}"]),
    (
        torch._ops.OpOverload | torch._ops.OpOverloadPacket | torch._ops.HigherOrderOperator,
        lambda v: ["callable", _callable_name(v)],
    ),
    (types.FunctionType | types.BuiltinFunctionType | types.MethodType, lambda v: ["callable", _callable_name(v)]),
]
