"""Residual graphs to and from torch.export's own JSON serializer.

In memory a delegate is a ``get_attr`` of a :class:`LoweredBackendModule` and a
``call_delegate`` node. In a file it is one call of the operator
``torchdelegate::delegate_call(int index, Tensor[] tensors, SymInt[] sizes) -> Tensor[]``,
whose ``index`` points into the file's delegate table; the table says in which order the
tensors and sizes reach the backend. Any torch can then read the graph with its own
deserializer, and nothing in it is executable: before deserializing, every operator a
node names and every symbolic expression is checked against what a graph may contain.
"""

from __future__ import annotations

import json
import operator
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch._export.serde import schema
from torch._export.serde.serialize import (
    EnumEncoder,
    ExportedProgramDeserializer,
    ExportedProgramSerializer,
    _dataclass_to_dict,
    _dict_to_dataclass,
)
from torch._ops import HigherOrderOperator, OpOverload
from torch.export import ExportedProgram
from torch.fx import GraphModule, Node

from torchdelegate.errors import FormatError, OperatorNotFoundError, SerializationError
from torchdelegate.lowered_module import LoweredBackendModule, call_delegate
from torchdelegate.lowering.structural_copy import copy_node, fetch_attr, graph_like, keep_name, program_around
from torchdelegate.serialize.tree_specs import with_plain_containers
from torchdelegate.torch_warnings import torch_internal_warnings_silenced

_library = torch.library.Library("torchdelegate", "DEF")
_library.define("delegate_call(int index, Tensor[] tensors, SymInt[] sizes) -> Tensor[]")


def _not_callable(index: int, tensors: list[torch.Tensor], sizes: list[int]) -> list[torch.Tensor]:
    raise RuntimeError(
        f"torchdelegate::delegate_call({index}) is a placeholder in saved graphs; load the file with "
        "torchdelegate.load() to run its delegates"
    )


_library.impl("delegate_call", _not_callable, "CompositeExplicitAutograd")
delegate_call: OpOverload = torch.ops.torchdelegate.delegate_call.default
torch.fx.node.has_side_effect(delegate_call)

TENSOR, SIZE = "T", "S"


@dataclass(frozen=True)
class DelegateCall:
    """One delegate as a saved graph calls it: its module and the kinds of its inputs, in order."""

    module: LoweredBackendModule
    input_kinds: str
    output_count: int


def serializable_program(
    program: ExportedProgram, delegate_index: Callable[[LoweredBackendModule], int]
) -> tuple[ExportedProgram, list[DelegateCall]]:
    """``program`` with its delegates as ``delegate_call(index, ...)`` nodes (program unchanged).

    ``delegate_index`` gives each delegate its index in the file; the calls are returned in
    the order met (sub-graphs of control flow at their parent's node).
    """
    calls: list[DelegateCall] = []
    graph, attrs = _rewrite_graph(program.graph_module, delegate_index, calls)
    rewritten = program_around(program, graph, attrs)
    return rewritten, calls


def _rewrite_graph(
    gm: GraphModule, delegate_index: Callable[[LoweredBackendModule], int], calls: list[DelegateCall]
) -> tuple[torch.fx.Graph, dict[str, Any]]:
    graph = graph_like(gm)
    env: dict[Node, Node] = {}
    attrs: dict[str, Any] = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value = fetch_attr(gm, node.target)
            if isinstance(value, LoweredBackendModule):
                continue
            if isinstance(value, GraphModule):
                sub_graph, sub_attrs = _rewrite_graph(value, delegate_index, calls)
                value = GraphModule(sub_attrs, sub_graph, class_name=type(value).__name__)
            attrs[node.target] = value
        if node.op == "call_function" and node.target is call_delegate:
            env[node] = _delegate_call_node(
                graph, node, fetch_attr(gm, node.args[0].target), env, delegate_index, calls
            )
            continue
        copy_node(graph, node, env, keep_tag=True)
    return graph, attrs


def _delegate_call_node(
    graph: torch.fx.Graph,
    node: Node,
    module: LoweredBackendModule,
    env: Mapping[Node, Node],
    delegate_index: Callable[[LoweredBackendModule], int],
    calls: list[DelegateCall],
) -> Node:
    tensors: list[Node] = []
    sizes: list[Node] = []
    kinds = []
    for argument in node.args[1:]:
        value = argument.meta.get("val") if isinstance(argument, Node) else argument
        if isinstance(argument, Node) and isinstance(value, torch.Tensor):
            tensors.append(env[argument])
            kinds.append(TENSOR)
        elif isinstance(argument, Node) and isinstance(value, (int, torch.SymInt)) and not isinstance(value, bool):
            sizes.append(env[argument])
            kinds.append(SIZE)
        else:
            raise SerializationError(
                f"delegate {module.name!r} on {module.backend_id!r} takes {argument!r} "
                f"({type(value).__name__}); a saved delegate can take only tensors and integer sizes"
            )
    outputs = node.meta.get("val") or ()
    if any(not isinstance(v, torch.Tensor) for v in outputs):
        raise SerializationError(
            f"delegate {module.name!r} on {module.backend_id!r} returns a non-tensor value; "
            "a saved delegate can return only tensors"
        )
    call = graph.call_function(delegate_call, (delegate_index(module), tensors, sizes))
    keep_name(graph, call, node.name)
    call.meta = {k: v for k, v in node.meta.items() if k != "delegate"}
    call.meta["val"] = list(outputs)
    calls.append(DelegateCall(module, "".join(kinds), len(outputs)))
    return call


