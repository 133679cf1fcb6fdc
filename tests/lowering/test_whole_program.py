"""to_backend(backend_id, edge_program, compile_specs): the whole program to one backend."""

import pytest
import torch
from backends_for_tests import TorchExportBackend
from models import KVCache, TwoLinears, export

from torchdelegate import (
    BackendDetails,
    BackendNotFoundError,
    CompileSpec,
    DelegationSpec,
    LoweredBackendModule,
    PreprocessError,
    PreprocessResult,
    run_original_subprograms,
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
    out = lowered(x)
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
    ops = [n.op for n in lowered.graph.nodes]
    assert ops == ["placeholder"] * 3 + ["get_attr"] + ["call_function"] * 3 + ["output"]
    # Weights go inside; the cache stays with the program, so methods lowered together share it.
    assert list(lowered.state_dict) == ["cache"]
    assert lowered.graph_signature.buffers_to_mutate == {"index_put": "cache"}
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


class CopyIn(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("buf", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.buf.copy_(x)
        return x.sin()


def test_whole_graph_lowering_keeps_a_buffer_update_it_does_not_compute() -> None:
    program = export(CopyIn(), torch.randn(4))
    lowered = to_backend(program, DelegationSpec("TestTorchExport"))
    assert lowered.graph_signature.buffers_to_mutate == {"x": "buf"}
    module, x = lowered.module(), torch.randn(4)
    torch.testing.assert_close(module(x), x.sin())
    torch.testing.assert_close(module.buf, x)


class Mutating(BackendDetails):
    """Rewrites the program it is given in place, as some compilers' passes do."""

    backend_id = "TestMutatesItsInput"

    @staticmethod
    def preprocess(edge_program, compile_specs):  # type: ignore[no-untyped-def]
        for node in edge_program.graph.nodes:
            if node.op == "call_function":
                node.meta["rewritten"] = True
                node.target = (
                    torch.ops.aten.sigmoid.default if node.target is torch.ops.aten.relu.default else node.target
                )
        return PreprocessResult(b"")


def test_a_backend_that_rewrites_its_sub_program_is_told_to_copy_it() -> None:
    program = export(TwoLinears(), torch.randn(2, 4))
    with pytest.raises(PreprocessError, match=r"'TestMutatesItsInput' changed the sub-program .*copy_program"):
        to_backend(program, DelegationSpec("TestMutatesItsInput"))
    with pytest.raises(PreprocessError, match="changed the sub-program of the whole program"):
        to_backend("TestMutatesItsInput", program, [])


class AddInPlace(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.add_(1)
        return x * 2


def test_original_subprograms_apply_user_input_mutations_like_eager() -> None:
    program = export(AddInPlace(), torch.ones(3))
    lowered = to_backend("TestTorchExport", program, [])
    x = torch.ones(3)
    with run_original_subprograms():
        out = lowered(x)
    torch.testing.assert_close(x, torch.full((3,), 2.0))
    torch.testing.assert_close(out, torch.full((3,), 4.0))
