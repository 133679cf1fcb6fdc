"""Which recipe each layer of one ``quantize`` call takes (:class:`RecipeChoice`), and which layers stay in
float (:class:`KeptFloat`).

A layer takes the recipe of the first pattern the recipe names that matches its weight, its module or
its caller (``v_proj``); else its place's: a head (a layer whose output is the program's, through
reshapes and element-wise steps alone), then the last of the numbered blocks most layers sit in (an
LLM's last decoder layer); else the call's recipe. ``keep_float`` patterns match the same names, and
remember which of them matched, so that ``quantize`` can warn of those that matched nothing.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass

import torch
from torch.fx import Graph, Node

from torchdelegate.partition.modules import module_path
from torchdelegate.quantization.torchao_weights import QuantizedWeights

_aten = torch.ops.aten


class KeptFloat:
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


@dataclass(frozen=True)
class RecipeChoice:
    """The recipes of one call: the layers', the head's (None: the layers'), the tables' (None: kept
    float), those of the layers the recipe names by pattern, and the last block's (None: the layers')."""

    layers: QuantizedWeights
    heads: QuantizedWeights | None
    tables: QuantizedWeights | None
    named: tuple[tuple[str, QuantizedWeights], ...] = ()
    last: QuantizedWeights | None = None

    def by_structure(self, graph: Graph, layers: list[Node]) -> dict[Node, QuantizedWeights]:
        """The layers whose recipe their place decides: the heads', then the last block's."""
        chosen: dict[Node, QuantizedWeights] = {}
        if self.last is not None:
            chosen.update(dict.fromkeys(_last_block(layers), self.last))
        if self.heads is not None:
            chosen.update(dict.fromkeys(_output_layers(graph), self.heads))
        return chosen

    def of(self, linear: Node, names: list[str], placed: dict[Node, QuantizedWeights]) -> QuantizedWeights:
        """The recipe of ``linear``, whose weight, module and caller are ``names``: the first pattern's
        that matches one, else its place's (``by_structure``), else the layers'."""
        for pattern, weights in self.named:
            if any(name and _matches(name, pattern) for name in names):
                return weights
        return placed.get(linear, self.layers)


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


def _matches(name: str, pattern: str) -> bool:
    """``pattern`` matches the whole dotted name or its last components (``lm_head`` matches ``model.lm_head``)."""
    return fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name, f"*.{pattern}")
