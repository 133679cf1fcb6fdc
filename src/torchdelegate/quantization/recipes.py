"""Quantization recipes applied to exported programs, for deployers who start from fp32.

``quantize(programs, "8da4w")`` gives new programs whose linear layers carry torchao's quantized
weights, exactly as exporting a model after ``torchao.quantization.quantize_`` would: each
weight is quantized by torchao itself, and the graph reads it through torchao's own
``dequantize_affine`` (with dynamic int8 activations, ``choose_qparams_affine`` and
``quantize_affine`` before it). A backend that runs quantized layers (``quantization.linear``)
then sees the same program whichever way it was made. The caller's programs are unchanged; the
weights left in float are shared with them.

torchao is needed to quantize (``pip install torchao``); a lowered file runs without it.
"""

from __future__ import annotations

import fnmatch
import importlib
import re
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any, cast, overload

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, InputSpec
from torch.fx import Graph, Node

from torchdelegate.errors import QuantizationError, first_line
from torchdelegate.exported.freed_memory import return_freed_memory
from torchdelegate.exported.mapped_pages import release_buffer
from torchdelegate.exported.programs import build_program
from torchdelegate.exported.spilled_tensors import SpilledTensors
from torchdelegate.exported.structural_copy import copy_graph, copy_module_call_graph, copy_signature
from torchdelegate.exported.torch_warnings import import_noise_quieted
from torchdelegate.lowering.equal_programs import once_per_program
from torchdelegate.partition.modules import module_path
from torchdelegate.quantization.experts import float_experts_note
from torchdelegate.quantization.linear import affine_ops
from torchdelegate.quantization.quantized_graph import QuantizedGraph, weight_placeholder

_aten = torch.ops.aten


@dataclass(frozen=True)
class Recipe:
    """What a recipe does to each linear layer's weight (and activation)."""

    name: str
    weight_bits: int
    grouped: bool  # groups along the input dimension by default; else one scale per output row
    dynamic_int8_activation: bool
    summary: str
    symmetric: bool = True  # zero points all zero; else one per group (each group's minimum to maximum)
    group_size: int | None = None  # default inputs per scale of a grouped recipe
    head: str | None = None  # the recipe of a layer whose output is the program's (an LLM's head)
    layers: tuple[tuple[str, str], ...] = ()  # (pattern, recipe): matching layers take that recipe instead
    last_block: str | None = None  # the recipe of the last numbered block's layers (an LLM's last decoder layer)


RECIPES = {
    "8da4w-asym": Recipe(
        "8da4w-asym", 4, True, True,
        "int8 dynamic activations, int4 weights in groups with zero points; 8da8w for the head, the value "
        "projections and the last decoder layer",
        symmetric=False, group_size=32, head="8da8w", layers=(("v_proj", "8da8w"),), last_block="8da8w",
    ),
    "8da4w": Recipe(
        "8da4w", 4, True, True, "int8 dynamic activations (per token), int4 weights in groups", group_size=32
    ),
    "8da8w": Recipe("8da8w", 8, False, True, "int8 dynamic activations (per token), int8 weights, one scale per row"),
    "int4": Recipe("int4", 4, True, False, "int4 weights in groups, float activations", group_size=32),
    "int8": Recipe("int8", 8, False, False, "int8 weights, one scale per output row, float activations"),
}  # fmt: skip
DEFAULT_RECIPE = "8da4w-asym"
"""What ``llm export --quantize`` applies when no recipe is named: chosen by perplexity and decode speed
measured on trained checkpoints (docs/QUANTIZATION.md)."""
_SLICE_BYTES = 64 * 1024 * 1024  # float32 bytes of a weight quantized at a time


def recipe_named(name: str) -> Recipe:
    recipe = RECIPES.get(name)
    if recipe is None:
        known = ", ".join(f"{n} ({r.summary})" for n, r in RECIPES.items())
        raise QuantizationError(f"unknown quantization recipe {name!r}; the recipes are {known}")
    return recipe


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
    patterns = _KeptFloat([keep_float] if isinstance(keep_float, str) else list(keep_float))
    made: _Made = {}
    weights = _Weights(chosen, group, made)
    heads = None if chosen.head is None else _weights_of(chosen.head, made)
    tables = None if embeddings is None else _embedding_weights(embeddings, made)
    named = tuple((pattern, _weights_of(name, made)) for pattern, name in chosen.layers)
    last = None if chosen.last_block is None else _weights_of(chosen.last_block, made)
    choice = _Choice(weights, heads, tables, named, last)
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


