"""A saved graph read into what a loaded program runs (``runnable_graph.ResidualGraph``: a torch.fx
graph, its inputs and outputs, and the calling convention), without rebuilding an ExportedProgram.

torch.export's deserializer makes fake tensors and a shape environment for every value, and
importing it imports ``torch._dynamo``: most of a process's start when all it does is run a
file. The graphs lowering leaves are registered operators, size arithmetic and delegate calls;
:func:`residual_graph` builds those straight from the document, node by node. Any other graph (control
flow, constant inputs, a document written by an older torch) is read by torch's deserializer
(``graph.deserialized``) and described the same way (``runnable_graph.described``), so the runtime has
one kind of input. Both paths first check the document with ``graph_document.checked_document``.
"""

from __future__ import annotations

import keyword
import math
import operator
import re
from collections.abc import Mapping
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch._ops import OpOverload
from torch.fx import Graph, GraphModule, Node

from torchdelegate.errors import FormatError
from torchdelegate.serialize import call_delegate as _call_delegate  # noqa: F401 - registers the operator graphs call
from torchdelegate.serialize.call_plan import STATE_FIELDS
from torchdelegate.serialize.graph_document import checked_document
from torchdelegate.serialize.runnable_graph import (
    GraphInput,
    GraphOutput,
    ResidualGraph,
    SymbolicValue,
    TensorValue,
    described,
)

# torch.export's serialized enums (its schema's ScalarType, Layout and MemoryFormat), by value.
_DTYPES: dict[int, torch.dtype] = {
    1: torch.uint8, 2: torch.int8, 3: torch.int16, 4: torch.int32, 5: torch.int64, 6: torch.float16,
    7: torch.float32, 8: torch.float64, 9: torch.complex32, 10: torch.complex64, 11: torch.complex128,
    12: torch.bool, 13: torch.bfloat16, 28: torch.uint16, 29: torch.float8_e4m3fn, 30: torch.float8_e5m2,
    31: torch.float8_e4m3fnuz, 32: torch.float8_e5m2fnuz, 33: torch.float8_e8m0fnu, 34: torch.uint32,
    35: torch.uint64,
}  # fmt: skip
_LAYOUTS: dict[int, torch.layout] = {
    1: torch.sparse_coo, 2: torch.sparse_csr, 3: torch.sparse_csc, 4: torch.sparse_bsr, 5: torch.sparse_bsc,
    6: torch._mkldnn, 7: torch.strided,  # type: ignore[attr-defined]
}  # fmt: skip
_MEMORY_FORMATS: dict[int, torch.memory_format] = {
    1: torch.contiguous_format, 2: torch.channels_last, 3: torch.channels_last_3d, 4: torch.preserve_format,
}  # fmt: skip
_BUILTIN_MODULES: dict[str, Any] = {"_operator": operator, "torch": torch, "math": math}
_SYMBOL = re.compile(r"(?:Symbol\(')?([a-z]+\d+)(?:'(?:,[^)]*)?\))?")
_OUTPUT_FIELDS = {"user_output": None, "buffer_mutation": "buffer_name", "user_input_mutation": "user_input_name"}


class _Unsupported(Exception):
    """The document holds something only torch's deserializer reads."""


def residual_graph(
    document: Any, tensors: Mapping[str, torch.Tensor], where: str, plain_types: dict[str, str] | None = None
) -> ResidualGraph:
    """The graph a :func:`~torchdelegate.serialize.graph.program_to_json` document describes, ready to run
    over ``tensors`` (read by name); a ``FormatError`` naming ``where`` if the document is unsound."""
    checked = checked_document(document, tensors, where, plain_types)
    try:
        return _read(checked)
    except _Unsupported:
        pass
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, RuntimeError) as e:
        raise FormatError(f"{where}: the graph cannot be read ({type(e).__name__}: {e})") from e
    from torchdelegate.serialize.graph import deserialized

    return described(deserialized(checked, tensors, where), where)