# Node metadata that only helps a person debugging: stack traces and module paths are most of
# a graph's JSON (a few hundred bytes per node), so files carry them only when asked.
_DEBUG_METADATA = ("stack_trace", "nn_module_stack", "source_fn_stack", "torch_fn")


def program_to_json(program: ExportedProgram, where: str, *, debug_info: bool = False) -> dict[str, Any]:
    """torch.export's serialized form of ``program`` (graph, signature, specs), without tensors.

    ``debug_info`` keeps each node's stack trace and module path.
    """
    for spec in program.graph_signature.input_specs:
        if spec.kind.name in ("CUSTOM_OBJ", "TOKEN"):
            raise SerializationError(
                f"{where}: input {spec.arg.name!r} is a {spec.kind.name.lower()}; "
                "torchdelegate files hold tensor state only"
            )
    try:
        with torch_internal_warnings_silenced():
            serialized = ExportedProgramSerializer().serialize(
                program, serialize_state_dict=False, serialize_constants=False, serialize_example_inputs=False
            )
    except Exception as e:
        raise SerializationError(f"{where}: torch.export's serializer failed: {e}") from e
    # Enums to their values, exactly as torch writes its own JSON.
    document = json.loads(json.dumps(_dataclass_to_dict(serialized.exported_program), cls=EnumEncoder, allow_nan=False))
    for key, value in _walk(document):
        if key == "metadata" and isinstance(value, dict):
            # Provenance of passes, keyed by id() of in-memory graphs: neither stable nor useful in a file.
            value.pop("from_node", None)
            for name in () if debug_info else _DEBUG_METADATA:
                value.pop(name, None)
    return document


def state_names(document: Any) -> dict[str, str]:
    """Each parameter, buffer and constant a serialized program reads, with its kind: "parameter",
    "buffer" (persistent) or "constant" (tensor constants and non-persistent buffers)."""
    module = document.get("graph_module") if isinstance(document, dict) else None
    signature = module.get("signature") if isinstance(module, dict) else None
    specs = signature.get("input_specs") if isinstance(signature, dict) else None
    names: dict[str, str] = {}
    for spec in specs if isinstance(specs, list) else []:
        for kind, field in (
            ("parameter", "parameter_name"),
            ("buffer", "buffer_name"),
            ("tensor_constant", "tensor_constant_name"),
        ):
            entry = spec.get(kind) if isinstance(spec, dict) else None
            if isinstance(entry, dict) and isinstance(entry.get(field), str):
                persistent = kind != "buffer" or entry.get("persistent") is not False
                names[entry[field]] = kind if kind != "tensor_constant" and persistent else "constant"
    return names


def program_from_json(
    document: Any, tensors: Mapping[str, torch.Tensor], where: str, plain_types: dict[str, str] | None = None
) -> ExportedProgram:
    """The program a :func:`program_to_json` document describes, reading ``tensors`` by name.

    The program holds the tensors themselves (parameters wrapped as Parameters, no copy). Input
    and output containers whose type this process has not registered are plain ones, each added
    to ``plain_types`` with the plain type it became (``tree_specs.with_plain_containers``, which
    also refuses specs whose reading would import); the document itself is not changed.
    """
    missing_operators = unregistered_operators(check_graph_document(document, where))
    if missing_operators:
        namespaces = sorted({_namespace(target) for target in missing_operators})
        raise OperatorNotFoundError(
            f"{where}: the graph calls {', '.join(missing_operators)}, which this process has not registered "
            f"(the file itself is sound); import the library that defines the "
            f"{', '.join(map(repr, namespaces))} operators before loading"
        )
    document = with_plain_containers(document, where, {} if plain_types is None else plain_types)
    names = state_names(document)
    missing = sorted(set(names) - set(tensors))
    if missing:
        raise FormatError(f"{where}: the graph reads {', '.join(map(repr, missing))}, which are not stored")
    state_dict: dict[str, torch.Tensor] = {}
    constants: dict[str, torch.Tensor] = {}
    for name, kind in names.items():
        if kind == "parameter":
            state_dict[name] = torch.nn.Parameter(tensors[name], requires_grad=False)
        else:
            (state_dict if kind == "buffer" else constants)[name] = tensors[name]
    try:
        serialized = _dict_to_dataclass(schema.ExportedProgram, document)
        with torch_internal_warnings_silenced():
            return ExportedProgramDeserializer().deserialize(serialized, state_dict, constants, None)
    except FormatError:
        raise
    except Exception as e:
        raise FormatError(f"{where}: torch.export cannot read this graph ({type(e).__name__}: {e})") from e


