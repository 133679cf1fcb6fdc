"""A file whose graphs only call delegates runs on numpy arrays, without torch: where torch is not
installed, and where it is (never imported). Outputs equal eager's and the torch engine's."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from blocked_imports import blocked_environment, blocking_site
from models import CumprodBetweenLinears, export
from programs import DECODE_TOKENS, PROMPT, eager_generation, program_generation, save_decoder

import torchdelegate as td
from torchdelegate.errors import ProgramInputError, TorchRequiredError

pytest.importorskip("onnxruntime")
from torchdelegate.backends.onnxruntime import OnnxRuntimePartitioner  # noqa: E402


@pytest.fixture(scope="module")
def decoder_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_decoder(tmp_path_factory.mktemp("arrays") / "decoder.tdp", OnnxRuntimePartitioner())


@pytest.fixture(scope="module")
def residual_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """cumprod between two linear layers: ONNX Runtime takes the layers, the graph keeps cumprod."""
    path = tmp_path_factory.mktemp("arrays") / "residual.tdp"
    program = export(CumprodBetweenLinears().eval(), torch.randn(2, 8))
    td.to_edge(program).to_backend(OnnxRuntimePartitioner()).save(path)
    return path


def _python(code: str, *args: object, blocked: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``code`` run in a fresh process; where torch cannot be imported when ``blocked`` (a blocking site)."""
    environment = None if blocked is None else blocked_environment(blocked)
    line = [sys.executable, "-c", textwrap.dedent(code), *map(str, args)]
    return subprocess.run(line, capture_output=True, text=True, timeout=120, env=environment)


def _generation_script() -> str:
    prompt, tokens = PROMPT.tolist(), list(DECODE_TOKENS)
    return textwrap.dedent(f"""
        import sys
        import numpy as np
        import torchdelegate as td
        with td.load(sys.argv[1]) as program:
            assert program.engine == "arrays", program.engine
            prompt = np.array({prompt})
            outputs = [program.run("prefill", prompt, np.arange(len(prompt)))]
            for step, token in enumerate({tokens}):
                outputs.append(program.run("decode", np.array([token]), np.array([len(prompt) + step])))
        assert all(type(o) is np.ndarray for o in outputs)
        np.savez(sys.argv[2], *outputs)
        assert "torch" not in sys.modules, sorted(m for m in sys.modules if m.startswith("torch."))[:5]
        print("no torch")
    """)


@pytest.mark.parametrize("blocked", [True, False], ids=["torch not installed", "torch installed"])
def test_a_delegate_only_file_runs_on_numpy_without_importing_torch(
    decoder_file: Path, tmp_path: Path, blocked: bool
) -> None:
    site = blocking_site(tmp_path / "site") if blocked else None
    result = _python(_generation_script(), decoder_file, tmp_path / "out.npz", blocked=site)
    assert result.returncode == 0 and "no torch" in result.stdout, result.stderr
    saved = np.load(tmp_path / "out.npz")
    for index, expected in enumerate(eager_generation()):
        np.testing.assert_allclose(saved[f"arr_{index}"], expected.numpy(), rtol=1e-4, atol=1e-4)


def test_torch_tensors_in_give_torch_tensors_out_equal_to_the_torch_engine(decoder_file: Path) -> None:
    with td.load(decoder_file) as arrays, td.load(decoder_file, engine="torch") as on_torch:
        assert (arrays.engine, on_torch.engine) == ("arrays", "torch")
        for ours, theirs in zip(program_generation(arrays), program_generation(on_torch), strict=True):
            assert type(ours) is torch.Tensor
            torch.testing.assert_close(ours, theirs)


def test_the_torch_engine_takes_numpy_arrays_and_gives_arrays(decoder_file: Path) -> None:
    with td.load(decoder_file, engine="torch") as program:
        logits = program.run("prefill", PROMPT.numpy(), np.arange(len(PROMPT)))
    assert type(logits) is np.ndarray
    np.testing.assert_allclose(logits, eager_generation()[0].numpy(), rtol=1e-4, atol=1e-4)


def test_an_array_of_the_wrong_dtype_is_named(decoder_file: Path) -> None:
    with td.load(decoder_file) as program:
        assert program.method("decode").signature() == ["tokens: int64[1]", "positions: int64[1]"]
        with pytest.raises(ProgramInputError, match="argument 'tokens' must have dtype int64, got int32"):
            program.run("decode", np.array([3], dtype=np.int32), np.array([8]))
        with pytest.raises(ProgramInputError, match="argument 'tokens' must be a tensor"):
            program.run("decode", [3], np.array([8]))


