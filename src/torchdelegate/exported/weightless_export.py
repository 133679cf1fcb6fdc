"""Export without weights: a model built over fake tensors, exported by ``torch.export``, and each
of the program's state entries then bound to its tensor in a checkpoint's safetensors files, by
memory map.

Exporting a model that holds its weights costs a copy of them (strict export keeps a clone of
every tensor it traces) on top of the copy the model was loaded into; built over fake tensors,
the model has shapes and dtypes but no memory, and the program's weights are views of the
checkpoint's pages, read only when a later stage reads them. A tensor whose checkpoint dtype is
not the program's (a bfloat16 checkpoint of a float32 model) is bound as it is stored, and the
graph converts it where it is read: no converted copy is made ahead of the stage that needs one.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, overload

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind

from torchdelegate.errors import CheckpointError
from torchdelegate.exported.programs import build_program
from torchdelegate.exported.safetensors_weights import SafetensorsWeights
from torchdelegate.exported.structural_copy import copy_graph, copy_module_call_graph, copy_signature, rebuilt

SMALLEST_BOUND_AS_STORED = 1 << 20
"""A tensor stored in another float dtype and smaller than this is converted when bound (a copy of its
size); a larger one is bound as stored, converted where the graph reads it."""

WeightFiles = str | os.PathLike[str] | Sequence[str | os.PathLike[str]] | Mapping[str, torch.Tensor]
"""Safetensors files (a file, several, their directory), or tensors by name (a :class:`SafetensorsWeights`)."""


@contextlib.contextmanager
def weightless() -> Iterator[FakeTensorMode]:
    """Inside, the parameters and buffers a module creates are fake tensors: their shapes and
    dtypes, and no memory. Build the model inside; export it outside, then :func:`bind_weights`."""
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        yield mode


def export_lazily(
    build_model: Callable[[], torch.nn.Module],
    args: tuple[Any, ...] = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    weights: WeightFiles,
    dynamic_shapes: Any = None,
    strict: bool = True,
    tensors: Mapping[str, torch.Tensor] | None = None,
) -> ExportedProgram:
    """``torch.export.export(build_model(), args, kwargs)`` as if the model had loaded ``weights``,
    without ever holding them: ``build_model`` runs under :func:`weightless`, and the program's
    state is bound to the safetensors files ``weights`` names (:func:`bind_weights`). The model's
    ``state_dict`` names are the files' tensor names; ``tensors`` gives the state the files do
    not hold (a non-persistent buffer the constructor computes), by the same names."""
    if isinstance(build_model, torch.nn.Module):
        raise TypeError(
            f"export_lazily was given a {type(build_model).__name__} already built, with its weights in memory; give "
            f"a function that builds it (lambda: {type(build_model).__name__}(...)), which runs without weights"
        )
    with weightless():
        model = build_model()
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"build_model returned a {type(model).__name__}; it must build the torch.nn.Module to export")
    program = torch.export.export(model, args, dict(kwargs or {}), dynamic_shapes=dynamic_shapes, strict=strict)
    return bind_weights(program, weights, tensors=tensors)


@overload
def bind_weights(
    programs: ExportedProgram,
    weights: WeightFiles,
    *,
    prefix: str = "",
    tensors: Mapping[str, torch.Tensor] | None = None,
) -> ExportedProgram: ...


@overload
def bind_weights(
    programs: Mapping[str, ExportedProgram],
    weights: WeightFiles,
    *,
    prefix: str = "",
    tensors: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, ExportedProgram]: ...


def bind_weights(
    programs: ExportedProgram | Mapping[str, ExportedProgram],
    weights: WeightFiles,
    *,
    prefix: str = "",
    tensors: Mapping[str, torch.Tensor] | None = None,
) -> ExportedProgram | dict[str, ExportedProgram]:
    """New programs whose fake state entries (a model exported under :func:`weightless`) are the
    checkpoint's tensors, views of its files' pages; real entries stay as they are.

    An entry named ``prefix + name`` is bound to the files' tensor ``name`` (``tensors``, by
    the entry's own name, first). Methods bound to one checkpoint share each tensor. The shapes
    must agree; a floating-point tensor stored in another floating dtype is bound as stored and
    converted where the graph reads it (converted when bound if smaller than
    ``SMALLEST_BOUND_AS_STORED``). The programs given are not changed.
    """
    source = weights if isinstance(weights, Mapping) else SafetensorsWeights(weights)
    binder = _Binder(source, prefix, dict(tensors or {}))
    if isinstance(programs, ExportedProgram):
        return binder.bound(programs, "forward")
    return {method: binder.bound(program, method) for method, program in programs.items()}


class _Binder:
    def __init__(self, weights: Mapping[str, torch.Tensor], prefix: str, tensors: dict[str, torch.Tensor]) -> None:
        self.weights, self.prefix, self.tensors = weights, prefix, tensors
        self.made: dict[tuple[str, bool], torch.Tensor] = {}  # one tensor per name: methods share it

    def value(self, fqn: str, like: torch.Tensor, method: str) -> torch.Tensor:
        given = self.tensors.get(fqn)
        name = fqn[len(self.prefix) :] if fqn.startswith(self.prefix) else None
        if given is None and (name is None or name not in self.weights):
            raise CheckpointError(
                f"method {method!r}: state {fqn!r} ({_described(like)}) is not in the checkpoint's files "
                f"(looked for {name!r} among their {len(self.weights)} tensors); give its value in tensors= "
                "(a buffer the model computes), or build the model whose checkpoint this is"
            )
        value = given if given is not None else self.weights[name or fqn]
        if tuple(value.shape) != tuple(like.shape):
            raise CheckpointError(
                f"method {method!r}: state {fqn!r} is {_described(like)} in the program but "
                f"{_described(value)} in the checkpoint; build the model with the checkpoint's config"
            )
        if value.dtype != like.dtype and not (value.dtype.is_floating_point and like.dtype.is_floating_point):
            raise CheckpointError(
                f"method {method!r}: state {fqn!r} is {_described(like)} in the program but "
                f"{_described(value)} in the checkpoint"
            )
        if value.dtype != like.dtype and value.nbytes < SMALLEST_BOUND_AS_STORED:
            return value.to(like.dtype)  # a norm's weight: converted here, no conversion in the graph
        return value

    def bound(self, program: ExportedProgram, method: str) -> ExportedProgram:
        """``program`` over the bound tensors: around the same graph when no dtype changed, else
        a copy of the graph that converts each changed entry where it is read."""
        converted: dict[str, torch.dtype] = {}

        def entry(fqn: str, value: Any) -> Any:
            made = self._entry(fqn, value, method)
            if isinstance(value, torch.Tensor) and made.dtype != value.dtype:
                converted[fqn] = made.dtype
            return made

        state = {k: entry(k, v) for k, v in program.state_dict.items()}
        constants = {k: entry(k, v) for k, v in program.constants.items()}
        if not converted:
            return rebuilt(program, state_dict=state, constants=constants)
        return _program_with(program, state, constants, converted)

    def _entry(self, fqn: str, value: Any, method: str) -> Any:
        if not isinstance(value, FakeTensor):
            return value
        key = (fqn, isinstance(value, torch.nn.Parameter))
        made = self.made.get(key)
        if made is None:
            bound = self.value(fqn, value, method)
            made = torch.nn.Parameter(bound, requires_grad=False) if key[1] else bound
            self.made[key] = made
        elif made.shape != value.shape:
            self.value(fqn, value, method)  # the shape error, named for this method
        return made


def _described(tensor: torch.Tensor) -> str:
    return f"{str(tensor.dtype).removeprefix('torch.')} {list(tensor.shape)}"


def _program_with(
    program: ExportedProgram, state: dict[str, Any], constants: dict[str, Any], converted: dict[str, torch.dtype]
) -> ExportedProgram:
    """``program`` over ``state`` and ``constants``; each placeholder of ``converted`` takes its new
    dtype and reaches its users through a conversion to the dtype the graph was traced with."""
    graph, attrs = copy_graph(program.graph_module)
    signature = copy_signature(program.graph_signature)
    if converted:
        mutated = set(signature.buffers_to_mutate.values())
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        by_name = {n.name: n for n in placeholders}
        last = placeholders[-1]
        for spec in signature.input_specs:
            if spec.target not in converted or spec.kind == InputKind.USER_INPUT:
                continue
            if spec.target in mutated:
                raise CheckpointError(
                    f"state {spec.target!r} is written by the program and stored as {converted[spec.target]} in "
                    "the checkpoint; a buffer the program writes must be stored in the dtype it is traced with"
                )
            node = by_name[spec.arg.name]
            traced = node.meta["val"]
            fake_mode = traced.fake_mode
            with graph.inserting_after(last):
                cast = graph.call_function(torch.ops.aten._to_copy.default, (node,), {"dtype": traced.dtype})
            node.replace_all_uses_with(cast, delete_user_cb=lambda user, c=cast: user is not c)
            with fake_mode:
                node.meta["val"] = torch.empty_strided(
                    traced.shape, traced.stride(), dtype=converted[spec.target], device=traced.device
                )
            cast.meta["val"] = traced
            for key in ("nn_module_stack", "stack_trace", "source_fn_stack"):
                if key in node.meta:
                    cast.meta[key] = node.meta[key]
            last = cast
        graph.lint()
    return build_program(
        program,
        attrs,
        graph,
        signature,
        state,
        constants,
        range_constraints=dict(program.range_constraints),
        module_call_graph=copy_module_call_graph(program.module_call_graph),
        with_meta=True,
    )
