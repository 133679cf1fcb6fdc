"""A crafted onnxruntime blob cannot make the loader read a file, load code or take settings.

The files are written by `save` (valid container, valid checksums); only the delegate's ONNX
model lies. Each is refused with a FormatError before ONNX Runtime sees the model.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from crafted import lowered_with_blob, onnx_calling, onnx_reading, onnx_taking
from models import TwoLinears, export

import torchdelegate as td

ort = pytest.importorskip("onnxruntime")
from torchdelegate.backends.onnxruntime import OnnxRuntimePartitioner  # noqa: E402
from torchdelegate.backends.onnxruntime.blob_header import model_blob, unpacked  # noqa: E402

SECRET = b"the loader's secret bytes"


@pytest.fixture
def victim(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A working directory holding secrets the way a user's would, made current; and a link to one
    outside it."""
    (tmp_path / "secret.txt").write_bytes(SECRET)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "secret.txt").write_bytes(SECRET)
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    (elsewhere / "secret.txt").write_bytes(SECRET)
    os.symlink(elsewhere / "secret.txt", tmp_path / "link.txt")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _crafted(victim: Path, location: str, where: str = "initializer") -> Path:
    return lowered_with_blob(OnnxRuntimePartitioner(), onnx_reading(location, where=where, length=16), victim / "x.tdp")


def test_the_crafted_model_reads_the_file_when_onnx_runtime_is_given_it_unchecked(victim: Path) -> None:
    """The attack is real: ONNX Runtime alone returns the file's bytes."""
    crafted = onnx_reading("secret.txt", length=16)(td.lowered_modules(_lowered())[0].processed_bytes)
    _, model = unpacked(memoryview(crafted))
    session = ort.InferenceSession(bytes(model), providers=["CPUExecutionProvider"])
    (stolen,) = session.run(None, {session.get_inputs()[0].name: torch.randn(2, 4).numpy()})
    assert stolen.tobytes() == SECRET[:16]


def _lowered() -> torch.export.ExportedProgram:
    return td.to_backend(export(TwoLinears(), torch.randn(2, 4)), OnnxRuntimePartitioner())


@pytest.mark.parametrize(
    "location",
    ["secret.txt", "sub/secret.txt", "./secret.txt", "link.txt", "../secret.txt", "ABSOLUTE", "file:secret.txt"],
)
def test_an_initializer_stored_in_any_file_is_refused(victim: Path, location: str) -> None:
    location = str(victim / "secret.txt") if location == "ABSOLUTE" else location
    path = _crafted(victim, location)
    with td.load(path) as program, pytest.raises(td.FormatError, match="says its bytes are outside the model"):
        program.run("forward", torch.randn(2, 4))


@pytest.mark.parametrize("where", ["constant", "branch", "function"])
def test_an_external_tensor_in_an_attribute_a_sub_graph_or_a_function_is_refused(victim: Path, where: str) -> None:
    path = _crafted(victim, "secret.txt", where)
    with td.load(path) as program, pytest.raises(td.FormatError, match=r"attribute 'value' tensor 'stolen' says"):
        program.run("forward", torch.randn(2, 4))


def test_an_operator_from_a_custom_domain_is_refused(victim: Path) -> None:
    path = lowered_with_blob(OnnxRuntimePartitioner(), onnx_calling("ai.evil", "Run"), victim / "x.tdp")
    with td.load(path) as program, pytest.raises(td.FormatError, match="imports operator domain 'ai.evil'"):
        program.run("forward", torch.randn(2, 4))


def test_a_model_input_its_header_does_not_name_is_refused_at_load(victim: Path) -> None:
    """A model of one branch has no selector and no inputs fed with zeros: one it takes beyond its header's
    would reach ONNX Runtime unfed at every call."""
    path = lowered_with_blob(OnnxRuntimePartitioner(), onnx_taking("unfed"), victim / "x.tdp")
    with td.load(path) as program, pytest.raises(td.FormatError, match="its model takes 'unfed', which its header"):
        program.run("forward", torch.randn(2, 4))


def test_session_settings_in_the_model_are_refused(victim: Path) -> None:
    import onnx

    def with_settings(blob: bytes) -> bytes:

        header, payload = unpacked(memoryview(blob))
        model = onnx.ModelProto.FromString(bytes(payload))
        model.metadata_props.add(key="ort_config", value='{"session_options": {"optimized_model_filepath": "x"}}')
        return model_blob(header, model.SerializeToString())

    path = lowered_with_blob(OnnxRuntimePartitioner(), with_settings, victim / "x.tdp")
    with td.load(path) as program, pytest.raises(td.FormatError, match="carries session settings"):
        program.run("forward", torch.randn(2, 4))
    assert not (victim / "x").exists()


@pytest.mark.parametrize(
    "key", ["optimized_model_filepath", "session.optimized_model_filepath", "profile_file_prefix", "custom_op_library"]
)
def test_compile_specs_in_a_file_cannot_name_a_path_or_a_library(victim: Path, key: str) -> None:
    """A file's compile specs reach the session options: only the backend's four settings are accepted."""
    from torchdelegate.backends.onnxruntime import OnnxRuntimeBackend

    (delegate,) = td.lowered_modules(_lowered())
    named_data = td.NamedDataMap(delegate.named_data_store_output)
    with pytest.raises(ValueError, match=f"unknown compile spec '{key}'"):
        OnnxRuntimeBackend.init(memoryview(delegate.processed_bytes), [td.CompileSpec(key, b"out.onnx")], named_data)
    assert not (victim / "out.onnx").exists()


@pytest.mark.parametrize(
    ("field", "value"), [("location", "secret.txt"), ("offset", "1024"), ("length", "16"), ("basepath", "/")]
)
def test_a_supplied_initializer_reads_all_of_its_named_data_and_nothing_else(
    victim: Path, field: str, value: str
) -> None:
    """A weight the backend supplies may not be pointed at a file, at another place in its named data, or past it."""
    import onnx

    def pointed_elsewhere(blob: bytes) -> bytes:
        header, payload = unpacked(memoryview(blob))
        model = onnx.ModelProto.FromString(bytes(payload))
        (weight,) = [t for t in model.graph.initializer if t.name in header["initializers"]][:1]
        fields = {e.key: e.value for e in weight.external_data} | {field: value}
        del weight.external_data[:]
        for key, text in fields.items():
            weight.external_data.add(key=key, value=text)
        return model_blob(header, model.SerializeToString())

    program = td.to_edge(export(torch.nn.Linear(32, 32), torch.randn(2, 32))).to_backend(OnnxRuntimePartitioner())
    (delegate,) = td.lowered_modules(program.exported_program())
    delegate.processed_bytes = pointed_elsewhere(delegate.processed_bytes)
    program.save(victim / "x.tdp")
    with td.load(victim / "x.tdp") as loaded, pytest.raises(td.FormatError, match="must be read from all of named"):
        loaded.run("forward", torch.randn(2, 32))