# What a saved graph may name. Operators must be registered torch ops (never a Python path);
# higher-order ops and Python builtins come from fixed lists.
_OPERATOR_TARGET = re.compile(
    r"torch\.ops\.([A-Za-z_][A-Za-z0-9_]*)\.([A-Za-z_][A-Za-z0-9_]*)\.([A-Za-z_][A-Za-z0-9_]*)"
)
_HIGHER_ORDER_OPS = frozenset(
    {"cond", "while_loop", "map_impl", "scan", "associative_scan", "wrap_with_set_grad_enabled", "auto_functionalized"}
)
_BUILTINS = frozenset(
    {
        "_operator.getitem",
        *(f"_operator.{name}" for name in ("add", "sub", "mul", "floordiv", "truediv", "mod", "pow", "neg")),
        *(f"_operator.{name}" for name in ("eq", "ne", "lt", "le", "gt", "ge", "and_", "or_", "not_")),
        *(f"torch.{name}" for name in ("sym_not", "sym_int", "sym_float", "sym_max", "sym_min", "sym_ite")),
        *(f"torch.{name}" for name in ("sym_sqrt", "_sym_sqrt")),
        *(f"math.{name}" for name in ("ceil", "floor", "trunc")),
    }
)
_REFUSED_OPERATORS = frozenset({"from_file"})
# Symbolic sizes: symbols, integers, arithmetic and the sympy functions torch emits.
# No powers or shifts (a few characters could ask sympy for an astronomically large number),
# numbers of at most 19 digits, parentheses at most 32 deep.
_EXPRESSION_TOKEN = re.compile(
    r"\s*(?:([A-Za-z_][A-Za-z0-9_]*)|(\d{1,19}(?:\.\d{1,19})?(?![\d.]))|'([a-z]+\d+)'|(//|!=|[-+*/%(),<>=&|~]=?|==))"
)
_MAX_NESTING = 32
_SYMBOL = re.compile(r"[a-z]+\d+")
_EXPRESSION_FUNCTIONS = frozenset(
    {
        *("Max", "Min", "Mod", "FloorDiv", "CleanDiv", "CeilDiv", "IntTrueDiv", "FloatTrueDiv", "ToFloat"),
        *("TruncToInt", "TruncToFloat", "RoundToInt", "RoundDecimal", "CeilToInt"),
        *("FloorToInt", "Identity", "OpaqueUnaryFn_sqrt", "PythonMod", "IsNonOverlappingAndDenseIndicator"),
        *("Eq", "Ne", "Lt", "Le", "Gt", "Ge", "And", "Or", "Not", "Piecewise", "ITE", "True", "False", "oo"),
        *("floor", "ceiling", "sqrt", "Abs", "Integer", "Rational", "Float", "BitwiseFn_bitwise_and"),
        *("BitwiseFn_bitwise_or", "Symbol", "Add", "Mul"),
        # keyword assumptions of Symbol('s0', positive=True, integer=True)
        *("positive", "negative", "nonnegative", "nonpositive", "integer", "real", "finite", "zero", "commutative"),
    }
)


# Keys whose string values torch.fx writes into the Python source it generates and runs.
_NAME_KEYS = frozenset({"name", "as_name"})
_OPERATOR_KEYS = frozenset({"target", "as_operator"})  # a node's operator, and one passed as an argument


def check_graph_document(document: Any, where: str) -> set[str]:
    """Refuse any operator, name or symbolic expression a saved graph may not contain (a ``FormatError``);
    the operators it names.

    A graph document comes from the file: every operator it names, as a node's target or as an
    argument (``as_operator``), must be one a saved graph may call; every node, value and
    keyword name must be an identifier, since torch.fx writes names into the source it runs;
    custom objects (a class named by the file) are refused.
    """
    operators = set()
    for key, value in _walk(document):
        if key in _OPERATOR_KEYS and isinstance(value, str):
            _check_target(value, where)
            operators.add(value)
        elif key == "expr_str":
            _check_expression(value, where)
        elif key in _NAME_KEYS and isinstance(value, str) and value and not value.isidentifier():
            raise FormatError(f"{where}: the graph names {value[:80]!r}, which is not an identifier")
        elif key == "class_fqn":
            raise FormatError(f"{where}: the graph holds a custom object of class {str(value)[:80]!r}; none may")
    return operators


