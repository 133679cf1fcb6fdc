"""Errors of docs/ERRORS.md that no behaviour test triggers elsewhere: each raised, its message checked."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from models import TwoLinears, export

import torchdelegate as td
from torchdelegate import (
    BackendDetails,
    BackendRegistrationError,
    DelegateExecutionError,
    DelegationSpec,
    FormatError,
    NamedDataStore,
    SerializationError,
)
from torchdelegate.backends.reference import ReferenceBackend, ReferencePartitioner


def _saved(tmp_path: Path, backend_id: str) -> Path:
    partitioner = ReferencePartitioner()
    partitioner.spec = DelegationSpec(backend_id)
    td.to_edge(export(TwoLinears(), torch.randn(2, 4))).to_backend(partitioner).save(tmp_path / "m.tdp")
    return tmp_path / "m.tdp"


def test_an_empty_backend_id_is_refused_when_the_class_is_defined() -> None:
    with pytest.raises(BackendRegistrationError, match=r"\.backend_id must be a non-empty str, got ''"):

        class Nameless(BackendDetails):
            backend_id = ""


class FailingInit(ReferenceBackend):
    backend_id = "TestFailingInit"

    @classmethod
    def init(cls, processed: Any, compile_specs: Any, named_data: Any) -> Any:
        raise OSError("device lost")


class WrongOutputCount(ReferenceBackend):
    backend_id = "TestWrongOutputCount"

    @classmethod
    def execute(cls, handle: Any, inputs: list[Any]) -> list[torch.Tensor]:
        return [*handle(inputs), torch.zeros(1)]


def test_a_backend_init_failing_names_the_backend_and_delegate(tmp_path: Path) -> None:
    with td.load(_saved(tmp_path, FailingInit.backend_id)) as program:
        with pytest.raises(
            DelegateExecutionError, match=r"backend 'TestFailingInit', delegate .*init failed: device lost"
        ):
            program.run("forward", torch.randn(2, 4))


def test_execute_returning_the_wrong_number_of_outputs_is_refused(tmp_path: Path) -> None:
    with td.load(_saved(tmp_path, WrongOutputCount.backend_id)) as program:
        with pytest.raises(
            DelegateExecutionError, match=r"execute\(\) returned 2 values; expected a list of 1 outputs"
        ):
            program.run("forward", torch.randn(2, 4))


def test_external_data_cannot_be_the_program_file_itself(tmp_path: Path) -> None:
    lowered = td.to_edge(export(TwoLinears(), torch.randn(2, 4))).to_backend(ReferencePartitioner())
    with pytest.raises(SerializationError, match=r"is the program file itself; choose another"):
        lowered.save(tmp_path / "m.tdp", external_data_path=tmp_path / "m.tdp")


def test_a_directory_is_not_a_file_to_load(tmp_path: Path) -> None:
    with pytest.raises(FormatError, match=r"cannot read the program file"):
        td.load(tmp_path)


def test_named_data_must_live_on_the_cpu() -> None:
    with pytest.raises(ValueError, match=r"named data must live on the CPU, got a tensor on meta"):
        NamedDataStore().add_named_data("w", torch.empty(2, device="meta"))


def test_a_saved_graph_delegate_call_runs_only_through_load() -> None:
    with pytest.raises(RuntimeError, match=r"is a placeholder in saved graphs; load the file with"):
        torch.ops.torchdelegate.delegate_call(0, [torch.zeros(1)], [])


def test_two_methods_with_different_tensors_under_one_name_cannot_share_a_file(tmp_path: Path) -> None:
    programs = {"a": export(TwoLinears(), torch.randn(2, 4)), "b": export(TwoLinears(), torch.randn(2, 4))}
    with pytest.raises(SerializationError, match=r"methods 'a' and 'b' hold different values for '\w+\.weight'"):
        td.to_edge(programs).save(tmp_path / "m.tdp")


def test_a_method_must_be_an_exported_program() -> None:
    with pytest.raises(TypeError, match=r"method 'forward' must be a torch.export.ExportedProgram, got TwoLinears"):
        td.to_edge({"forward": TwoLinears()})  # type: ignore[dict-item]


def test_a_transform_pass_must_return_a_program_or_none() -> None:
    edge = td.to_edge(export(TwoLinears(), torch.randn(2, 4)))
    with pytest.raises(TypeError, match=r"transform: pass <lambda> returned int for method 'forward'"):
        edge.transform([lambda program: 5])
