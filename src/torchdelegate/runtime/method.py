"""One method of a loaded program: its residual graph, compiled once, and how to call it.

The graph is torch.export's, read back from the file; each saved ``call_delegate`` node becomes a
direct call into a :class:`~torchdelegate.delegate.instance.DelegateInstance`, so a delegate costs
one Python call and the backend's ``execute``. State inputs (parameters, buffers,
constants) are the program's tensors, shared by name with its other methods; after a call,
buffer updates are written into those tensors, as the exported module does in eager.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from typing import Any, cast

import numpy as np
import torch
import torch.utils._pytree as pytree
from torch.fx import GraphModule

from torchdelegate.delegate.instance import DelegateInstance
from torchdelegate.errors import FormatError, MethodExecutionError, TorchDelegateError
from torchdelegate.exported.programs import output_values
from torchdelegate.runtime.array_method import as_torch, tensor_array
from torchdelegate.runtime.inputs import MethodInputs
from torchdelegate.serialize.allow_list import allowed_call_target, passed_operator_allowed
from torchdelegate.serialize.call_delegate import SIZE, TENSOR, saved_call_nodes
from torchdelegate.serialize.node_checks import node_target
from torchdelegate.serialize.runnable_graph import ResidualGraph, TensorValue


def _compile_graph(
    program: ResidualGraph, method: str, delegates: Mapping[int, DelegateInstance], kinds: Mapping[int, str]
) -> GraphModule:
    """The program's graph module with every delegate call bound to its delegate instance, and every
    call behind the checks its arguments need (``node_checks``)."""
    gm = program.graph_module
    touched: dict[GraphModule, None] = {}
    top_level: dict[int, list[torch.fx.Node]] = {}
    for module, node in list(saved_call_nodes(gm)):
        index, call = _bind_saved_call(module.graph, node, method, delegates, kinds)
        touched[module] = None
        if module is gm:
            top_level.setdefault(index, []).append(call)
    for index, calls in top_level.items():
        donated = _donated_inputs(program, calls[0]) if len(calls) == 1 else {}
        if donated:
            delegates[index].donate(donated)
    for submodule in gm.modules():
        if not isinstance(submodule, GraphModule):
            continue
        for node in submodule.graph.nodes:
            if node.op != "call_function" or _is_bound_delegate(node.target):
                continue
            passed_operators = _operators_in((node.args, node.kwargs))
            for target in (node.target, *passed_operators):
                if not allowed_call_target(target):
                    raise FormatError(f"method {method!r}: node {node.name!r} calls {target!r}, which is not allowed")
            for passed in passed_operators:
                namespace = getattr(passed, "namespace", None)
                if isinstance(namespace, str) and not passed_operator_allowed(namespace):
                    raise FormatError(
                        f"method {method!r}: node {node.name!r} passes {passed!r}, which may not be passed"
                    )
            try:
                target = node_target(node)
            except FormatError as e:
                raise FormatError(f"method {method!r}: {e}") from None
            if target is not node.target:
                node.target = target
                touched[submodule] = None
    for module in touched:
        module.recompile()
    return gm


def _operators_in(arguments: Any) -> list[Any]:
    """Callables passed as arguments (a control-flow op's function, say): each is called too."""
    found: list[Any] = []
    torch.fx.node.map_aggregate(
        arguments, lambda a: found.append(a) if callable(a) and not isinstance(a, torch.fx.Node) else None
    )
    return found


def _bind_saved_call(
    graph: torch.fx.Graph,
    node: torch.fx.Node,
    method: str,
    delegates: Mapping[int, DelegateInstance],
    kinds: Mapping[int, str],
) -> tuple[int, torch.fx.Node]:
    """Replace a saved ``call_delegate(index, tensors, sizes)`` by a call of the delegate's instance;
    the delegate's index and the call."""
    index, tensors, sizes = cast(tuple[int, list[Any], list[Any]], node.args)
    if index not in delegates:
        raise FormatError(f"method {method!r} calls delegate {index}, which the method does not list")
    expected = kinds[index]
    if (len(tensors), len(sizes)) != (expected.count(TENSOR), expected.count(SIZE)):
        raise FormatError(
            f"method {method!r}: the call of delegate {index} passes {len(tensors)} tensors and {len(sizes)} "
            f"sizes; the delegate table says {expected!r}"
        )
    delegate = delegates[index]
    count = node.meta.get("output_count")
    if count != delegate.output_count:
        raise FormatError(
            f"method {method!r}: the graph expects delegate {index} to return "
            f"{'no list of' if count is None else count} values; its table entry says {delegate.output_count}"
        )
    for user in node.users:
        read = user.args[1] if user.target is operator.getitem else None
        if type(read) is not int or not 0 <= read < delegate.output_count:
            raise FormatError(
                f"method {method!r}: node {user.name!r} reads {user.args[1:]!r} of delegate {index}, which "
                f"returns {delegate.output_count} values"
            )
    tensor_iter, size_iter = iter(tensors), iter(sizes)
    inputs = [next(size_iter) if kind == SIZE else next(tensor_iter) for kind in expected]
    with graph.inserting_before(node):
        call = graph.call_function(delegate.call, tuple(inputs))
    call.meta = node.meta
    node.replace_all_uses_with(call)
    graph.erase_node(node)
    return index, call


def _donated_inputs(program: ResidualGraph, call: torch.fx.Node) -> dict[int, int]:
    """The delegate call's inputs whose memory its outputs may take, ``{input: output}``: a buffer the
    call alone reads, which the method replaces with one of the call's outputs that nothing else uses."""
    graph = program.graph_module.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    kinds = {node: spec for node, spec in zip(placeholders, program.inputs, strict=True)}
    returned = output_values(next(reversed(graph.nodes)))
    replaced_by = {
        spec.target: returned[position]
        for position, spec in enumerate(program.outputs)
        if spec.kind == "buffer_mutation"
    }
    donated = {}
    for position, argument in enumerate(call.args):
        if not isinstance(argument, torch.fx.Node) or len(argument.users) != 1 or call.args.count(argument) != 1:
            continue
        spec = kinds.get(argument)
        if spec is None or spec.kind != "buffer":
            continue
        written = replaced_by.get(spec.target)
        if (
            isinstance(written, torch.fx.Node)
            and written.target is operator.getitem
            and written.args[0] is call
            and len(written.users) == 1
            and returned.count(written) == 1
        ):
            donated[position] = cast(int, written.args[1])
    return donated


def _is_bound_delegate(target: Any) -> bool:
    return getattr(target, "__self__", None).__class__ is DelegateInstance


def _check_state(method: str, name: str, tensor: torch.Tensor, expected: Any) -> None:
    """A stored tensor must be what the graph was traced with: its dtype and static sizes."""
    if not isinstance(expected, TensorValue):
        raise FormatError(f"method {method!r}: the graph has no tensor metadata for state {name!r}")
    static = all(isinstance(size, int) for size in expected.sizes)
    if tensor.dtype != expected.dtype or (static and tuple(tensor.shape) != expected.sizes):
        raise FormatError(
            f"method {method!r}: state {name!r} is stored as {tensor.dtype} {tuple(tensor.shape)}, "
            f"the graph reads {expected.dtype} {expected.sizes}"
        )


def _tensor_of(array: np.ndarray, written: bool) -> torch.Tensor:
    """A tensor over ``array``'s memory; a copy of a read-only one when the method writes its inputs
    (``written``), which must not write read-only memory."""
    return as_torch(array.copy() if written and not array.flags.writeable else array)  # type: ignore[no-any-return]


class Method:
    """A callable method of a :class:`~torchdelegate.runtime.program.Program`."""

    def __init__(
        self,
        name: str,
        program: ResidualGraph,
        state: Mapping[str, torch.Tensor],
        delegates: Mapping[int, DelegateInstance],
        delegate_inputs: Mapping[int, str],
        mutable: frozenset[str] = frozenset(),
    ) -> None:
        self.name = name
        self.inputs = MethodInputs(name, program)
        self._forward = _compile_graph(program, name, delegates, delegate_inputs).forward
        self._out_spec = program.out_spec
        self._template: list[Any] = []
        self._user_slots: list[int] = []
        for spec in program.inputs:
            if spec.kind == "user_input":
                self._user_slots.append(len(self._template))
                self._template.append(None)
            else:
                tensor = state[spec.target]  # type: ignore[index]
                _check_state(name, spec.target, tensor, spec.value)  # type: ignore[arg-type]
                self._template.append(tensor)
        user_inputs = [spec.name for spec in program.inputs if spec.kind == "user_input"]
        user_positions = {name: position for position, name in enumerate(user_inputs)}
        self._buffer_updates: list[tuple[int, torch.Tensor]] = []
        self._input_updates: list[tuple[int, int]] = []
        self._user_outputs: list[int] = []
        for position, output in enumerate(program.outputs):
            if output.kind == "buffer_mutation":
                self._buffer_updates.append((position, state[output.target]))  # type: ignore[index]
            elif output.kind == "user_input_mutation":
                self._input_updates.append((position, user_positions[output.target]))  # type: ignore[index]
            elif output.kind == "user_output":
                self._user_outputs.append(position)
            else:
                raise FormatError(f"method {name!r}: output {position} of kind {output.kind.upper()} is not supported")
        self._single_output = self._out_spec.is_leaf()
        if self._out_spec.num_leaves != len(self._user_outputs):
            raise FormatError(
                f"method {name!r}: its output structure has {self._out_spec.num_leaves} values, "
                f"the graph returns {len(self._user_outputs)}"
            )
        self.writes = frozenset(program.buffers_to_mutate)
        reads = {s.target for s in program.inputs if s.kind == "buffer"}
        # Buffers shared with other methods: calls that touch them are serialized by the program.
        self.uses_mutable_state = bool(self._buffer_updates) or not reads.isdisjoint(mutable)

    def call(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
        """Run with the exported module's calling convention; outputs in its structure. Numpy arrays
        among the inputs are read as tensors (no copy), and the outputs then come back as arrays."""
        arrays_in = any(isinstance(value, np.ndarray) for value in pytree.tree_leaves((args, kwargs)))
        if arrays_in:
            written = bool(self._input_updates)  # a read-only array is copied: the method writes an input
            args, kwargs = pytree.tree_map_only(
                np.ndarray, lambda a: _tensor_of(a, written), (tuple(args), dict(kwargs))
            )
        outputs = self.run_flat(self.inputs.flatten(args, kwargs))
        return pytree.tree_map_only(torch.Tensor, tensor_array, outputs) if arrays_in else outputs

    def run_flat(self, user_inputs: Sequence[Any]) -> Any:
        """Run on already checked flat user inputs; the outputs in the method's structure."""
        outputs = self.run_user_outputs(user_inputs)
        if self._single_output:
            return outputs[0]
        return pytree.tree_unflatten(outputs, self._out_spec)

    def run_user_outputs(self, user_inputs: Sequence[Any]) -> list[Any]:
        """Run on flat user inputs; the flat user outputs (buffers and mutated inputs updated)."""
        arguments = list(self._template)
        for slot, value in zip(self._user_slots, user_inputs, strict=True):
            arguments[slot] = value
        # torch.no_grad(), without its context-manager objects: this runs once per call.
        grad_was_enabled = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        try:
            try:
                outputs = self._forward(*arguments)
            except TorchDelegateError:
                raise
            except Exception as error:
                raise MethodExecutionError(
                    f"method {self.name!r}: an op of its graph (outside any delegate) failed: "
                    f"{type(error).__name__}: {error}; check the inputs' values (indices in range), "
                    "or re-export and save the program if the file was altered"
                ) from error
            for position, buffer in self._buffer_updates:
                if outputs[position] is not buffer:  # a delegate that wrote it in place returns the buffer
                    buffer.copy_(outputs[position])
            for position, user in self._input_updates:
                user_inputs[user].copy_(outputs[position])
        finally:
            torch._C._set_grad_enabled(grad_was_enabled)
        return [outputs[p] for p in self._user_outputs]
