"""A method's graph as a plan of delegate calls, read without torch.

Most lowered programs leave nothing outside their delegates: the residual graph reads the sizes of its
inputs, calls delegates and returns what they give. Such a graph is a :class:`CallPlan`, which a
process runs on numpy arrays without importing torch (``runtime/array_method.py``). Anything else
the graph computes, or an input or output structure other than flat tuples, lists and dicts, makes
the method need torch: :func:`call_plan` then names what does.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torchdelegate.serialize.arrays import SCALAR_TYPES
from torchdelegate.serialize.bounded_json import bounded_json
from torchdelegate.serialize.tree_specs import MAX_SPEC_CHARACTERS

TENSOR, SIZE = "T", "S"  # a delegate input's kind, in a delegate record's input_kinds
CALL_DELEGATE = "torch.ops.torchdelegate.call_delegate.default"
SYM_SIZE = "torch.ops.aten.sym_size.int"
# A state input's kind in torch.export's serialized signature, and the field naming its entry.
STATE_FIELDS = {"parameter": "parameter_name", "buffer": "buffer_name", "tensor_constant": "tensor_constant_name"}
_SYMBOL = re.compile(r"Symbol\('([a-z]+\d+)'(?:,[^)]*)?\)|([a-z]+\d+)")
_CONTAINERS = {"builtins.tuple": "tuple", "builtins.list": "list", "builtins.dict": "dict"}


@dataclass(frozen=True)
class PlanInput:
    """One graph input: a user's (tensor or symbolic number) or state read by name (``target``)."""

    kind: str  # "user_input", "parameter", "buffer" or "tensor_constant"
    name: str
    target: str | None
    dtype: str | None  # a tensor's stored dtype name; None for a symbolic number
    sizes: tuple[int | str | None, ...] = ()  # fixed, a symbol, or None (derived from symbols)
    scalar: str | None = None  # "int" or "bool" for a symbolic number


@dataclass(frozen=True)
class SizeRead:
    """``name = source.shape[dim]``."""

    name: str
    source: str
    dim: int


@dataclass(frozen=True)
class DelegateCall:
    """A delegate's call: its arguments (value names, or ints) in its input order, and its results' names."""

    delegate: int
    arguments: tuple[str | int, ...]
    results: tuple[str, ...]


@dataclass(frozen=True)
class PlanOutput:
    kind: str  # "user_output" or "buffer_mutation"
    value: str
    target: str | None


@dataclass(frozen=True)
class CallPlan:
    """What a method does, in order, and its calling convention."""

    inputs: tuple[PlanInput, ...]
    steps: tuple[SizeRead | DelegateCall, ...]
    outputs: tuple[PlanOutput, ...]
    ranges: Mapping[str, tuple[int | None, int | None]]
    arg_names: tuple[str, ...]
    positional_count: int
    keyword_names: tuple[str, ...]
    output_container: str | None  # None: one value; "tuple", "list" or "dict"
    output_keys: tuple[Any, ...] = ()  # a dict's keys
    output_count: int = 1  # the values the structure holds


class NeedsTorch(Exception):
    """The method cannot run without torch; the message says what needs it."""


def call_plan(document: Any, delegate_kinds: Mapping[int, str], where: str) -> CallPlan:
    """The plan of a method's saved graph document; ``NeedsTorch`` naming what the graph does beyond
    calling delegates. ``delegate_kinds``: each delegate's input kinds (``TENSOR``/``SIZE`` letters).
    A malformed document is ``NeedsTorch`` too: the torch path's reader names what is wrong with it."""
    try:
        return _plan(document, delegate_kinds)
    except NeedsTorch as e:
        raise NeedsTorch(f"{where}: {e}") from None
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
        raise NeedsTorch(f"{where}: its graph is not one this reader knows ({type(e).__name__}: {e})") from None