def _weights_of(name: str, made: _Made) -> _Weights:
    recipe = recipe_named(name)
    return _Weights(recipe, recipe.group_size, made)


EMBEDDING_RECIPES = ("int8", "int4")


def _embedding_weights(name: str, made: _Made) -> _Weights:
    """The weight-only recipe of embedding tables ``name`` names: int8 per row, int4 in groups of 32."""
    if name not in EMBEDDING_RECIPES:
        raise QuantizationError(
            f"unknown embedding quantization {name!r}; give int8 (one scale per row) or int4 (groups of 32)"
        )
    recipe = RECIPES[name]
    return _Weights(recipe, recipe.group_size, made)


class _KeptFloat:
    """The keep_float patterns, and which of them matched a layer."""

    def __init__(self, patterns: list[str]) -> None:
        self.patterns = patterns
        self.matched: set[str] = set()

    def keeps(self, names: list[str]) -> bool:
        """Whether a pattern matches one of the names (a weight, its module, the calling module)."""
        found = [p for p in self.patterns if any(_matches(name, p) for name in names if name)]
        self.matched.update(found)
        return bool(found)

    def unmatched(self) -> list[str]:
        return [p for p in self.patterns if p not in self.matched]


_Quantized = tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]
_Made = dict[tuple[torch.Tensor, int, int | None, bool], _Quantized]


