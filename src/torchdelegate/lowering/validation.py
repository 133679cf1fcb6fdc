"""What a partitioner may do to the graph it is given.

With validation on, it may only tag: the check below finds the first change. Inside
``validation_disabled()`` it may change the graph; the changed program is then completed (added
nodes get their metadata) and verified, so that lowering either goes on with a valid program or
stops naming the node at fault.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch._export.verifier import SpecViolationError
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.export import ExportedProgram
from torch.fx import GraphModule, Node

from torchdelegate.errors import GraphChangedError, first_line
from torchdelegate.exported.structural_copy import fetch_attr
from torchdelegate.exported.torch_warnings import loggers_quieted

_state = threading.local()
_disabled_globally = False


@contextlib.contextmanager
def validation_disabled() -> Iterator[None]:
    """Within this block (in this thread), lowering does not check partitioners' graphs."""
    previous = getattr(_state, "disabled", False)
    _state.disabled = True
    try:
        yield
    finally:
        _state.disabled = previous


def disable_validation() -> None:
    """Stop checking partitioners' graphs, for the rest of the process."""
    global _disabled_globally
    _disabled_globally = True


def validation_enabled() -> bool:
    return not (_disabled_globally or getattr(_state, "disabled", False))


def _shape(value: Any) -> Any:
    """An argument with nodes replaced by their names, for comparison."""
    return torch.fx.node.map_aggregate(value, lambda v: ("node", v.name) if isinstance(v, Node) else v)


def _describe(node: Node) -> str:
    return f"{node.op} {node.name!r} ({node.target})"


def first_graph_difference(original: GraphModule, tagged: GraphModule, where: str = "graph") -> str | None:
    """The first structural difference between two graphs (and their sub-graphs), or None."""
    old_nodes = list(original.graph.nodes)
    new_nodes = list(tagged.graph.nodes)
    for old, new in zip(old_nodes, new_nodes, strict=False):
        if (old.op, old.name, old.target) != (new.op, new.name, new.target):
            if new.name not in {n.name for n in old_nodes}:
                return f"{where}: node {_describe(new)} was added before {old.name!r}"
            if old.name not in {n.name for n in new_nodes}:
                return f"{where}: node {_describe(old)} was removed"
            return f"{where}: node {_describe(old)} became {_describe(new)}"
        if _shape(old.args) != _shape(new.args) or _shape(old.kwargs) != _shape(new.kwargs):
            return f"{where}: the arguments of node {old.name!r} changed"
        if old.op == "get_attr":
            old_value, new_value = fetch_attr(original, old.target), fetch_attr(tagged, new.target)
            if isinstance(old_value, GraphModule) and isinstance(new_value, GraphModule):
                found = first_graph_difference(old_value, new_value, f"{where}.{old.target}")
                if found:
                    return found
            elif isinstance(old_value, torch.Tensor) != isinstance(new_value, torch.Tensor):
                return f"{where}: attribute {old.target!r} changed type"
    if len(old_nodes) != len(new_nodes):
        extra = new_nodes[len(old_nodes) :] or old_nodes[len(new_nodes) :]
        verb = "added" if len(new_nodes) > len(old_nodes) else "removed"
        return f"{where}: node {_describe(extra[0])} was {verb}"
    return None


def program_fingerprint(program: ExportedProgram) -> tuple[Any, ...]:
    """Everything about a program's structure that a backend could change in place.

    Compared before and after ``preprocess``: the graphs (all sub-graphs too), the signature,
    and which tensors the program holds. fx keeps arguments in immutable containers, so
    holding them is a snapshot. Cost is linear in nodes; no tensor data is read.
    """
    nodes = tuple(
        (node, node.op, node.name, node.target, node.args, node.kwargs)
        for gm in program.graph_module.modules()
        if isinstance(gm, GraphModule)
        for node in gm.graph.nodes
    )
    state = tuple((k, id(v)) for k, v in (*program.state_dict.items(), *program.constants.items()))
    return nodes, str(program.graph_signature), state


