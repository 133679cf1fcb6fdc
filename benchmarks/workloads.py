"""The workloads both sides of a comparison run: the partition rule and the two methods.

The rule is framework-independent and linear: a partition is a maximal run of consecutive
supported computations in graph order (a run of a topological order cannot make a cycle).
ExecuTorch's edge dialect names views ``view_copy``/``permute_copy``; both spellings count.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Mapping
from typing import Any

import torch

SUPPORTED = frozenset(
    {
        "aten::linear",
        "aten::addmm",
        "aten::mm",
        "aten::permute",
        "aten::permute_copy",
        "aten::view",
        "aten::view_copy",
        "aten::add.Tensor",
        "aten::mul.Tensor",
        "aten::gelu",
    }
)
TAG_KEY = "delegation_tag"  # the node.meta key both frameworks read
METHODS = {"prefill": 8, "decode": 1}  # method -> tokens per call


def op_name(target: Any) -> str:
    """``aten::add.Tensor`` (``aten::view`` for a default overload), for an ATen overload and
    for ExecuTorch's edge wrapper of one."""
    name = getattr(target, "name", None)
    return name() if callable(name) else str(target)


def tag_runs(graph: torch.fx.Graph) -> list[str]:
    """Tag each maximal run of supported computations; the tags, in graph order."""
    tags: list[str] = []
    in_run = False
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        supported = op_name(node.target) in SUPPORTED
        if supported and not in_run:
            tags.append(f"run{len(tags):05d}")
        if supported:
            node.meta[TAG_KEY] = tags[-1]
        in_run = supported
    return tags


def method_inputs(width: int) -> dict[str, tuple[torch.Tensor]]:
    """One input per method, seeded: prefill takes 8 tokens, decode one."""
    generator = torch.Generator().manual_seed(1)
    return {m: (torch.randn(1, tokens, width, generator=generator),) for m, tokens in METHODS.items()}


def weight_bytes(model: torch.nn.Module) -> int:
    """The bytes of the model's distinct tensors (parameters and buffers)."""
    unique = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in model.state_dict().values()}
    return sum(unique.values())


def side_parser(description: str) -> argparse.ArgumentParser:
    """The command line both sides take: a mode, the stack's shape, files and timing."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["lower", "save", "run"])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--out")
    parser.add_argument("--file")
    parser.add_argument("--expected", help="torch.save'd {method: eager output}")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    return parser


def run_side(parser: argparse.ArgumentParser, modes: Mapping[str, Callable[[argparse.Namespace], Any]]) -> None:
    """Do the measurement the command line asks for; print it as JSON on the last line."""
    args = parser.parse_args()
    print(json.dumps(modes[args.mode](args)))