def _plan(document: Any, delegate_kinds: Mapping[int, str]) -> CallPlan:
    module = document["graph_module"]
    graph = module["graph"]
    if graph.get("custom_obj_values") or graph.get("sym_float_values") or graph.get("sym_bool_values"):
        raise NeedsTorch("its graph holds custom objects or symbolic floats")
    values = graph["tensor_values"]
    inputs = tuple(
        _input(spec, arg, values) for spec, arg in zip(module["signature"]["input_specs"], graph["inputs"], strict=True)
    )
    others = [n for n in graph["nodes"] if n["target"] not in (CALL_DELEGATE, SYM_SIZE)]
    if others:
        named = ", ".join(f"{n['name']} ({n['target'].removeprefix('torch.ops.')})" for n in others[:5])
        more = f" and {len(others) - 5} more" if len(others) > 5 else ""
        raise NeedsTorch(f"its graph computes outside its delegates: {named}{more}")
    steps = tuple(_step(node, delegate_kinds) for node in graph["nodes"])
    outputs = tuple(
        _output(spec, arg) for spec, arg in zip(module["signature"]["output_specs"], graph["outputs"], strict=True)
    )
    arg_names, positional, keywords, container, keys, count = _signature(module["module_call_graph"])
    ranges = {
        symbol: (_int(bounds.get("min_val")), _int(bounds.get("max_val")))
        for symbol, bounds in sorted(document.get("range_constraints", {}).items())
    }
    return CallPlan(inputs, steps, outputs, ranges, arg_names, positional, keywords, container, keys, count)


def _int(value: Any) -> int | None:
    return value if type(value) is int else None


def _input(spec: dict[str, Any], argument: dict[str, Any], values: dict[str, Any]) -> PlanInput:
    ((kind, entry),) = spec.items()
    if kind not in ("user_input", *STATE_FIELDS):
        raise NeedsTorch(f"it has an input of kind {kind!r}")
    target = entry[STATE_FIELDS[kind]] if kind in STATE_FIELDS else None
    if "as_tensor" in argument:
        name = argument["as_tensor"]["name"]
    elif kind in STATE_FIELDS and "name" in argument:
        name = argument["name"]
    elif kind == "user_input" and "as_name" in argument.get("as_sym_int", {}):
        return PlanInput(kind, argument["as_sym_int"]["as_name"], None, None, scalar="int")
    else:
        raise NeedsTorch(f"its input {argument!r:.80} is neither a tensor nor a symbolic int")
    meta = values.get(name) if kind in STATE_FIELDS else values[name]
    if meta is None:  # state the graph records no metadata for: its own record says its dtype and shape
        return PlanInput(kind, name, target, None)
    dtype = SCALAR_TYPES.get(meta["dtype"])
    if dtype is None or meta.get("layout", 7) != 7 or meta["device"]["type"] != "cpu":
        raise NeedsTorch(f"its input {name!r} is not a dense CPU tensor of a dtype arrays hold")
    return PlanInput(kind, name, target, dtype, tuple(_size(size) for size in meta["sizes"]))


def _size(size: dict[str, Any]) -> int | str | None:
    if "as_int" in size:
        return int(size["as_int"])
    expression = str(size["as_expr"]["expr_str"]).strip()
    match = _SYMBOL.fullmatch(expression)
    if match:
        return match.group(1) or match.group(2)
    return int(expression) if expression.isdigit() else None


def _step(node: dict[str, Any], delegate_kinds: Mapping[int, str]) -> SizeRead | DelegateCall:
    arguments = {entry["name"]: entry["arg"] for entry in node["inputs"]}
    (output,) = node["outputs"]
    if node["target"] == SYM_SIZE:
        return SizeRead(
            output["as_sym_int"]["as_name"], arguments["self"]["as_tensor"]["name"], int(arguments["dim"]["as_int"])
        )
    index = int(arguments["index"]["as_int"])
    kinds = delegate_kinds.get(index)
    if kinds is None:
        raise NeedsTorch(f"it calls delegate {index}, which the method does not list")
    tensors = iter(t["name"] for t in arguments["tensors"]["as_tensors"])
    sizes_argument = arguments["sizes"]
    sized = sizes_argument.get("as_sym_ints", sizes_argument.get("as_ints", []))
    sizes = iter(s if type(s) is int else s["as_name"] if "as_name" in s else int(s["as_int"]) for s in sized)
    try:
        ordered = tuple(next(sizes) if kind == SIZE else next(tensors) for kind in kinds)
    except StopIteration:
        raise ValueError(f"the call of delegate {index} passes fewer inputs than its table entry says") from None
    if next(tensors, None) is not None or next(sizes, None) is not None:
        raise ValueError(f"the call of delegate {index} passes more inputs than its table entry says")
    results = tuple(t["name"] for t in output["as_tensors"])
    return DelegateCall(index, ordered, results)