def _read(document: dict[str, Any]) -> ResidualGraph:
    module = document["graph_module"]
    serialized = module["graph"]
    if serialized.get("custom_obj_values") or serialized.get("sym_float_values"):
        raise _Unsupported
    values = serialized["tensor_values"]
    graph = Graph()
    env: dict[str, Node] = {}
    inputs = _inputs(module["signature"]["input_specs"], serialized["inputs"], values, graph, env)
    for node in serialized["nodes"]:
        _node(node, graph, env)
    returned = tuple(_argument(a, env) for a in serialized["outputs"])
    graph.output(returned[0] if serialized.get("is_single_tensor_return") else returned)
    in_spec, out_spec, arg_names = _call_signature(module["module_call_graph"])
    ranges = {
        symbol: (_int_or_none(bounds.get("min_val")), _int_or_none(bounds.get("max_val")))
        for symbol, bounds in document.get("range_constraints", {}).items()
    }
    return ResidualGraph(
        GraphModule(torch.nn.Module(), graph),
        inputs,
        [_output_spec(spec) for spec in module["signature"]["output_specs"]],
        ranges,
        in_spec,
        out_spec,
        arg_names,
    )


def _inputs(
    specs: list[dict[str, Any]],
    arguments: list[dict[str, Any]],
    values: dict[str, Any],
    graph: Graph,
    env: dict[str, Node],
) -> list[GraphInput]:
    if len(specs) != len(arguments):
        raise ValueError(f"{len(arguments)} graph inputs, {len(specs)} input specs")
    inputs = []
    for spec, argument in zip(specs, arguments, strict=True):
        ((kind, entry),) = spec.items()
        if "as_tensor" in argument:
            name = argument["as_tensor"]["name"]
            value: TensorValue | SymbolicValue = _tensor_value(values[name])
        elif kind == "user_input" and "as_name" in argument.get("as_sym_int", {}):
            name, value = argument["as_sym_int"]["as_name"], SymbolicValue("int")
        elif kind == "user_input" and "as_name" in argument.get("as_sym_bool", {}):
            name, value = argument["as_sym_bool"]["as_name"], SymbolicValue("bool")
        else:
            raise _Unsupported
        if kind != "user_input" and kind not in STATE_FIELDS:
            raise _Unsupported
        placeholder = graph.placeholder(name)
        placeholder.name = name  # exactly the saved name, as torch's reader keeps it
        env[name] = placeholder
        target = entry[STATE_FIELDS[kind]] if kind in STATE_FIELDS else None
        inputs.append(GraphInput(kind, name, target, value))
    return inputs


def _tensor_value(meta: dict[str, Any]) -> TensorValue:
    sizes: list[int | str | None] = []
    for size in meta["sizes"]:
        if "as_int" in size:
            sizes.append(int(size["as_int"]))
            continue
        expression = size["as_expr"]["expr_str"]
        match = _SYMBOL.fullmatch(expression.strip())
        sizes.append(match.group(1) if match else int(expression) if expression.strip().isdigit() else None)
    device = meta["device"]
    return TensorValue(_DTYPES[meta["dtype"]], torch.device(device["type"], device.get("index")), tuple(sizes))


def _output_spec(spec: dict[str, Any]) -> GraphOutput:
    ((kind, entry),) = spec.items()
    if kind not in _OUTPUT_FIELDS:
        raise _Unsupported  # torch's reader names it; the runtime refuses it with that name
    field = _OUTPUT_FIELDS[kind]
    return GraphOutput(kind, entry[field] if field is not None else None)


def _call_signature(entries: list[dict[str, Any]]) -> tuple[pytree.TreeSpec, pytree.TreeSpec, list[str]]:
    for entry in entries:
        signature = entry.get("signature")
        if entry.get("fqn") == "" and signature and signature.get("in_spec") and signature.get("out_spec"):
            in_spec = pytree.treespec_loads(signature["in_spec"])
            return in_spec, pytree.treespec_loads(signature["out_spec"]), list(signature.get("forward_arg_names") or [])
    raise _Unsupported  # torch's reader, then the runtime, say what is missing


