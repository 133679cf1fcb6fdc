"""Metadata checks that export proved are dropped by ``to_edge``, so no delegate returns a value
only to have it checked; a check the traced values do not prove stays."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import torchdelegate as td
from torchdelegate.backends.reference import ReferencePartitioner
from torchdelegate.lowering.metadata_checks import drop_proven_checks

CHECK = torch.ops.aten._assert_tensor_metadata.default


class CastThatChangesNothing(torch.nn.Module):
    """``.to(float32)`` of a float32 value: decomposition leaves a metadata check on it."""

    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Linear(4, 4)
        self.second = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x).to(torch.float32).relu())


def _checks(program: torch.export.ExportedProgram) -> list[torch.fx.Node]:
    return [n for n in program.graph.nodes if n.target is CHECK]


def test_a_check_export_proved_is_dropped_and_the_delegate_returns_only_what_the_program_needs(tmp_path: Path) -> None:
    x = torch.randn(2, 4)
    model = CastThatChangesNothing()
    exported = torch.export.export(model, (x,))
    assert _checks(exported.run_decompositions()), "the model no longer makes the check this test is about"
    edge = td.to_edge(exported)
    assert not _checks(edge.exported_program())
    lowered = edge.to_backend(ReferencePartitioner())
    (call,) = [n for n in lowered.exported_program().graph.nodes if n.target is td.call_delegate]
    assert len(call.meta["val"]) == 1  # the program's one output, nothing returned only to be checked
    lowered.save(tmp_path / "cast.tdp")
    with td.load(tmp_path / "cast.tdp") as program:
        torch.testing.assert_close(program.run("forward", x), model(x))


@pytest.mark.parametrize(
    ("argument", "value"),
    [("dtype", torch.float64), ("size", [3, 4]), ("device", torch.device("meta"))],
    ids=["another dtype", "other sizes", "another device"],
)
def test_a_check_the_traced_values_do_not_prove_stays(argument: str, value: object) -> None:
    program = torch.export.export(CastThatChangesNothing(), (torch.randn(2, 4),)).run_decompositions()
    (check,) = _checks(program)
    names = ("a", "size", "stride", "dtype")
    if argument in names:
        arguments = list(check.args) + [None] * (len(names) - len(check.args))
        arguments[names.index(argument)] = value
        check.args = tuple(arguments)
    else:
        check.kwargs = {**check.kwargs, argument: value}
    assert drop_proven_checks(program) == 0
    assert len(_checks(program)) == 1