def _output(spec: dict[str, Any], argument: dict[str, Any]) -> PlanOutput:
    ((kind, entry),) = spec.items()
    if kind == "buffer_mutation":
        return PlanOutput(kind, entry["arg"]["name"], entry["buffer_name"])
    if kind != "user_output":
        raise NeedsTorch(f"it has an output of kind {kind!r}")
    if "as_tensor" in argument:
        return PlanOutput(kind, argument["as_tensor"]["name"], None)
    if "as_name" in argument.get("as_sym_int", {}):
        return PlanOutput(kind, argument["as_sym_int"]["as_name"], None)
    raise NeedsTorch(f"it returns {argument!r:.80}, neither a tensor nor a symbolic int")


def _signature(
    entries: list[dict[str, Any]],
) -> tuple[tuple[str, ...], int, tuple[str, ...], str | None, tuple[Any, ...], int]:
    """The forward's argument names, how many are positional, the keyword names; the outputs' container,
    its keys and how many values it holds."""
    for entry in entries:
        signature = entry.get("signature")
        if entry.get("fqn") == "" and signature and signature.get("in_spec") and signature.get("out_spec"):
            inputs, outputs = _spec_root(signature["in_spec"]), _spec_root(signature["out_spec"])
            break
    else:
        raise NeedsTorch("it records no calling convention")
    if inputs.get("type") != "builtins.tuple" or len(inputs["children_spec"]) != 2:
        raise NeedsTorch("its inputs are not (args, kwargs)")
    args, kwargs = inputs["children_spec"]
    if args.get("type") != "builtins.tuple" or kwargs.get("type") != "builtins.dict":
        raise NeedsTorch("its inputs are not (args, kwargs)")
    if any(child.get("type") is not None for child in (*args["children_spec"], *kwargs["children_spec"])):
        raise NeedsTorch("it takes nested inputs (lists, dicts or other containers of tensors)")
    keywords = tuple(
        bounded_json(kwargs["context"], MAX_SPEC_CHARACTERS) if kwargs.get("context") not in (None, "null") else ()
    )
    names = tuple(signature.get("forward_arg_names") or ())
    container, keys = _output_container(outputs)
    count = 1 if container is None else len(outputs["children_spec"])
    return names, len(args["children_spec"]), keywords, container, keys, count


def _output_container(root: dict[str, Any]) -> tuple[str | None, tuple[Any, ...]]:
    kind = root.get("type")
    if kind is None:
        return None, ()
    container = _CONTAINERS.get(kind)
    if container is None or any(child.get("type") is not None for child in root["children_spec"]):
        raise NeedsTorch(f"it returns its outputs in a {kind} (only one value, or a flat tuple, list or dict)")
    if container != "dict":
        return container, ()
    keys = tuple(bounded_json(root["context"], MAX_SPEC_CHARACTERS))
    if len(keys) != len(root["children_spec"]):
        raise ValueError("its output dict's keys do not match its values")
    return container, keys


def _spec_root(spec: str) -> dict[str, Any]:
    """The root node of a saved tree spec (``[protocol, root]``)."""
    document = bounded_json(spec, MAX_SPEC_CHARACTERS)
    if not isinstance(document, list) or len(document) != 2 or document[0] != 1 or not isinstance(document[1], dict):
        raise ValueError("a tree spec is not [1, root]")
    return document[1]