def _node(serialized: dict[str, Any], graph: Graph, env: dict[str, Node]) -> None:
    target_name: str = serialized["target"]
    outputs = serialized["outputs"]
    if target_name.startswith("torch.ops."):
        target = _operator(target_name)
        args, kwargs = _operator_arguments(serialized["inputs"], env)
    else:
        module, _, name = target_name.rpartition(".")
        target = getattr(_BUILTIN_MODULES[module], name)
        args, kwargs = tuple(_argument(i["arg"], env) for i in serialized["inputs"]), {}
    single = _single_output_name(outputs)
    node = graph.create_node("call_function", target, args, kwargs, serialized.get("name") or single)
    if single is not None:
        env[single] = node
    elif len(outputs) == 1 and "as_none" in outputs[0]:
        return
    elif outputs:
        listed = outputs[0]["as_tensors"] if len(outputs) == 1 and "as_tensors" in outputs[0] else outputs
        _getitems(node, listed, graph, env)
        node.meta["output_count"] = len(listed)


def _operator(target: str) -> OpOverload:
    if target.startswith("torch.ops.higher_order."):
        raise _Unsupported  # control flow: its branches are graphs of their own
    namespace, name, overload = target.removeprefix("torch.ops.").split(".")
    op = getattr(getattr(getattr(torch.ops, namespace), name), overload)
    if not isinstance(op, OpOverload):
        raise _Unsupported
    return op


def _operator_arguments(inputs: list[dict[str, Any]], env: dict[str, Node]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    for named in inputs:
        kind, name = named.get("kind"), named["name"]
        if kind == 1 and not kwargs:
            args.append(_argument(named["arg"], env))
        elif kind == 2 and not keyword.iskeyword(name):
            kwargs[name] = _argument(named["arg"], env)
        else:
            raise _Unsupported  # no argument kinds (an older writer): torch's reader consults the schema
    return tuple(args), kwargs


def _single_output_name(outputs: list[dict[str, Any]]) -> str | None:
    if len(outputs) != 1:
        return None
    ((kind, value),) = outputs[0].items()
    if kind == "as_tensor":
        return str(value["name"])
    if kind in ("as_sym_int", "as_sym_bool", "as_sym_float") and "as_name" in value:
        return str(value["as_name"])
    return None


def _getitems(node: Node, outputs: list[dict[str, Any]], graph: Graph, env: dict[str, Node]) -> None:
    for index, output in enumerate(outputs):
        if "name" in output:  # an entry of a list output
            name = output["name"]
        elif (single := _single_output_name([output])) is not None:
            name = single
        elif "as_none" in output:
            continue
        else:
            raise _Unsupported  # nested lists
        env[name] = graph.create_node("call_function", operator.getitem, (node, index), name=name)


def _argument(argument: dict[str, Any], env: dict[str, Node]) -> Any:
    ((kind, value),) = argument.items()
    if kind == "as_none":
        return None
    if kind == "as_tensor":
        return env[value["name"]]
    if kind == "as_tensors":
        return [env[t["name"]] for t in value]
    if kind in ("as_int", "as_string", "as_bool", "as_ints", "as_strings", "as_bools", "as_int_lists"):
        return [list(v) if isinstance(v, list) else v for v in value] if isinstance(value, list) else value
    if kind == "as_float":
        return float(value)  # infinities and NaN are written as strings
    if kind == "as_floats":
        return [float(v) for v in value]
    if kind == "as_float_lists":
        return [[float(v) for v in row] for row in value]
    if kind in ("as_sym_int", "as_sym_bool", "as_sym_float"):
        return _symbolic(value, env)
    if kind in ("as_sym_ints", "as_sym_bools", "as_sym_floats"):
        return [_symbolic(v, env) for v in value]
    if kind == "as_optional_tensor":
        return None if "as_none" in value else env[value["as_tensor"]["name"]]
    if kind == "as_optional_tensors":
        return [None if "as_none" in v else env[v["as_tensor"]["name"]] for v in value]
    if kind == "as_scalar_type":
        return _DTYPES[value]
    if kind == "as_layout":
        return _LAYOUTS[value]
    if kind == "as_memory_format":
        return _MEMORY_FORMATS[value]
    if kind == "as_device":
        return torch.device(value["type"], value.get("index"))
    raise _Unsupported  # graphs, operators, custom objects, complex numbers


def _symbolic(value: dict[str, Any], env: dict[str, Node]) -> Any:
    ((kind, inner),) = value.items()
    if kind == "as_name":
        return env[inner]
    return float(inner) if kind == "as_float" else inner


def _int_or_none(value: Any) -> int | None:
    return None if value is None else int(value)
