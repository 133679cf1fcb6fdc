"""The quantization recipes by name: what each does to a linear layer's weight (and activation), the
default one, and those embedding tables take.

``quantize`` (``recipes.py``) and the command (``--quantize``) name recipes from this table; which
layer of a program takes which recipe is ``layer_choice.py``'s, and quantizing a weight by one is
``torchao_weights.py``'s. Nothing here imports torch or torchao.
"""

from __future__ import annotations

from dataclasses import dataclass

from torchdelegate.errors import QuantizationError


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


def recipe_named(name: str) -> Recipe:
    recipe = RECIPES.get(name)
    if recipe is None:
        known = ", ".join(f"{n} ({r.summary})" for n, r in RECIPES.items())
        raise QuantizationError(f"unknown quantization recipe {name!r}; the recipes are {known}")
    return recipe


EMBEDDING_RECIPES = ("int8", "int4")