def complete_changed_program(program: ExportedProgram, partitioner: str, method: str) -> None:
    """Make the program a partitioner changed (validation off) valid again, in place, or raise.

    Nodes it added without ``meta['val']`` are dropped when nothing uses them, and otherwise get
    the value their op computes on fake tensors. Then torch's verifier checks the whole program;
    whatever it refuses becomes a ``GraphChangedError`` naming the partitioner and the method.
    """
    where = f"partitioner {partitioner} changed method {method!r} inside validation_disabled()"
    _check_inputs(program, where)
    _follow_outputs(program, where)
    fake_mode = _fake_mode_of(program)
    for gm in program.graph_module.modules():
        if isinstance(gm, GraphModule):
            _drop_dead_additions(gm)
            _give_values(gm, fake_mode, where)
    try:
        program.validate()
    except SpecViolationError as e:
        raise GraphChangedError(
            f"{where} and left it invalid: {first_line(e)}. Give every node it adds an ATen operator overload "
            "(torch.ops.aten.<op>.<overload>) and keep the inputs and outputs the graph signature names"
        ) from e


def _check_inputs(program: ExportedProgram, where: str) -> None:
    listed = [spec.arg.name for spec in program.graph_signature.input_specs if hasattr(spec.arg, "name")]
    found = [node.name for node in program.graph.nodes if node.op == "placeholder"]
    if found != listed:
        added = [name for name in found if name not in listed]
        removed = [name for name in listed if name not in found]
        change = "reordered the inputs"
        if added or removed:
            change = f"added input {added[0]!r}" if added else f"removed input {removed[0]!r}"
        raise GraphChangedError(
            f"{where} and {change}: the graph's inputs must stay those its signature lists ({', '.join(listed)})"
        )


def _follow_outputs(program: ExportedProgram, where: str) -> None:
    """Point the signature's outputs at the nodes the graph now returns, position by position."""
    returned = program.graph.output_node().args[0]
    specs = program.graph_signature.output_specs
    if not isinstance(returned, tuple | list) or len(returned) != len(specs):
        count = len(returned) if isinstance(returned, tuple | list) else 1
        raise GraphChangedError(f"{where} and made it return {count} values where its signature lists {len(specs)}")
    for i, (spec, value) in enumerate(zip(specs, returned, strict=True)):
        name = getattr(spec.arg, "name", None)
        if isinstance(value, Node) and name is not None and name != value.name:
            specs[i] = dataclasses.replace(spec, arg=dataclasses.replace(spec.arg, name=value.name))


def _missing_value(node: Node) -> bool:
    return node.op == "call_function" and "val" not in node.meta


def _drop_dead_additions(gm: GraphModule) -> None:
    """Erase added nodes (those without a value) whose results nothing uses; chains go too."""
    dropped = False
    for node in reversed(list(gm.graph.nodes)):
        if _missing_value(node) and not node.users and not node.is_impure():
            gm.graph.erase_node(node)
            dropped = True
    if dropped:
        gm.recompile()


def _fake_mode_of(program: ExportedProgram) -> FakeTensorMode:
    values = [node.meta.get("val") for node in program.graph.nodes if node.op == "placeholder"]
    found = torch._guards.detect_fake_mode(values)
    return found if found is not None else FakeTensorMode(allow_non_fake_inputs=True)


def _give_values(gm: GraphModule, fake_mode: FakeTensorMode, where: str) -> None:
    """Run each node without a value on fake tensors, in graph order, and keep what it returns."""
    for node in gm.graph.nodes:
        if not _missing_value(node):
            continue
        if not isinstance(node.target, torch._ops.OpOverload | torch._ops.HigherOrderOperator):
            raise GraphChangedError(
                f"{where}: node {node.name!r} it added calls {node.target!r}, which is not an ATen "
                "operator overload; call torch.ops.aten.<op>.<overload> instead"
            )
        try:
            args, kwargs = torch.fx.node.map_aggregate(
                (node.args, node.kwargs), lambda a: _fake_argument(gm, a, fake_mode)
            )
            with fake_mode, loggers_quieted(["torch._subclasses.fake_tensor"]):  # our error names the node
                node.meta["val"] = node.target(*args, **kwargs)  # type: ignore[operator]
        except Exception as e:
            raise GraphChangedError(
                f"{where}: node {_describe(node)} it added has no meta['val'], and running its op on the "
                f"values of its arguments failed ({type(e).__name__}: {first_line(e)}). "
                "Set node.meta['val'] when adding the node, or fix its arguments"
            ) from e


def _fake_argument(gm: GraphModule, value: Any, fake_mode: FakeTensorMode) -> Any:
    if isinstance(value, Node):
        if "val" in value.meta:
            return value.meta["val"]
        if value.op == "get_attr":
            value = fetch_attr(gm, str(value.target))
        else:
            raise ValueError(f"its argument {_describe(value)} has no meta['val'] either")
    if isinstance(value, torch.Tensor) and not isinstance(value, torch._subclasses.FakeTensor):
        return fake_mode.from_tensor(value, static_shapes=True)
    return value
