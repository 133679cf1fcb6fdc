"""Native code in a file runs only when its loader trusts the backend, by argument, environment or command.

`NativeReference` is the reference backend declaring `runs_native_code`: it stands for AOTInductor
(whose own test, in tests/backends/test_inductor.py, compiles for half a minute) so that every path
of the switch is tried here in seconds.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from models import TwiceInner, TwoLinears, export

import torchdelegate as td
from torchdelegate.backends.reference import ReferenceBackend
from torchdelegate.cli import main


class NativeReference(ReferenceBackend):
    backend_id = "test_native_reference"
    runs_native_code = True


@pytest.fixture
def native_file(tmp_path: Path) -> tuple[Path, torch.nn.Module]:
    model = TwoLinears().eval()
    program = export(model, torch.randn(2, 4))
    td.to_edge(program).to_backend(td.DelegationSpec(NativeReference.backend_id)).save(tmp_path / "native.tdp")
    return tmp_path / "native.tdp", model


def test_a_native_code_delegate_is_refused_at_load_naming_the_backend_and_the_switch(
    native_file: tuple[Path, torch.nn.Module], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(td.TRUSTED_BACKENDS_VARIABLE, raising=False)
    path, _ = native_file
    with pytest.raises(td.UntrustedCodeError) as error:
        td.load(path, trusted_backends=["reference"])  # trusting another backend is not trusting this one
    message = str(error.value)
    assert "backend 'test_native_reference' runs native code from the file" in message
    assert "trusted_backends=['test_native_reference']" in message
    assert "TORCHDELEGATE_TRUSTED_BACKENDS=test_native_reference" in message and "--trust" in message


def test_trust_by_argument_or_environment_runs_it(
    native_file: tuple[Path, torch.nn.Module], monkeypatch: pytest.MonkeyPatch
) -> None:
    path, model = native_file
    x = torch.randn(2, 4)
    with td.load(path, trusted_backends=["test_native_reference"]) as program:
        torch.testing.assert_close(program.run("forward", x), model(x))
    monkeypatch.setenv(td.TRUSTED_BACKENDS_VARIABLE, "onnxruntime, test_native_reference")
    with td.load(path) as program:
        torch.testing.assert_close(program.run("forward", x), model(x))


def test_a_string_is_not_a_list_of_backends(native_file: tuple[Path, torch.nn.Module]) -> None:
    with pytest.raises(TypeError, match="trusted_backends must be a list of backend ids, got the string"):
        td.load(native_file[0], trusted_backends="test_native_reference")  # type: ignore[arg-type]


def test_a_native_delegate_nested_in_another_blob_needs_the_same_trust(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(td.TRUSTED_BACKENDS_VARIABLE, raising=False)
    inner = td.to_backend(
        NativeReference.backend_id, td.to_edge(export(TwoLinears(), torch.randn(2, 4))).exported_program(), []
    )

    model, x = TwiceInner(inner), torch.randn(2, 4)
    nested = td.to_edge(torch.export.export(model, (x,))).to_backend(td.DelegationSpec("reference"))
    nested.save(tmp_path / "nested.tdp")
    with td.load(tmp_path / "nested.tdp") as program:  # the file's own delegate is the reference backend's
        with pytest.raises(td.UntrustedCodeError, match="backend 'test_native_reference' runs native code"):
            program.run("forward", x)
    with td.load(tmp_path / "nested.tdp", trusted_backends=["test_native_reference"]) as program:
        torch.testing.assert_close(program.run("forward", x), model(x))


def test_the_command_runs_with_trust_and_inspect_marks_native_code_without_running_it(
    native_file: tuple[Path, torch.nn.Module],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(td.TRUSTED_BACKENDS_VARIABLE, raising=False)
    path, _ = native_file
    monkeypatch.chdir(path.parent)
    import numpy as np

    np.save("x.npy", torch.randn(2, 4).numpy())
    assert main(["run", "native.tdp", "--input", "x.npy"]) == 1
    assert "runs native code from the file" in capsys.readouterr().err
    assert main(["run", "native.tdp", "--input", "x.npy", "--trust", "test_native_reference"]) == 0
    capsys.readouterr()
    assert main(["inspect", "native.tdp"]) == 0
    assert "test_native_reference: 1 blob(s)" in (out := capsys.readouterr().out)
    assert "native code: runs only with --trust test_native_reference" in out
