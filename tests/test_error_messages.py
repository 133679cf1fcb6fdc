"""Errors of docs/ERRORS.md that no behaviour test triggers elsewhere: each raised, its message checked."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from backends_for_tests import CompileOnlyBackend, FunctionPartitioner, TorchExportBackend
from models import TwoLinears, export
from programs import assert_unchanged, snapshot

import torchdelegate as td
from torchdelegate import (
    BackendDetails,
    BackendRegistrationError,
    BackendUnavailableError,
    DelegateExecutionError,
    DelegationSpec,
    FormatError,
    NamedDataStore,
    PreprocessError,
    PreprocessResult,
    SerializationError,
)
from torchdelegate.backends.reference import ReferenceBackend, ReferencePartitioner
from torchdelegate.partition.proposed import backend_support


def _lowered_on(backend_id: str) -> td.EdgeProgramManager:
    partitioner = ReferencePartitioner()
    partitioner.spec = DelegationSpec(backend_id)
    return td.to_edge(export(TwoLinears(), torch.randn(2, 4))).to_backend(partitioner)


def _saved(tmp_path: Path, backend_id: str) -> Path:
    _lowered_on(backend_id).save(tmp_path / "m.tdp")
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


def test_a_saved_graph_call_delegate_runs_only_through_load() -> None:
    with pytest.raises(RuntimeError, match=r"is a placeholder in saved graphs; load the file with"):
        torch.ops.torchdelegate.call_delegate(0, [torch.zeros(1)], [])


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


class WrongDebugHandles(TorchExportBackend):
    backend_id = "TestWrongDebugHandles"

    @staticmethod
    def preprocess(edge_program: Any, compile_specs: Any) -> PreprocessResult:
        result = TorchExportBackend.preprocess(edge_program, compile_specs)
        return PreprocessResult(result.processed_bytes, {"node": object()})


class OverAligned(TorchExportBackend):
    backend_id = "TestOverAligned"

    @staticmethod
    def preprocess(edge_program: Any, compile_specs: Any) -> PreprocessResult:
        store = NamedDataStore()
        store.add_named_data("page", b"\0" * 8, alignment=1 << 17)
        result = TorchExportBackend.preprocess(edge_program, compile_specs)
        return PreprocessResult(result.processed_bytes, None, store.get_named_data_store_output())


def test_a_debug_handle_map_must_hold_json_values(tmp_path: Path) -> None:
    lowered = _lowered_on(WrongDebugHandles.backend_id)
    with pytest.raises(SerializationError, match=r"on 'TestWrongDebugHandles': debug_handle_map holds <object"):
        lowered.save(tmp_path / "m.tdp")


def test_named_data_alignment_is_bounded_by_the_format(tmp_path: Path) -> None:
    lowered = _lowered_on(OverAligned.backend_id)
    with pytest.raises(SerializationError, match=r"named data 'page' asks for alignment 131072; files support at most"):
        lowered.save(tmp_path / "m.tdp")


class ScaledByItsSum(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * x.sum().item() + 1


def _tag(op: Any, backend_id: str) -> FunctionPartitioner:
    return FunctionPartitioner(lambda node: "t" if node.target == op else None, backend_id)


def test_a_delegate_taking_a_float_cannot_be_saved(tmp_path: Path) -> None:
    program = td.to_edge(export(ScaledByItsSum(), torch.randn(3)))
    lowered = program.to_backend(_tag(torch.ops.aten.mul.Tensor, CompileOnlyBackend.backend_id))
    with pytest.raises(
        SerializationError,
        match=r"delegate 'forward:t' on 'TestCompileOnly' takes _local_scalar_dense \(SymFloat\); "
        "a saved delegate can take only tensors and integer sizes",
    ):
        lowered.save(tmp_path / "m.tdp")


def test_a_delegate_returning_a_float_cannot_be_saved(tmp_path: Path) -> None:
    program = td.to_edge(export(ScaledByItsSum(), torch.randn(3)))
    lowered = program.to_backend(_tag(torch.ops.aten._local_scalar_dense.default, CompileOnlyBackend.backend_id))
    with pytest.raises(SerializationError, match=r"returns a non-tensor value; a saved delegate can return only"):
        lowered.save(tmp_path / "m.tdp")


def test_torch_exports_serializer_failing_names_the_partition() -> None:
    program = td.to_edge(export(ScaledByItsSum(), torch.randn(3)))
    with pytest.raises(PreprocessError) as info:
        program.to_backend(_tag(torch.ops.aten.mul.Tensor, ReferenceBackend.backend_id))
    assert isinstance(info.value.__cause__, SerializationError)
    assert str(info.value.__cause__).startswith(
        "partition 't' of method 'forward': torch.export's serializer failed: "
        "Failed serializing node _local_scalar_dense"
    )


def test_a_pass_that_breaks_the_program_is_named() -> None:
    def plus(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a + b

    def call_plus(program: torch.export.ExportedProgram) -> None:
        for node in program.graph.nodes:
            if node.target == torch.ops.aten.add.Tensor:
                node.target = plus

    class AddOne(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + 1

    edge = td.to_edge(export(AddOne(), torch.randn(2)))
    before = snapshot(edge.exported_program())
    with pytest.raises(
        ValueError, match=r"transform: pass call_plus made method 'forward' an invalid program \(SpecViolationError: "
    ):
        edge.transform([call_plus])
    assert_unchanged(edge.exported_program(), before)


def test_a_dtype_the_format_does_not_store_is_refused_naming_the_tensor(tmp_path: Path) -> None:
    class Scaled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("scale", torch.zeros(2, dtype=torch.float8_e4m3fnuz))

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x + 1, self.scale

    with pytest.raises(
        SerializationError,
        match=r"method 'forward', 'scale': a torch.float8_e4m3fnuz torch.strided tensor cannot be stored; "
        "the format stores dense tensors of float64",
    ):
        td.to_edge(export(Scaled(), torch.randn(2))).save(tmp_path / "m.tdp")


def test_state_a_pass_made_a_python_number_is_refused(tmp_path: Path) -> None:
    class Offset(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.offset = torch.ones(2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.offset

    def to_number(program: torch.export.ExportedProgram) -> None:
        program.constants["offset"] = 2.0

    edge = td.to_edge(export(Offset(), torch.randn(2))).transform([to_number])
    with pytest.raises(SerializationError, match=r"method 'forward': 'offset' is a float, not a tensor"):
        edge.save(tmp_path / "m.tdp")


class KeepsLinearAsAString(ReferencePartitioner):
    def ops_to_not_decompose(self, exported_program: Any) -> Any:
        return ["aten.linear.default"], None


def test_ops_to_not_decompose_must_be_torch_ops() -> None:
    with pytest.raises(TypeError, match=r"ops_to_not_decompose returned 'aten.linear.default'; expected torch ops"):
        td.to_edge_transform_and_lower(export(TwoLinears(), torch.randn(2, 4)), partitioner=[KeepsLinearAsAString()])


def test_a_backend_that_proposes_no_partitioner_says_how_to_lower_with_it() -> None:
    with pytest.raises(ValueError, match=r"backend 'TestCompileOnly' proposes no partitioner .* from Python"):
        backend_support(CompileOnlyBackend.backend_id)


def test_a_backend_whose_runtime_is_missing_says_what_it_needs() -> None:
    import torch._inductor.config

    with torch._inductor.config.patch({"cpp.cxx": (None, "/nonexistent/c++")}):
        with pytest.raises(
            BackendUnavailableError, match=r"backend 'inductor' cannot run here: AOTInductor needs a C\+\+ compiler"
        ):
            backend_support("inductor")


def test_a_big_endian_machine_is_refused_at_import() -> None:
    script = "import sys, torch; sys.byteorder = 'big'; import torchdelegate"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 1
    assert "ImportError: torchdelegate files store little-endian data; this machine is big-endian" in result.stderr
