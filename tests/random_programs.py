"""Random programs and random partitioners for the differential property tests.

A program is a recipe: inputs, parameters and buffers, then 5–60 steps, each an op over
earlier values (pointers are taken modulo the values so far, so any integers make a valid
recipe). Every value is a float32 [4, 8] tensor, so every op composes with every other.
``RecipeModule`` interprets a recipe in ``forward``; torch.export traces it into a plain
core-ATen graph. Inputs (keyword arguments) and state are named from pools of awkward names:
Python builtins and keywords, the names lowering generates, dotted paths, digits and unicode.

Partitioners draw their choices up front (lists of integers), so that one partitioner
tags the same graph the same way every time: a lowering can be repeated byte for byte.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from backends_for_tests import TorchExportBackend
from hypothesis import strategies as st
from torch.export import ExportedProgram

from torchdelegate import (
    DELEGATION_TAG,
    DelegationSpec,
    Partitioner,
    PartitionResult,
    tag_constant_data,
    tag_mutated_buffers,
)

ROWS, COLUMNS = 4, 8
BACKENDS = ("reference", TorchExportBackend.backend_id)


def _cat_split(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    left, right = torch.cat([a, b], dim=1).split(COLUMNS, dim=1)
    return left * 0.5 + right


UNARY: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu": torch.relu,
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
    "neg": torch.neg,
    "abs": torch.abs,
    "exp": lambda x: x.clamp(-4, 4).exp(),
    "scale": lambda x: x * 0.5 + 1,
    "softmax": lambda x: x.softmax(-1),
    "center": lambda x: x - x.mean(-1, keepdim=True),
    "column_sum": lambda x: x + x.sum(0, keepdim=True),
    "amax": lambda x: x - x.amax(-1, keepdim=True),
    "transpose": lambda x: x.reshape(COLUMNS, ROWS).transpose(0, 1).reshape(ROWS, COLUMNS),
    "permute_view": lambda x: x.t().contiguous().view(ROWS, COLUMNS),
    "cumsum": lambda x: x.cumsum(1) * 0.1,
}
BINARY: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "add": torch.add,
    "mul": torch.mul,
    "sub": torch.sub,
    "maximum": torch.maximum,
    "where": lambda a, b: torch.where(a > 0, a, b),
    "cat_split": _cat_split,
    "gram": lambda a, b: (a @ b.t()) @ a * 0.1,
}
OTHER = ("matmul_weight", "update_buffer", "cond")
OPS = (*UNARY, *BINARY, *OTHER)

# The first of each pool is plain, so that hypothesis shrinks toward it.
INPUT_NAMES = ("x", "input", "list", "type", "id", "output", "getitem", "call_delegate", "lowered_module_0", "é")
STATE_NAMES = (
    "w",
    "input",
    "lambda",
    "id",
    "output",
    "getitem",
    "call_delegate",
    "lowered_module_0",
    "block.input",
    "block.lambda",
    "layers.0",
    "poids_é",
)


@dataclass(frozen=True)
class Recipe:
    inputs: int
    weights: int
    buffers: int
    steps: tuple[tuple[str, int, int], ...]  # (op, pointer, pointer)
    outputs: tuple[int, ...]  # extra pointers returned beside the last value
    seed: int
    names: tuple[str, ...] = ()  # the inputs' names, then the weights', then the buffers'

    def input_names(self) -> tuple[str, ...]:
        return self._names(INPUT_NAMES, 0, self.inputs)

    def weight_names(self) -> tuple[str, ...]:
        return self._names(STATE_NAMES, self.inputs, self.weights)

    def buffer_names(self) -> tuple[str, ...]:
        return self._names(STATE_NAMES, self.inputs + self.weights, self.buffers)

    def _names(self, pool: tuple[str, ...], start: int, count: int) -> tuple[str, ...]:
        drawn = self.names[start : start + count]
        return drawn if len(drawn) == count else tuple(f"{pool[0]}{i}" for i in range(count))

    def example_inputs(self) -> dict[str, torch.Tensor]:
        """The inputs, as keyword arguments in order."""
        generator = torch.Generator().manual_seed(self.seed)
        return {name: torch.randn(ROWS, COLUMNS, generator=generator) for name in self.input_names()}


def _register(root: torch.nn.Module, path: str, value: torch.Tensor, parameter: bool) -> None:
    """Register ``value`` under a dotted ``path``, making the modules on the way."""
    *parents, leaf = path.split(".")
    module = root
    for atom in parents:
        if atom not in module._modules:
            module.add_module(atom, torch.nn.Module())
        module = module._modules[atom]  # type: ignore[assignment]
    if parameter:
        module.register_parameter(leaf, torch.nn.Parameter(value))
    else:
        module.register_buffer(leaf, value)


def _state(root: torch.nn.Module, path: str) -> torch.Tensor:
    value: object = root
    for atom in path.split("."):
        value = getattr(value, atom)
    assert isinstance(value, torch.Tensor)
    return value


class RecipeModule(torch.nn.Module):
    """Runs a recipe; returns the last value, the extra outputs, and each buffer read after its update."""

    def __init__(self, recipe: Recipe) -> None:
        super().__init__()
        self.recipe = recipe
        generator = torch.Generator().manual_seed(recipe.seed + 1)
        self.weight_names, self.buffer_names = recipe.weight_names(), recipe.buffer_names()
        for name in self.weight_names:
            _register(self, name, torch.randn(COLUMNS, COLUMNS, generator=generator) * 0.3, parameter=True)
        for name in self.buffer_names:
            _register(self, name, torch.randn(COLUMNS, generator=generator), parameter=False)

    def forward(self, **inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        values = list(inputs.values())
        updated: list[int] = []
        for op, first, second in self.recipe.steps:
            a, b = values[first % len(values)], values[second % len(values)]
            values.append(self._step(op, a, b, second, updated))
        chosen = dict.fromkeys([len(values) - 1, *(p % len(values) for p in self.recipe.outputs)])
        reads = [_state(self, self.buffer_names[i]) * 1.0 for i in sorted(set(updated))]
        return (*(values[i] for i in chosen), *reads)

    def _step(self, op: str, a: torch.Tensor, b: torch.Tensor, choice: int, updated: list[int]) -> torch.Tensor:
        if op in UNARY:
            return UNARY[op](a)
        if op in BINARY:
            return BINARY[op](a, b)
        if op == "matmul_weight" and self.recipe.weights:
            return a @ _state(self, self.weight_names[choice % self.recipe.weights])
        if op == "update_buffer" and self.recipe.buffers:
            index = choice % self.recipe.buffers
            buffer = _state(self, self.buffer_names[index])
            buffer.add_(a.mean(0) * 0.1)
            updated.append(index)
            return a + buffer
        if op == "cond":
            return torch.cond(a.sum() > 0, lambda x, y: (x * y).sin(), lambda x, y: x.cos() - y, (a, b))
        return a * 0.9 + 0.1  # an op that needs a weight or a buffer the recipe has not got


@st.composite
def recipes(draw: st.DrawFn, max_steps: int = 60, with_cond: bool = True) -> Recipe:
    ops = OPS if with_cond else tuple(op for op in OPS if op != "cond")
    pointer = st.integers(0, 1000)
    steps = draw(st.lists(st.tuples(st.sampled_from(ops), pointer, pointer), min_size=5, max_size=max_steps))
    inputs, weights, buffers = draw(st.integers(1, 3)), draw(st.integers(0, 2)), draw(st.integers(0, 2))
    input_names = draw(st.lists(st.sampled_from(INPUT_NAMES), min_size=inputs, max_size=inputs, unique=True))
    state = weights + buffers
    state_names = draw(st.lists(st.sampled_from(STATE_NAMES), min_size=state, max_size=state, unique=True))
    return Recipe(
        inputs=inputs,
        weights=weights,
        buffers=buffers,
        steps=tuple(steps),
        outputs=tuple(draw(st.lists(pointer, max_size=2))),
        seed=draw(st.integers(0, 2**16)),
        names=(*input_names, *state_names),
    )


class SegmentPartitioner(Partitioner):
    """Cuts the computations, in graph order, into segments; each goes to a backend or stays.

    A segment of a topological order cannot make a cycle, so every such tagging is valid.
    ``cuts[i]`` ends a segment after computation i; ``owners[k]`` says who takes segment k
    (0: nobody; otherwise a backend of BACKENDS).
    """

    def __init__(self, cuts: Sequence[bool], owners: Sequence[int], tag_state: bool) -> None:
        self.cuts, self.owners, self.tag_state = cuts, owners, tag_state

    def __repr__(self) -> str:
        return f"SegmentPartitioner({list(self.cuts)}, {list(self.owners)}, {self.tag_state})"

    def partition(self, exported_program: ExportedProgram) -> PartitionResult:
        tags: dict[str, DelegationSpec] = {}
        segment = 0
        computations = [n for n in exported_program.graph.nodes if n.op == "call_function"]
        for index, node in enumerate(computations):
            owner = self.owners[segment % len(self.owners)]
            if owner:
                tag = f"segment{segment}"
                node.meta[DELEGATION_TAG] = tag
                tags[tag] = DelegationSpec(BACKENDS[owner % len(BACKENDS)])
            if self.cuts[index % len(self.cuts)]:
                segment += 1
        if self.tag_state:
            tag_constant_data(exported_program)
            tag_mutated_buffers(exported_program)
        return PartitionResult(exported_program, tags)


class ScatterPartitioner(Partitioner):
    """Gives each computation an arbitrary tag (or none): often not a valid partition.

    Lowering must then either succeed or refuse with one of the documented errors.
    """

    def __init__(self, choices: Sequence[int]) -> None:
        self.choices = choices

    def __repr__(self) -> str:
        return f"ScatterPartitioner({list(self.choices)})"

    def partition(self, exported_program: ExportedProgram) -> PartitionResult:
        tags: dict[str, DelegationSpec] = {}
        computations = [n for n in exported_program.graph.nodes if n.op == "call_function"]
        for index, node in enumerate(computations):
            choice = self.choices[index % len(self.choices)]
            if choice:
                node.meta[DELEGATION_TAG] = tag = f"scatter{choice}"
                tags[tag] = DelegationSpec(BACKENDS[choice % len(BACKENDS)])
        return PartitionResult(exported_program, tags)


def capability_partitioner(claims: Sequence[int]) -> Partitioner:
    """torchdelegate's CapabilityPartitioner over both backends, each claiming a random set of ops.

    ``claims[i]`` says which backends claim the i-th op name (in sorted order): bit 0 the
    reference backend, bit 1 the test backend.
    """
    from torchdelegate.partition.capability import CapabilityPartitioner

    def supported_by(bit: int) -> Callable[[torch.fx.Node], bool]:
        names: dict[str, bool] = {}

        def support(node: torch.fx.Node) -> bool:
            name = str(node.target)
            if name not in names:
                names[name] = bool(claims[sum(map(ord, name)) % len(claims)] & bit)
            return names[name]

        return support

    return CapabilityPartitioner(
        [(supported_by(1), DelegationSpec(BACKENDS[0])), (supported_by(2), DelegationSpec(BACKENDS[1]))]
    )


@st.composite
def partitioners(draw: st.DrawFn) -> tuple[str, Partitioner]:
    kind = draw(st.sampled_from(["segments", "scatter", "capability"]))
    if kind == "segments":
        cuts = draw(st.lists(st.booleans(), min_size=1, max_size=80))
        owners = draw(st.lists(st.sampled_from([1, 2, 0]), min_size=1, max_size=20))  # shrinks toward delegating
        return kind, SegmentPartitioner(cuts, owners, draw(st.booleans()))
    if kind == "scatter":
        return kind, ScatterPartitioner(draw(st.lists(st.integers(0, 3), min_size=1, max_size=80)))
    return kind, capability_partitioner(draw(st.lists(st.integers(0, 3), min_size=1, max_size=16)))
