"""Load-time backend options: what depends on the machine that runs a file (ONNX Runtime's threads)
is set at load, for this process, among the keys the backend declares; anything else is refused."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import torchdelegate as td
from torchdelegate.runtime.backend_options import BackendOptionError

pytest.importorskip("onnxruntime")
from torchdelegate.backends.onnxruntime import OnnxRuntimeBackend, OnnxRuntimePartitioner  # noqa: E402

MODEL = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())


@pytest.fixture(scope="module")
def onnx_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("options") / "linear.tdp"
    exported = torch.export.export(MODEL, (torch.randn(2, 4),))
    specs = [td.CompileSpec("intra_op_num_threads", b"2")]
    td.to_edge(exported).to_backend(OnnxRuntimePartitioner(compile_specs=specs)).save(path)
    return path


def _threads(program: td.Program) -> int:
    program.initialize()
    session = program._delegates[0]._handle.model._session  # type: ignore[attr-defined]
    return int(session.get_session_options().intra_op_num_threads)


def test_an_option_replaces_the_files_compile_spec_for_this_process_only(onnx_file: Path) -> None:
    x = torch.randn(2, 4)
    with td.load(onnx_file) as program:
        assert _threads(program) == 2
        expected = program.run("forward", x)
    with td.load(onnx_file, backend_options={"onnxruntime": {"intra_op_num_threads": 1}}) as program:
        assert _threads(program) == 1
        torch.testing.assert_close(program.run("forward", x), expected)
    with td.load(onnx_file) as program:
        assert _threads(program) == 2  # the file is as it was


def test_an_option_the_backend_does_not_declare_or_a_backend_the_file_lacks_is_refused(onnx_file: Path) -> None:
    with pytest.raises(BackendOptionError, match=r"'onnxruntime' takes no load option 'fusions'; its options are: "):
        td.load(onnx_file, backend_options={"onnxruntime": {"fusions": 0}})
    with pytest.raises(BackendOptionError, match=r"names backend 'inductor', which no delegate of .* its backends"):
        td.load(onnx_file, backend_options={"inductor": {"threads": 1}})
    with pytest.raises(TypeError, match="backend_options must map backend ids"):
        td.load(onnx_file, backend_options=[("onnxruntime", {})])  # type: ignore[arg-type]
    assert set(OnnxRuntimeBackend.load_options) == {"intra_op_num_threads", "intra_op_spinning", "profile"}


def test_the_commands_take_backend_options(onnx_file: Path, tmp_path: Path) -> None:
    np.save(tmp_path / "x.npy", np.ones((2, 4), dtype=np.float32))
    command = [sys.executable, "-m", "torchdelegate", "run", str(onnx_file), "--input", str(tmp_path / "x.npy")]
    done = subprocess.run([*command, "--backend-option", "onnxruntime.intra_op_num_threads=1"], capture_output=True)
    assert done.returncode == 0, done.stderr
    wrong = subprocess.run([*command, "--backend-option", "onnxruntime.threads=1"], capture_output=True, text=True)
    assert wrong.returncode == 2
    assert "--backend-option: backend 'onnxruntime' takes no load option 'threads'" in wrong.stderr
    shapeless = subprocess.run([*command, "--backend-option", "threads=1"], capture_output=True, text=True)
    assert shapeless.returncode == 2 and "give ID.KEY=VALUE" in shapeless.stderr


def _spinning(program: td.Program) -> str:
    program.initialize()
    session = program._delegates[0]._handle.model._session  # type: ignore[attr-defined]
    return str(session.get_session_options().get_session_config_entry("session.intra_op.allow_spinning"))


def test_threads_spin_by_default_and_the_environment_sets_options_for_every_load(
    onnx_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TORCHDELEGATE_BACKEND_OPTIONS", raising=False)
    with td.load(onnx_file) as program:
        assert _spinning(program) == "1"  # ONNX Runtime's own default: a decode step's small nodes need it
    # Options for backends the file lacks are ignored: the variable is for every file of the process.
    monkeypatch.setenv("TORCHDELEGATE_BACKEND_OPTIONS", "onnxruntime.intra_op_spinning=0, inductor.x=1")
    with td.load(onnx_file) as program:
        assert _spinning(program) == "0" and _threads(program) == 2
    with td.load(onnx_file, backend_options={"onnxruntime": {"intra_op_num_threads": 1}}) as program:
        assert _spinning(program) == "0" and _threads(program) == 1  # both: given ones over the variable's
    with td.load(onnx_file, backend_options={"onnxruntime": {"intra_op_spinning": 1}}) as program:
        assert _spinning(program) == "1"


def test_a_wrong_environment_option_is_refused_naming_the_variable(
    onnx_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCHDELEGATE_BACKEND_OPTIONS", "onnxruntime.threads=1")
    with pytest.raises(BackendOptionError, match=r"^TORCHDELEGATE_BACKEND_OPTIONS: backend 'onnxruntime' takes no"):
        td.load(onnx_file)
    monkeypatch.setenv("TORCHDELEGATE_BACKEND_OPTIONS", "spinning=0")
    with pytest.raises(BackendOptionError, match=r"'spinning=0' is not ID.KEY=VALUE"):
        td.load(onnx_file)
    np.save(tmp_path / "x.npy", np.ones((2, 4), dtype=np.float32))
    command = [sys.executable, "-m", "torchdelegate", "run", str(onnx_file), "--input", str(tmp_path / "x.npy")]
    done = subprocess.run(command, capture_output=True, text=True)
    assert done.returncode == 2 and "TORCHDELEGATE_BACKEND_OPTIONS: 'spinning=0' is not ID.KEY=VALUE" in done.stderr
