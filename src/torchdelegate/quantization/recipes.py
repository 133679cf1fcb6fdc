"""Quantization recipes applied to exported programs, for deployers who start from fp32.

``quantize(programs, "8da4w")`` gives new programs whose linear layers carry torchao's quantized
weights, exactly as exporting a model after ``torchao.quantization.quantize_`` would: each
weight is quantized by torchao itself, and the graph reads it through torchao's own
``dequantize_affine`` (with dynamic int8 activations, ``choose_qparams_affine`` and
``quantize_affine`` before it). A backend that runs quantized layers (``quantization.linear``)
then sees the same program whichever way it was made. The caller's programs are unchanged; the
weights left in float are shared with them.

This module is ``quantize``'s pass over the programs: the layers selected, each weight rewritten where
the graph reads it. The recipes by name are ``recipe_table``'s (``RECIPES`` and ``DEFAULT_RECIPE`` are
importable from here too), the recipe each layer takes is ``layer_choice``'s, and a weight quantized by
torchao is ``torchao_weights``'.

torchao is needed to quantize (``pip install torchao``); a lowered file runs without it.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any, cast, overload

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, InputSpec
from torch.fx import Node

from torchdelegate.errors import QuantizationError
from torchdelegate.exported.programs import build_program
from torchdelegate.exported.structural_copy import copy_graph, copy_module_call_graph, copy_signature
from torchdelegate.lowering.equal_programs import once_per_program
from torchdelegate.partition.modules import module_path
from torchdelegate.quantization.experts import float_experts_note
from torchdelegate.quantization.layer_choice import KeptFloat, RecipeChoice
from torchdelegate.quantization.linear import affine_ops
from torchdelegate.quantization.quantized_graph import QuantizedGraph, weight_placeholder
from torchdelegate.quantization.recipe_table import EMBEDDING_RECIPES, RECIPES, recipe_named
from torchdelegate.quantization.torchao_weights import QuantizedWeights, WeightsMade, torchao_quantization

_aten = torch.ops.aten


@overload
def quantize(
    programs: ExportedProgram,
    recipe: str,
    *,
    group_size: int | None = None,
    keep_float: Sequence[str] = (),
    embeddings: str | None = None,
) -> ExportedProgram: ...


@overload
def quantize(
    programs: Mapping[str, ExportedProgram],
    recipe: str,
    *,
    group_size: int | None = None,
    keep_float: Sequence[str] = (),
    embeddings: str | None = None,
) -> dict[str, ExportedProgram]: ...


def quantize(
    programs: ExportedProgram | Mapping[str, ExportedProgram],
    recipe: str,
    *,
    group_size: int | None = None,
    keep_float: Sequence[str] = (),
    embeddings: str | None = None,
) -> ExportedProgram | dict[str, ExportedProgram]:
    """New programs whose float linear layers are quantized by ``recipe`` (``RECIPES``: ``8da4w-asym``,
    ``8da4w``, ``8da8w``, ``int4``, ``int8``).

    ``group_size``: inputs per scale (default 32 for the int4 recipes, one scale per row for
    int8); it must divide the inputs of every layer quantized. ``keep_float``: patterns
    (``fnmatch``) of weight names or module paths left in float, such as ``lm_head``. Layers
    whose weight is not a float parameter (already quantized, say) are left as they are.
    ``embeddings``: ``int8`` (one scale per row) or ``int4`` (groups of 32 along a row)
    quantizes the embedding tables too, weight-only; None leaves them in float. Methods that
    share a weight share its quantized form.

    A recipe that names a ``head`` recipe (``8da4w-asym``: ``8da8w``) quantizes by it each layer
    whose output is the program's output, through reshapes and element-wise steps alone (an LLM's
    head). A weight the head and an embedding table both read, quantized alike by both (8da8w and
    int8 tables: one int8 scale per row), is stored once. Methods whose programs are equal (an
    LLM's ``decode`` exported as its ``prefill``) are quantized once, the others given a copy.
    The weights of a mixture's experts (3-D stacks, not linear layers) stay in float, with a warning.
    """
    chosen = recipe_named(recipe)
    if group_size is not None and (isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1):
        raise QuantizationError(f"group size {group_size!r}: give a positive integer number of inputs per scale")
    group = group_size if group_size is not None else chosen.group_size
    patterns = KeptFloat([keep_float] if isinstance(keep_float, str) else list(keep_float))
    made: WeightsMade = {}
    weights = QuantizedWeights(chosen, group, made)
    heads = None if chosen.head is None else _weights_of(chosen.head, made)
    tables = None if embeddings is None else _embedding_weights(embeddings, made)
    named = tuple((pattern, _weights_of(name, made)) for pattern, name in chosen.layers)
    last = None if chosen.last_block is None else _weights_of(chosen.last_block, made)
    choice = RecipeChoice(weights, heads, tables, named, last)
    if isinstance(programs, ExportedProgram):
        quantized: ExportedProgram | dict[str, ExportedProgram] = _quantized(programs, "forward", choice, patterns)
    else:
        quantized = once_per_program(programs, lambda method, program: _quantized(program, method, choice, patterns))
    left = float_experts_note(quantized if isinstance(quantized, dict) else {"forward": quantized}, recipe)
    if left is not None:
        warnings.warn(left, stacklevel=2)
    for pattern in patterns.unmatched():
        warnings.warn(
            f"keep_float pattern {pattern!r} matched no linear layer or embedding; nothing was kept in float for it",
            stacklevel=2,
        )
    return quantized


def _weights_of(name: str, made: WeightsMade) -> QuantizedWeights:
    recipe = recipe_named(name)
    return QuantizedWeights(recipe, recipe.group_size, made)


def _embedding_weights(name: str, made: WeightsMade) -> QuantizedWeights:
    """The weight-only recipe of embedding tables ``name`` names: int8 per row, int4 in groups of 32."""
    if name not in EMBEDDING_RECIPES:
        raise QuantizationError(
            f"unknown embedding quantization {name!r}; give int8 (one scale per row) or int4 (groups of 32)"
        )
    recipe = RECIPES[name]
    return QuantizedWeights(recipe, recipe.group_size, made)


def _quantized(program: ExportedProgram, method: str, choice: RecipeChoice, keep_float: KeptFloat) -> ExportedProgram:
    ops = affine_ops()
    if ops is None:
        torchao_quantization()  # registers torch.ops.torchao
        ops = affine_ops()
    if ops is None:
        raise ImportError("this torchao lacks torch.ops.torchao's affine quantization ops: pip install 'torchao>=0.18'")
    graph, attrs = copy_graph(program.graph_module)
    signature = copy_signature(program.graph_signature)
    parameters = {s.arg.name: s for s in signature.input_specs if s.kind == InputKind.PARAMETER}
    state = dict(program.state_dict)
    layers = [n for n in graph.nodes if _selected(n, _aten.linear.default, parameters, program, keep_float)]
    lookups = (
        []
        if choice.tables is None
        else [n for n in graph.nodes if _selected(n, _aten.embedding.default, parameters, program, keep_float)]
    )
    if not layers and not lookups:
        return program
    rewrite = QuantizedGraph(graph, signature, state, ops)
    placed = choice.by_structure(graph, layers)
    for linear in layers:
        spec = parameters[weight_placeholder(cast(Node, linear.args[1])).name]
        assert spec.target is not None
        weights = choice.of(linear, [spec.target, spec.target.rpartition(".")[0], module_path(linear)], placed)
        where = f"method {method!r}: linear layer {module_path(linear) or linear.name!r} (weight {spec.target!r})"
        qdata, scale, zero_point, group = weights.quantized(program.state_dict[spec.target], where)
        recipe = weights.recipe
        rewrite.layer(
            linear, spec.target, (qdata, scale, zero_point), group, recipe.weight_bits, recipe.dynamic_int8_activation
        )
    tables = choice.tables
    for lookup in lookups:
        assert tables is not None
        spec = parameters[weight_placeholder(cast(Node, lookup.args[0])).name]
        assert spec.target is not None
        where = f"method {method!r}: embedding {module_path(lookup) or lookup.name!r} (weight {spec.target!r})"
        qdata, scale, zero_point, group = tables.quantized(program.state_dict[spec.target], where)
        rewrite.lookup(lookup, spec.target, (qdata, scale, zero_point), group, tables.recipe.weight_bits)
    rewrite.finish()
    return build_program(
        program,
        attrs,
        graph,
        rewrite.signature(),
        state,
        dict(program.constants),
        range_constraints=dict(program.range_constraints),
        module_call_graph=copy_module_call_graph(program.module_call_graph),
        with_meta=True,
    )


def _selected(
    node: Node, target: Any, parameters: dict[str, InputSpec], program: ExportedProgram, keep_float: KeptFloat
) -> bool:
    """A linear layer (or an embedding, as ``target`` says) over a 2-D float parameter read as float32
    that no pattern keeps in float."""
    if node.op != "call_function" or node.target is not target or len(node.args) < 2:
        return False
    weight = node.args[1] if target is _aten.linear.default else node.args[0]
    if not isinstance(weight, Node) or not _is_float32(weight):
        return False
    spec = parameters.get(weight_placeholder(weight).name)
    if spec is None or spec.target is None:
        return False
    value = program.state_dict.get(spec.target)
    if not isinstance(value, torch.Tensor) or type(value) not in (torch.Tensor, torch.nn.Parameter):
        return False
    if not value.dtype.is_floating_point or value.dim() != 2:
        return False
    return not keep_float.keeps([spec.target, spec.target.rpartition(".")[0], module_path(node)])


def _is_float32(node: Node) -> bool:
    value = node.meta.get("val")
    return isinstance(value, torch.Tensor) and value.dtype == torch.float32
