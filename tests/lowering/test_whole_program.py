"""to_backend(backend_id, edge_program, compile_specs): the whole program to one backend."""

import pytest
import torch
from backends import TorchExportBackend
from models import KVCache, TwoLinears, export

from torchdelegate import (
    BackendDetails,
    BackendNotFoundError,
    CompileSpec,
    DelegationSpec,
    LoweredBackendModule,
    PreprocessError,
    PreprocessResult,
    to_backend,
)


class RecordingBackend(TorchExportBackend):
    """Remembers the program it was given."""

    backend_id = "TestRecording"
    seen: list[torch.export.ExportedProgram] = []

    @staticmethod
    def preprocess(edge_program, compile_specs):  # type: ignore[no-untyped-def]
        RecordingBackend.seen.append(edge_program)
        return TorchExportBackend.preprocess(edge_program, compile_specs)


class FailingBackend(BackendDetails):
    backend_id = "TestFailing"

    @staticmethod
    def preprocess(edge_program, compile_specs):  # type: ignore[no-untyped-def]
        raise RuntimeError("out of registers")


def test_whole_program_lowering_runs_the_program_on_the_backend() -> None:
    model = TwoLinears()
    program = export(model, torch.randn(2, 4))
    lowered = to_backend("TestTorchExport", program, [CompileSpec("opt", b"1")])
    assert isinstance(lowered, LoweredBackendModule)
    assert lowered.backend_id == "TestTorchExport" and lowered.compile_specs == [CompileSpec("opt", b"1")]
    x = torch.randn(2, 4)
    (out,) = lowered(x)
    torch.testing.assert_close(out, model(x))


def test_preprocess_gets_a_structural_copy_sharing_the_tensors() -> None:
    program = export(TwoLinears(), torch.randn(2, 4))
    RecordingBackend.seen.clear()
    lowered = to_backend("TestRecording", program, [])
    (seen,) = RecordingBackend.seen
    assert seen is not program and seen.graph is not program.graph
    assert all(seen.state_dict[k] is v for k, v in program.state_dict.items())
    assert lowered.original_module is seen


def test_unknown_backend_id_names_it_and_the_registered_ids() -> None:
    program = export(TwoLinears(), torch.randn(2, 4))
    with pytest.raises(BackendNotFoundError, match=r"'Nope'.*'TestTorchExport'"):
        to_backend("Nope", program, [])
    with pytest.raises(NotImplementedError):
        to_backend("Nope", program, [])


def test_an_exception_in_preprocess_is_reraised_with_the_backend_id_chained() -> None:
    program = export(TwoLinears(), torch.randn(2, 4))
    with pytest.raises(PreprocessError, match="'TestFailing'.*out of registers") as info:
        to_backend("TestFailing", program, [])
    assert isinstance(info.value.__cause__, RuntimeError)


def test_a_delegation_spec_lowers_the_whole_graph_into_one_delegate() -> None:
    model = KVCache()
    program = export(model, torch.randn(1, 4), torch.tensor([0]))
    lowered = to_backend(program, DelegationSpec("TestTorchExport"))
    assert [n.op for n in lowered.graph.nodes] == [
        "placeholder",
        "placeholder",
        "get_attr",
        "call_function",
        "call_function",
        "output",
    ]
    assert lowered.state_dict == {}
    module, eager = lowered.module(), KVCache()
    eager.load_state_dict(model.state_dict())
    for i in range(4):
        x, pos = torch.randn(1, 4), torch.tensor([i])
        torch.testing.assert_close(module(x, pos), eager(x, pos))


def test_bad_preprocess_results_name_the_backend_and_what_was_expected() -> None:
    class NotAResult(BackendDetails):
        backend_id = "TestNotAResult"

        @staticmethod
        def preprocess(edge_program, compile_specs):  # type: ignore[no-untyped-def]
            return b"raw bytes"

    class StrBlob(BackendDetails):
        backend_id = "TestStrBlob"

        @staticmethod
        def preprocess(edge_program, compile_specs):  # type: ignore[no-untyped-def]
            return PreprocessResult("text")  # type: ignore[arg-type]

    program = export(TwoLinears(), torch.randn(2, 4))
    with pytest.raises(PreprocessError, match="'TestNotAResult' returned bytes.*expected a PreprocessResult"):
        to_backend("TestNotAResult", program, [])
    with pytest.raises(PreprocessError, match="'TestStrBlob'.*processed_bytes.*is a str; expected bytes"):
        to_backend(program, DelegationSpec("TestStrBlob"))


def test_compile_specs_must_be_compile_spec_objects() -> None:
    program = export(TwoLinears(), torch.randn(2, 4))
    with pytest.raises(TypeError, match="must be CompileSpec"):
        to_backend("TestTorchExport", program, [("k", b"v")])