def operators_named(document: Any) -> set[str]:
    """Every operator a graph document names, as a node's target or as an argument, unchecked."""
    return {value for key, value in _walk(document) if key in _OPERATOR_KEYS and isinstance(value, str)}


def unregistered_operators(operators: Iterable[str]) -> list[str]:
    """Those of ``operators`` whose whole namespace this process lacks, sorted: the library that
    registers them is not imported, or not installed.

    An unknown name in a namespace this process has (``aten.rel4``) is not a missing library but
    a damaged file, or one from a newer torch; torch's deserializer reports those.
    """
    parsed = {target: match.groups() for target in operators if (match := _OPERATOR_TARGET.fullmatch(target))}
    unresolved = {t: parts for t, parts in parsed.items() if parts[0] != "higher_order" and not _registered(*parts)}
    if not unresolved:
        return []
    present = {name.split("::", 1)[0] for name in torch._C._dispatch_get_all_op_names()}
    return sorted(target for target, (namespace, _, _) in unresolved.items() if namespace not in present)


def _namespace(target: str) -> str:
    match = _OPERATOR_TARGET.fullmatch(target)
    assert match is not None
    return match.group(1)


def _registered(namespace: str, name: str, overload: str) -> bool:
    try:
        return isinstance(getattr(getattr(getattr(torch.ops, namespace), name), overload), OpOverload)
    except (AttributeError, RuntimeError):
        return False


def _walk(value: Any) -> Iterator[tuple[str, Any]]:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            for key, child in item.items():
                yield key, child
                stack.append(child)
        elif isinstance(item, list):
            stack.extend(item)


def _check_target(target: str, where: str) -> None:
    if target in _BUILTINS:
        return
    match = _OPERATOR_TARGET.fullmatch(target)
    if match is not None:
        namespace, name, _ = match.groups()
        if namespace == "higher_order":
            return _check_higher_order(name, target, where)
        if name not in _REFUSED_OPERATORS:
            return None
    if target.startswith("torch.ops.higher_order."):
        return _check_higher_order(target.removeprefix("torch.ops.higher_order."), target, where)
    raise FormatError(f"{where}: the graph calls {target!r}, which is not an operator a saved graph may call")


def _check_higher_order(name: str, target: str, where: str) -> None:
    if name not in _HIGHER_ORDER_OPS:
        raise FormatError(f"{where}: the graph calls {target!r}, which is not an operator a saved graph may call")


def _check_expression(expression: Any, where: str) -> None:
    if not isinstance(expression, str) or len(expression) > 10_000:
        raise FormatError(f"{where}: a symbolic size is not a short string")
    if "**" in "".join(expression.split()):
        raise FormatError(f"{where}: symbolic size {expression[:200]!r} raises to a power, which a saved size may not")
    position = depth = 0
    while position < len(expression):
        match = _EXPRESSION_TOKEN.match(expression, position)
        if match is None or match.end() == position:
            if expression[position:].strip() == "":
                return
            raise FormatError(
                f"{where}: symbolic size {expression[:200]!r} has an unexpected or too long token at {position}"
            )
        word, symbol = match.group(1), match.group(4)
        if word is not None and word not in _EXPRESSION_FUNCTIONS and not _SYMBOL.fullmatch(word):
            raise FormatError(f"{where}: symbolic size {expression[:200]!r} names {word!r}, which is not a size symbol")
        depth += 1 if symbol == "(" else -1 if symbol == ")" else 0
        if depth > _MAX_NESTING:
            raise FormatError(f"{where}: symbolic size {expression[:200]!r} nests deeper than {_MAX_NESTING}")
        position = match.end()


def delegate_call_nodes(gm: GraphModule) -> Iterator[tuple[GraphModule, Node]]:
    """Every ``delegate_call`` node of ``gm`` and of its sub-graphs, with the module it is in."""
    for module in gm.modules():
        if isinstance(module, GraphModule):
            for node in module.graph.nodes:
                if node.op == "call_function" and node.target is delegate_call:
                    yield module, node


def allowed_call_target(target: Any) -> bool:
    """Whether a deserialized node's target is one a saved graph may call."""
    if isinstance(target, OpOverload):
        return target._opname not in _REFUSED_OPERATORS
    if isinstance(target, HigherOrderOperator):
        return target.name() in _HIGHER_ORDER_OPS
    module = getattr(target, "__module__", None)
    name = getattr(target, "__name__", None)
    if target is operator.getitem:
        return True
    return f"{'_operator' if module == 'operator' else module}.{name}" in _BUILTINS