class _Weights:
    """Each float weight's quantized tensors, made once however many methods and layers read it alike:
    ``made`` is shared by a call's recipes, keyed by the weight and how it is quantized."""

    def __init__(self, recipe: Recipe, group_size: int | None, made: _Made) -> None:
        self.recipe, self.group_size = recipe, group_size
        self._made = made
        self._spilled = SpilledTensors()

    def quantized(self, weight: torch.Tensor, where: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """(integers as int8, scales, zero points, group size) of ``weight`` [out, in].

        One weight at a time: a weight stored in another float dtype (a bfloat16 checkpoint's) is
        converted to float32 here, its quantized tensors are spilled to a file as they are made, and
        the pages of a weight mapped from a checkpoint are let go once it is read."""
        key = (weight, self.recipe.weight_bits, self.group_size, self.recipe.symmetric)
        made = self._made.get(key)
        if made is None:
            made = self._made[key] = self._quantized_by_rows(weight, where)
        return made

    def _quantized_by_rows(
        self, weight: torch.Tensor, where: str
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """``weight`` quantized a slice of rows at a time (each row's groups are its own), into
        tensors spilled to a file: torchao's temporaries stay a few times a slice, not the weight."""
        rows = int(weight.shape[0])
        step = max(1, _SLICE_BYTES // max(1, 4 * int(weight[0].numel()))) if weight.dim() else 1
        parts: list[torch.Tensor] = []
        group = 0
        for start in range(0, rows, step):
            qdata, scale, zero_point, group = self._quantize(weight[start : start + step], where)
            if not parts:
                parts = [self._spilled.empty((rows, *t.shape[1:]), t.dtype) for t in (qdata, scale, zero_point)]
            for whole, part in zip(parts, (qdata, scale, zero_point), strict=True):
                whole[start : start + step] = part
                if part.nbytes:
                    release_buffer(whole[start : start + step])
            del qdata, scale, zero_point
            if weight.nbytes:
                release_buffer(weight[start : start + step])
            return_freed_memory()  # torchao's temporaries, a few times the slice
        return parts[0], parts[1], parts[2], group

    def _quantize(self, weight: torch.Tensor, where: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        columns = int(weight.shape[1])
        group = self.group_size or columns
        if columns % group:
            raise QuantizationError(
                f"{where}: group size {group} does not divide its {columns} inputs; choose a group size that "
                "divides the inputs of every layer quantized, or keep this layer in float (keep_float / --keep-float)"
            )
        torchao = torchao_quantization()
        holder = torch.nn.Linear(columns, int(weight.shape[0]), bias=False, device="meta")
        as_float = weight.detach() if weight.dtype == torch.float32 else weight.detach().float()
        holder.weight = torch.nn.Parameter(as_float, requires_grad=False)  # shared, not copied, when float32
        try:
            torchao.quantize_(holder, _torchao_config(torchao, self.recipe, group, columns))
        except Exception as e:
            raise QuantizationError(
                f"{where}: torchao could not quantize it ({type(e).__name__}: {first_line(e)}); keep it in float "
                "(keep_float / --keep-float)"
            ) from e
        quantized: Any = holder.weight  # torchao's IntxUnpackedToInt8Tensor
        return quantized.qdata, quantized.scale, quantized.zero_point, group


def torchao_quantization() -> ModuleType:
    """``torchao.quantization``, imported without the warnings torchao logs about the GPU kernels a
    CPU build cannot load; an ``ImportError`` saying what to install."""
    try:
        with import_noise_quieted():
            return importlib.import_module("torchao.quantization")
    except ImportError as e:
        raise ImportError(
            "quantizing needs torchao: pip install 'torchdelegate[quantize]' (a lowered file runs without it)"
        ) from e


def _torchao_config(torchao: ModuleType, recipe: Recipe, group: int, columns: int) -> Any:
    """torchao's config of ``recipe`` for groups of ``group`` of ``columns`` inputs."""
    dtype = getattr(torch, "int4") if recipe.weight_bits == 4 else torch.int8  # noqa: B009  (typeshed lacks it)
    granularity = torchao.PerGroup(group) if group != columns or recipe.grouped else torchao.PerAxis(0)
    mapping = torchao.MappingType.SYMMETRIC if recipe.symmetric else torchao.MappingType.ASYMMETRIC
    if recipe.dynamic_int8_activation:
        return torchao.Int8DynamicActivationIntxWeightConfig(
            weight_dtype=dtype, weight_granularity=granularity, weight_mapping_type=mapping
        )
    return torchao.IntxWeightOnlyConfig(weight_dtype=dtype, granularity=granularity, mapping_type=mapping)


@dataclass(frozen=True)
class _Choice:
    """The recipes of one call: the layers', the head's (None: the layers'), the tables' (None: kept
    float), those of the layers the recipe names by pattern, and the last block's (None: the layers')."""

    layers: _Weights
    heads: _Weights | None
    tables: _Weights | None
    named: tuple[tuple[str, _Weights], ...] = ()
    last: _Weights | None = None

    def by_structure(self, graph: Graph, layers: list[Node]) -> dict[Node, _Weights]:
        """The layers whose recipe their place decides: the heads', then the last block's."""
        chosen: dict[Node, _Weights] = {}
        if self.last is not None:
            chosen.update(dict.fromkeys(_last_block(layers), self.last))
        if self.heads is not None:
            chosen.update(dict.fromkeys(_output_layers(graph), self.heads))
        return chosen

    def of(self, linear: Node, names: list[str], placed: dict[Node, _Weights]) -> _Weights:
        """The recipe of ``linear``, whose weight, module and caller are ``names``: the first pattern's
        that matches one, else its place's (``by_structure``), else the layers'."""
        for pattern, weights in self.named:
            if any(name and _matches(name, pattern) for name in names):
                return weights
        return placed.get(linear, self.layers)


def _quantized(program: ExportedProgram, method: str, choice: _Choice, keep_float: _KeptFloat) -> ExportedProgram:
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
    node: Node, target: Any, parameters: dict[str, InputSpec], program: ExportedProgram, keep_float: _KeptFloat
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


def _last_block(layers: list[Node]) -> list[Node]:
    """The layers of the last of the numbered blocks most layers sit in (``model.layers.29`` of 30
    decoder layers); none when no module path has a numbered block, or the stack has one block."""
    stacks: dict[str, dict[int, list[Node]]] = {}
    for node in layers:
        numbered = _NUMBERED_BLOCK.match(module_path(node))
        if numbered is not None:
            stacks.setdefault(numbered[1], {}).setdefault(int(numbered[2]), []).append(node)
    if not stacks:
        return []
    blocks = stacks[max(sorted(stacks), key=lambda prefix: len(stacks[prefix]))]
    return blocks[max(blocks)] if len(blocks) > 1 else []


_NUMBERED_BLOCK = re.compile(r"^(.*?)\.(\d+)(?:\.|$)")


def _output_layers(graph: Graph) -> set[Node]:
    """The linear layers whose output is the graph's output through steps of one tensor input each
    (reshapes, slices, casts, element-wise functions): an LLM's head."""
    found: set[Node] = set()
    pending = [a for a in graph.output_node().all_input_nodes]
    seen: set[Node] = set()
    while pending:
        node = pending.pop()
        if node in seen or node.op != "call_function":
            continue
        seen.add(node)
        if node.target is _aten.linear.default:
            found.add(node)
            continue
        tensors = [a for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]
        if len(tensors) == 1:
            pending.append(tensors[0])
    return found


def _is_float32(node: Node) -> bool:
    value = node.meta.get("val")
    return isinstance(value, torch.Tensor) and value.dtype == torch.float32


def _matches(name: str, pattern: str) -> bool:
    """``pattern`` matches the whole dotted name or its last components (``lm_head`` matches ``model.lm_head``)."""
    return fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name, f"*.{pattern}")
