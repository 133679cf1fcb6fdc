"""The compile cache's key: equal for a program exported again (strict or not, other weights),
different wherever a backend could compile differently."""

from __future__ import annotations

import pytest
import torch

import torchdelegate as td
from torchdelegate.compile.key_form import key_form
from torchdelegate.compile.unit_form import document_key


class Scaled(torch.nn.Module):
    def __init__(self, scale: float = 2.0, width: int = 8, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.linear = torch.nn.Linear(width, width)
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(self.linear(x) * self.scale, approximate="tanh")


def _key(module: torch.nn.Module, x: torch.Tensor, strict: bool = True, dynamic: bool = False) -> str:
    shapes = ({0: torch.export.Dim("rows", max=64)},) if dynamic else None
    program = td.to_edge(torch.export.export(module, (x,), strict=strict, dynamic_shapes=shapes)).exported_program()
    return document_key(key_form(program))


X = torch.randn(4, 8)


def test_the_key_is_the_same_for_the_same_architecture_exported_again() -> None:
    assert _key(Scaled(), X) == _key(Scaled(), X)
    assert _key(Scaled(seed=0), X) == _key(Scaled(seed=1), X)  # weights are the digests' concern
    assert _key(Scaled(), X, strict=False) == _key(Scaled(), X, strict=False)  # module calls keyed by id()


@pytest.mark.parametrize(
    ("other", "other_input"),
    [
        (Scaled(scale=3.0), X),  # a constant argument
        (Scaled(), X[:2]),  # a shape
        (Scaled().double(), X.double()),  # a dtype
        (Scaled(width=16), torch.randn(4, 16)),  # a weight's shape
    ],
    ids=["constant", "input shape", "dtype", "weight shape"],
)
def test_the_key_differs_where_a_backend_could_compile_differently(
    other: torch.nn.Module, other_input: torch.Tensor
) -> None:
    assert _key(Scaled(), X) != _key(other, other_input)


def test_the_key_covers_dynamic_shapes_and_their_ranges() -> None:
    assert _key(Scaled(), X, dynamic=True) != _key(Scaled(), X)
    assert _key(Scaled(), X, dynamic=True) == _key(Scaled(), torch.randn(5, 8), dynamic=True)


def test_the_key_covers_the_graphs_of_control_flow() -> None:
    class Branching(torch.nn.Module):
        def __init__(self, other: float) -> None:
            super().__init__()
            self.other = other

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.cond(x.sum() > 0, lambda x: x + 1, lambda x: x * self.other, (x,))

    assert _key(Branching(2.0), X) == _key(Branching(2.0), X)
    assert _key(Branching(2.0), X) != _key(Branching(3.0), X)
