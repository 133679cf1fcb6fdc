"""What a saved graph may contain, checked before torch's deserializer sees it.

Operators are named by their full path (never a Python path) and must be on the explicit list
(``operator_list``) when torch or this package owns their namespace; an operator of another
namespace belongs to an extension library, and is called only once the caller imported it.
Higher-order ops and Python builtins come from fixed lists; symbolic sizes are expressions over a
fixed vocabulary. Nothing in a file is executable: a graph that names anything else is a
FormatError. An operator whose kernel takes its arguments on trust runs behind its contract
(``operator_contracts``); torch's operators are never passed as an argument, where nothing checks
the arguments they are called with.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch._ops import HigherOrderOperator, OpOverload

from torchdelegate.errors import FormatError
from torchdelegate.serialize.node_checks import operator_behind
from torchdelegate.serialize.operator_list import ATEN_OPERATORS, OUR_OPERATORS, TORCH_NAMESPACES

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
_LISTED = {"aten": ATEN_OPERATORS, "torchdelegate": OUR_OPERATORS}
# Symbolic sizes: symbols, integers, arithmetic and the sympy functions torch emits.
# No powers or shifts (a few characters could ask sympy for an astronomically large number),
# numbers of at most 19 digits, parentheses at most 32 deep.
_EXPRESSION_TOKEN = re.compile(
    r"\s*(?:([A-Za-z_][A-Za-z0-9_]*)|(\d{1,19}(?:\.\d{1,19})?(?![\d.]))|'([a-z]+\d+)'|(//|!=|[-+*/%(),<>=&|~]=?|==)"
    r"|'-?\d{1,19}(?:\.\d{1,19})?')"  # a quoted number: Float('2.5', precision=53)
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
        *("BitwiseFn_bitwise_or", "Symbol", "Add", "Mul", "precision"),
        *("LessThan", "StrictLessThan", "GreaterThan", "StrictGreaterThan", "Equality", "Unequality"),
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
    for key, value in walk(document):
        if key in _OPERATOR_KEYS and isinstance(value, str):
            _check_target(value, where, passed=key == "as_operator")
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
    return {value for key, value in walk(document) if key in _OPERATOR_KEYS and isinstance(value, str)}


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


def namespace_of(target: str) -> str:
    match = _OPERATOR_TARGET.fullmatch(target)
    assert match is not None
    return match.group(1)


def _registered(namespace: str, name: str, overload: str) -> bool:
    try:
        return isinstance(getattr(getattr(getattr(torch.ops, namespace), name), overload), OpOverload)
    except (AttributeError, RuntimeError):
        return False


def walk(value: Any) -> Iterator[tuple[str, Any]]:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            for key, child in item.items():
                yield key, child
                stack.append(child)
        elif isinstance(item, list):
            stack.extend(item)


def _check_target(target: str, where: str, passed: bool = False) -> None:
    if passed:
        return _check_passed(target, where)
    if target in _BUILTINS:
        return
    match = _OPERATOR_TARGET.fullmatch(target)
    if match is not None:
        namespace, name, overload = match.groups()
        if namespace == "higher_order":
            return _check_higher_order(name, target, where)
        if _listed(namespace, f"{name}.{overload}"):
            return None
    if target.startswith("torch.ops.higher_order."):
        return _check_higher_order(target.removeprefix("torch.ops.higher_order."), target, where)
    raise FormatError(
        f"{where}: the graph calls {target!r}, which is not an operator a saved graph may call "
        "(the list: torchdelegate/serialize/operator_list.py, docs/FORMAT.md §3)"
    )


def _check_passed(target: str, where: str) -> None:
    """An operator passed to another (``auto_functionalized``'s mutating operator) is called without the
    checks a graph's own calls get: only an extension library's operator may be passed."""
    match = _OPERATOR_TARGET.fullmatch(target)
    if match is None or not passed_operator_allowed(match.group(1)):
        raise FormatError(
            f"{where}: the graph passes {target!r}, which is not an operator a saved graph may pass to another "
            "(only an extension library's operators are passed, to auto_functionalized)"
        )


def passed_operator_allowed(namespace: str) -> bool:
    """Whether an operator of ``namespace`` may be passed as an argument: not torch's, nor ours."""
    return namespace not in TORCH_NAMESPACES


def _listed(namespace: str, name: str) -> bool:
    """Whether an operator of ``namespace`` named ``name.overload`` is one a saved graph may call."""
    if namespace in _LISTED:
        return name in _LISTED[namespace]
    return namespace not in TORCH_NAMESPACES


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


def allowed_call_target(target: Any) -> bool:
    """Whether a deserialized node's target is one a saved graph may call (an operator behind its
    contract stands for the operator)."""
    target = operator_behind(target)
    if isinstance(target, OpOverload):
        return _listed(target.namespace, f"{target._opname}.{target._overloadname}")
    if isinstance(target, HigherOrderOperator):
        return target.name() in _HIGHER_ORDER_OPS
    module = getattr(target, "__module__", None)
    name = getattr(target, "__name__", None)
    if target is operator.getitem:
        return True
    return f"{'_operator' if module == 'operator' else module}.{name}" in _BUILTINS