def test_a_graph_that_computes_needs_torch_and_says_which_nodes(residual_file: Path, tmp_path: Path) -> None:
    with pytest.raises(TorchRequiredError, match=r"cannot run without torch: method 'forward': .*cumprod"):
        td.load(residual_file, engine="arrays")
    with td.load(residual_file) as program:  # torch is installed: the graph runs on it
        assert program.engine == "torch"
        assert program.run("forward", np.ones((2, 8), dtype=np.float32)).shape == (2, 4)
    script = "import sys, torchdelegate as td\ntd.load(sys.argv[1])\n"
    result = _python(script, residual_file, blocked=blocking_site(tmp_path / "site"))
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("torchdelegate.errors.TorchRequiredError: ") and "needs torch to run" in last, last
    assert "cumprod" in last and "pip install torchdelegate" in last, last


def test_the_cache_command_needs_no_torch(tmp_path: Path) -> None:
    """``cache info`` and ``cache clear`` read the store alone: they work where torch is not installed."""
    environment = {**blocked_environment(blocking_site(tmp_path / "site")), "TORCHDELEGATE_CACHE": str(tmp_path / "c")}
    script = Path(sys.executable).parent / "torchdelegate"
    prefix = [str(script)] if script.exists() else [sys.executable, "-m", "torchdelegate.cli"]
    for action in ("info", "clear"):
        result = subprocess.run([*prefix, "cache", action], capture_output=True, text=True, env=environment, timeout=60)
        assert result.returncode == 0 and str(tmp_path / "c") in result.stdout, result.stderr


class _AddsToItsInput(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.add_(1.0)
        return x * 2


def test_a_read_only_array_is_never_written_by_a_method_that_writes_its_input(tmp_path: Path) -> None:
    """The method writes its input (torch runs that update): a writable array gets it, as a tensor would;
    a read-only one (a view of bytes, a memory-mapped file) is copied rather than written."""
    program = torch.export.export(_AddsToItsInput(), (torch.zeros(4),))
    td.to_edge(program).to_backend(OnnxRuntimePartitioner()).save(tmp_path / "adds.tdp")
    frozen = bytes(np.zeros(4, dtype=np.float32).tobytes())
    with td.load(tmp_path / "adds.tdp") as loaded:
        assert loaded.engine == "torch"  # the update of a user input is not a call plan's
        writable = np.zeros(4, dtype=np.float32)
        np.testing.assert_array_equal(loaded.run("forward", writable), np.full(4, 2.0, dtype=np.float32))
        np.testing.assert_array_equal(writable, np.ones(4, dtype=np.float32))
        read_only = np.frombuffer(frozen, dtype=np.float32)
        np.testing.assert_array_equal(loaded.run("forward", read_only), np.full(4, 2.0, dtype=np.float32))
    assert frozen == bytes(16)


def test_numpy_arrays_in_give_arrays_out_whatever_else_comes_in(decoder_file: Path) -> None:
    for engine in ("arrays", "torch"):
        with td.load(decoder_file, engine=engine) as program:
            logits = program.run("decode", torch.tensor([3]), np.array([8]))
            assert type(logits) is np.ndarray, engine


def test_a_delegate_two_methods_list_never_writes_into_its_inputs(decoder_file: Path, tmp_path: Path) -> None:
    """A crafted file whose decode calls prefill's delegate: what one method donates (a buffer it alone
    reads) may be the other's user input or weight, so that delegate takes no input's memory at all."""
    import json

    from crafted import manifest_bytes, with_manifest

    original = decoder_file.read_bytes()
    manifest = json.loads(manifest_bytes(original))
    decode = next(m for m in manifest["methods"] if m["name"] == "decode")
    decode["delegates"] = [0]
    for node in decode["graph"]["graph_module"]["graph"]["nodes"]:
        for argument in node["inputs"]:
            if node["target"].endswith("call_delegate.default") and argument["name"] == "index":
                argument["arg"] = {"as_int": 0}
    crafted = tmp_path / "shared.tdp"
    crafted.write_bytes(with_manifest(original, json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()))
    with td.load(decoder_file) as sound:
        sound.initialize()
        assert sound._delegates[0]._handle.written  # the cache written in place, as a sound file does
    for engine in ("arrays", "torch"):
        with td.load(crafted, engine=engine) as program:
            program.initialize()
            assert program._delegates[0]._handle.written == {}, engine
