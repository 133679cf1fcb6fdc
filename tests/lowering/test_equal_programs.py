"""Methods whose programs are equal are decomposed and quantized once, each keeping a graph of its own."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from models import KVCache, TwoLinears

from torchdelegate import to_edge, to_edge_transform_and_lower
from torchdelegate.exported.structural_copy import copy_program
from torchdelegate.lowering.equal_programs import first_equal
from torchdelegate.quantization.recipes import quantize


@pytest.fixture
def decompositions(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The number of nodes of each program torch's run_decompositions was given, in order."""
    seen: list[int] = []
    original = torch.export.ExportedProgram.run_decompositions

    def counted(self: torch.export.ExportedProgram, *args: Any, **kwargs: Any) -> torch.export.ExportedProgram:
        seen.append(len(self.graph.nodes))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.export.ExportedProgram, "run_decompositions", counted)
    return seen


def test_a_program_and_its_copy_decompose_once_and_stay_apart(decompositions: list[int]) -> None:
    model = KVCache()
    prefill = torch.export.export(model, (torch.randn(1, 4), torch.tensor([0])))
    edge = to_edge({"prefill": prefill, "decode": copy_program(prefill)})
    assert len(decompositions) == 1
    a, b = edge.exported_program("prefill"), edge.exported_program("decode")
    assert a.graph is not b.graph and a.graph_module is not b.graph_module
    assert all(a.state_dict[k] is b.state_dict[k] for k in a.state_dict)  # the written cache too: one state
    assert [n.name for n in a.graph.nodes] == [n.name for n in b.graph.nodes]
    reference = KVCache()
    reference.load_state_dict(model.state_dict())
    for method, position in (("prefill", 0), ("decode", 1)):
        x = torch.randn(1, 4)
        torch.testing.assert_close(
            edge.exported_program(method).module()(x, torch.tensor([position])), reference(x, torch.tensor([position]))
        )


def test_equal_graphs_over_other_tensors_are_decomposed_each(decompositions: list[int]) -> None:
    first, second = TwoLinears(), TwoLinears()
    x = torch.randn(2, 4)
    edge = to_edge({"a": torch.export.export(first, (x,)), "b": torch.export.export(second, (x,))})
    assert len(decompositions) == 2
    torch.testing.assert_close(edge.exported_program("a").module()(x), first(x))
    torch.testing.assert_close(edge.exported_program("b").module()(x), second(x))


def test_programs_of_other_shapes_are_not_equal() -> None:
    model = TwoLinears()
    small = torch.export.export(model, (torch.randn(2, 4),))
    large = torch.export.export(model, (torch.randn(8, 4),))
    assert first_equal({"small": small, "large": large, "again": copy_program(small)}) == {
        "small": "small",
        "large": "large",
        "again": "small",
    }


def test_methods_lowered_by_other_partitioners_are_decomposed_each(decompositions: list[int]) -> None:
    from test_edge_program_manager import LinearKeeper

    model = TwoLinears()
    program = torch.export.export(model, (torch.randn(2, 4),))
    keeper = LinearKeeper(claim=True)
    lowered = to_edge_transform_and_lower(
        {"a": program, "b": copy_program(program)}, partitioner={"a": [keeper], "b": [LinearKeeper(claim=True)]}
    )
    assert len(decompositions) == 2
    x = torch.randn(2, 4)
    for method in ("a", "b"):
        torch.testing.assert_close(lowered.exported_program(method).module()(x), model(x))


def test_quantize_rewrites_equal_methods_once_into_graphs_of_their_own(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torchao")
    from torchdelegate.quantization import recipes

    rewritten: list[str] = []
    original = recipes._quantized

    def counted(program: torch.export.ExportedProgram, method: str, *args: Any) -> torch.export.ExportedProgram:
        rewritten.append(method)
        return original(program, method, *args)

    monkeypatch.setattr(recipes, "_quantized", counted)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    program = torch.export.export(model, (torch.randn(2, 64),))
    quantized = quantize({"prefill": program, "decode": copy_program(program)}, "8da4w")
    assert rewritten == ["prefill"]
    a, b = quantized["prefill"], quantized["decode"]
    assert a.graph is not b.graph
    assert [str(n.target) for n in a.graph.nodes] == [str(n.target) for n in b.graph.nodes]
    assert all(a.state_dict[k] is b.state_dict[k] for k in a.state_dict)
    x = torch.randn(2, 64)
    torch.testing.assert_close(a.module()(x), b.module()(x))
    assert not any("quantize" in str(n.target) for n in program.graph.nodes)  # the caller's program as it was
