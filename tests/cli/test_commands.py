"""The ``torchdelegate`` command, end to end through a subprocess, as a user runs it."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from models import CumprodBetweenLinears, TwoLinears

import torchdelegate as td
from torchdelegate.cli import main

needs_onnxruntime = pytest.mark.skipif(importlib.util.find_spec("onnxruntime") is None, reason="onnxruntime missing")


def _command(*args: str | Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    script = Path(sys.executable).parent / "torchdelegate"
    prefix = [str(script)] if script.exists() else [sys.executable, "-m", "torchdelegate.cli"]
    return subprocess.run([*prefix, *map(str, args)], capture_output=True, text=True, cwd=cwd, timeout=600)


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("cli")
    torch.manual_seed(0)
    model = CumprodBetweenLinears().eval()
    x = torch.randn(2, 8)
    torch.export.save(torch.export.export(model, (x,)), directory / "model.pt2")
    np.save(directory / "x.npy", x.numpy())
    torch.save(model.state_dict(), directory / "weights.pt")
    two = TwoLinears()
    for name, rows in (("a", 2), ("b", 3)):
        torch.export.save(torch.export.export(two, (torch.randn(rows, 4),)), directory / f"{name}.pt2")
    return directory


@needs_onnxruntime
@pytest.mark.usefixtures("cache_directory")
def test_lower_inspect_and_run_a_model_onnx_runtime_takes_part_of(exported: Path) -> None:
    lowered = _command(
        "lower",
        "forward=model.pt2",
        "--backend",
        "onnxruntime",
        "-o",
        "out/model.tdp",
        "--html",
        "report.html",
        cwd=exported,
    )
    assert lowered.returncode == 0, lowered.stderr
    assert "method 'forward': 5 of 6 computations delegated" in lowered.stdout
    assert (
        "aten.cumprod.default x1 (cumprod): onnxruntime: torch.onnx has no translation for aten.cumprod.default"
        in lowered.stdout
    )
    assert "preprocess 2/2: onnxruntime" in lowered.stderr
    assert (exported / "out/model.tdp").stat().st_size > 0 and "<svg" in (exported / "report.html").read_text()

    inspected = _command("inspect", "out/model.tdp", "--report", cwd=exported)
    assert inspected.returncode == 0, inspected.stderr
    assert "format version 1" in inspected.stdout
    assert "forward(x: float32[2, 8])  delegates: #0 onnxruntime, #1 onnxruntime" in inspected.stdout
    assert "onnxruntime: 2 blob(s)" in inspected.stdout
    assert "onnxruntime_0" in inspected.stdout and "cumprod" in inspected.stdout

    prepared = _command("prepare", "out/model.tdp", cwd=exported)
    assert prepared.returncode == 0, prepared.stderr
    assert prepared.stdout.count("optimized and packed for this machine") == 2, prepared.stdout  # two models
    assert "loads of out/model.tdp on this machine use it" in prepared.stdout
    entry = Path(prepared.stdout.splitlines()[0].rpartition(" in ")[2])
    (entry / "model.onnx").write_bytes(b"\0" * (entry / "model.onnx").stat().st_size)  # damaged: not used

    ran = _command("run", "out/model.tdp", "--input", "x.npy", "--save", "outputs/y.npz", cwd=exported)
    assert ran.returncode == 0, ran.stderr
    assert f"torchdelegate: warning: onnxruntime: the prepared model in {entry} is not used" in ran.stderr
    assert "UserWarning" not in ran.stderr
    assert "output_0: float32[2, 4]" in ran.stdout
    model = CumprodBetweenLinears()
    model.load_state_dict(torch.load(exported / "weights.pt"))
    expected = model(torch.from_numpy(np.load(exported / "x.npy"))).detach().numpy()
    np.testing.assert_allclose(np.load(exported / "outputs/y.npz")["output_0"], expected, rtol=1e-5, atol=1e-6)


def test_two_methods_lowered_together_store_their_shared_weights_once(exported: Path) -> None:
    lowered = _command("lower", "a=a.pt2", "b=b.pt2", "-b", "reference", "-o", "two.tdp", cwd=exported)
    assert lowered.returncode == 0, lowered.stderr
    assert "weights and buffers: 160 B unique; the 2 methods hold 320 B, stored once: 160 B saved" in lowered.stdout
    ran = _command("run", "two.tdp", "--method", "b", "--input", "x.npy", cwd=exported)
    assert ran.returncode == 1
    assert "error:" in ran.stderr and "Traceback" not in ran.stderr  # x is [2, 8]; method b takes [3, 4]


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (
            ("lower", "forward=missing.pt2", "-b", "reference", "-o", "x.tdp"),
            1,
            "method 'forward': no file 'missing.pt2'",
        ),
        (("lower", "model.pt2", "-b", "reference", "-o", "x.tdp"), 2, "is not METHOD=FILE.pt2"),
        (("lower", "=model.pt2", "-b", "reference", "-o", "x.tdp"), 2, "(for one method: forward=model.pt2)"),
        (("lower", "forward=x.npy", "-b", "reference", "-o", "x.tdp"), 1, "'x.npy' is not a torch.export.save file"),
        (("lower", "forward=model.pt2", "-b", "nope", "-o", "x.tdp"), 2, "no backend with id 'nope'"),
        (("lower", "forward=model.pt2", "-o", "x.tdp"), 2, "the following arguments are required: --backend"),
        (("inspect", "x.npy"), 1, "x.npy"),
        (("run", "model.pt2", "--input", "x.npy"), 1, "model.pt2"),
        (("run", ".", "--input", "x.npy"), 1, ". is a directory, not a program file"),
        (
            ("lower", "forward=model.pt2", "-b", "reference", "-o", "x.tdp", "--jobs", "0"),
            2,
            "--jobs 0: give a number of worker processes >= 1",
        ),
        (
            ("lower", "forward=model.pt2", "-b", "reference", "-o", "x.tdp", "--jobs", "2", "--cluster", "tcp://x:1"),
            2,
            "give --jobs or --cluster, not both",
        ),
        (
            ("lower", "forward=model.pt2", "-b", "reference", "-o", "x.tdp", "--cluster", "tcp://127.0.0.1:1"),
            1,
            "no Dask scheduler answers at tcp://127.0.0.1:1 (Connection refused); start one with `dask scheduler`",
        ),
        (
            ("lower", "forward=model.pt2", "-b", "reference", "-o", "x.tdp", "--cluster", "http://127.0.0.1:1"),
            2,
            "http://127.0.0.1:1 is not a Dask scheduler's address (Dask has no 'http' addresses; it has inproc, tcp",
        ),
        (
            ("lower", "forward=model.pt2", "-b", "reference", "-o", "x.tdp", "--cache", "x.npy"),
            2,
            "is a file; give a directory you can write, an fsspec URL, or off",
        ),
    ],
)
def test_bad_use_is_one_line_on_stderr_with_an_exit_code(
    exported: Path, args: tuple[str, ...], code: int, message: str
) -> None:
    """Through the installed command: a CommandError is one line; a wrong command line (a UsageError or
    argparse's own refusal) exits 2."""
    result = _command(*args, cwd=exported)
    assert result.returncode == code
    assert message in result.stderr and "Traceback" not in result.stderr
    assert result.stdout == ""
    if code == 1:  # argparse's own refusals print the usage line first
        assert result.stderr.count("\n") == 1, result.stderr


def test_a_TORCHDELEGATE_CACHE_that_cannot_be_a_cache_is_named(exported: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHDELEGATE_CACHE", "x.npy")
    result = _command("lower", "forward=model.pt2", "-b", "reference", "-o", "x.tdp", cwd=exported)
    assert result.returncode == 1  # not the command line's fault
    assert result.stderr.startswith("torchdelegate: error: TORCHDELEGATE_CACHE='x.npy': the compile cache '"), (
        result.stderr
    )
    assert result.stderr.rstrip().endswith("set it to a directory you can write, an fsspec URL, or off")


def test_verbose_shows_the_traceback(exported: Path) -> None:
    result = _command("inspect", "x.npy", "--verbose", cwd=exported)
    assert result.returncode == 1 and "Traceback" in result.stderr


@needs_onnxruntime
def test_the_demo_generates_what_eager_generates(tmp_path: Path) -> None:
    result = _command("demo", "--tokens", "30", "--rounds", "1", "--output-dir", "kept", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "tokens identical to eager" in result.stdout
    assert re.search(r"-> 30 tokens:\n  torchdelegate is [a-z]+ [a-z]+", result.stdout), result.stdout
    assert "method 'decode':" in result.stdout and "onnxruntime_0" in result.stdout
    assert (tmp_path / "kept/demo.tdp").exists() and (tmp_path / "kept/demo-report.html").exists()


@needs_onnxruntime
def test_lower_quantize_runs_the_quantized_products_on_onnx_runtime(tmp_path: Path) -> None:
    pytest.importorskip("torchao")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64)).eval()
    x = torch.randn(3, 64)
    torch.export.save(torch.export.export(model, (x,)), tmp_path / "mlp.pt2")
    np.save(tmp_path / "x.npy", x.numpy())
    args = ("lower", "forward=mlp.pt2", "-b", "onnxruntime", "-b", "reference", "-o", "q.tdp", "--quantize")
    result = _command(*args, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "quantized with 8da4w-asym: linear layers per method: forward 2" in result.stdout  # the default
    assert "Failed to load" not in result.stderr  # torchao's warnings about GPU kernels are not the user's
    assert (tmp_path / "q.tdp").stat().st_size < 0.5 * sum(p.numel() * 4 for p in model.parameters())
    ran = _command("run", "q.tdp", "--input", "x.npy", "--save", "y.npz", cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr
    with torch.no_grad():
        expected = model(x).numpy()
    np.testing.assert_allclose(np.load(tmp_path / "y.npz")["output_0"], expected, atol=0.1)  # int4 weights


def test_help_lists_the_commands(tmp_path: Path) -> None:
    result = _command("--help", cwd=tmp_path)
    assert result.returncode == 0
    for command in ("lower", "inspect", "run", "prepare", "demo"):
        assert command in result.stdout
    as_module = subprocess.run(
        [sys.executable, "-m", "torchdelegate", "--version"], capture_output=True, text=True, cwd=tmp_path, timeout=600
    )
    assert as_module.returncode == 0 and as_module.stdout.startswith("torchdelegate "), as_module.stderr


def test_help_and_a_usage_error_import_no_torch(tmp_path: Path) -> None:
    """The command line is read, and answered when it is wrong, before torch is imported (seconds)."""
    script = (
        "import sys\nfrom torchdelegate.cli.main import main\n"
        "for argv in (['--help'], ['llm', 'generate']):\n"
        "    try:\n        main(argv)\n    except SystemExit as exit:\n        print(exit.code)\n"
        "print(sorted(m for m in ('torch', 'numpy', 'onnxruntime') if m in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert result.stdout.splitlines()[-3:] == ["0", "2", "[]"], result.stderr


def test_a_torch_save_file_is_told_apart_from_a_torch_export_one(exported: Path) -> None:
    """inspect and lower give one diagnosis of a pickled module: export it, not lower it as it is."""
    torch.save(TwoLinears(), exported / "pickled.pt")
    inspected = _command("inspect", "pickled.pt", cwd=exported)
    lowered = _command("lower", "forward=pickled.pt", "-b", "reference", "-o", "p.tdp", cwd=exported)
    for finished in (inspected, lowered):
        assert finished.returncode == 1 and "Traceback" not in finished.stderr
        assert "it is a torch.save file (a pickled module, state dict or tensors)" in finished.stderr
        assert "export it with torch.export.export and save that with torch.export.save" in finished.stderr
    assert "lower it first" not in inspected.stderr and not (exported / "p.tdp").exists()


def test_every_command_treats_an_output_path_by_one_rule(
    exported: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Missing directories are made and said so as the file is written, and only then; a path under a file,
    or a directory given as the file, is a usage error naming the flag before any work, and nothing is written."""
    lower = ("lower", "forward=model.pt2", "-b", "reference")
    made = _command(*lower, "-o", "new/a/m.tdp", "--html", "new/b/r.html", cwd=exported)
    assert made.returncode == 0, made.stderr
    assert "made directory new/a (for -o)" in made.stdout and "made directory new/b (for --html)" in made.stdout
    assert (exported / "new/a/m.tdp").is_file() and (exported / "new/b/r.html").is_file()
    inspected = _command("inspect", "new/a/m.tdp", "--html", "new/c/r.html", cwd=exported)
    ran = _command("run", "new/a/m.tdp", "--input", "x.npy", "--save", "new/d/o.npz", cwd=exported)
    for finished, flag, written in ((inspected, "--html", "new/c/r.html"), (ran, "--save", "new/d/o.npz")):
        assert finished.returncode == 0, finished.stderr
        assert f"made directory {Path(written).parent} (for {flag})" in finished.stdout
        assert (exported / written).is_file()
    monkeypatch.chdir(exported)  # the refusals come before any work: run in this process
    refused = [
        ([*lower, "-o", "model.pt2/m.tdp"], "-o model.pt2: model.pt2 is a file, not a directory"),
        ([*lower, "-o", "new"], "-o new is a directory: give the file to write, e.g. new/model.tdp"),
        (["inspect", "new/a/m.tdp", "--html", "x.npy/r.html"], "--html x.npy: x.npy is a file, not a directory"),
        (["run", "new/a/m.tdp", "--input", "x.npy", "--save", "x.npy/o.npz"], "--save x.npy: x.npy is a file"),
    ]
    for args, message in refused:
        assert main(args) == 2
        printed = capsys.readouterr()
        assert message in printed.err and "Traceback" not in printed.err and printed.out == "", printed
    assert main(["lower", "forward=x.npy", "-b", "reference", "-o", "never/m.tdp"]) == 1
    assert not (exported / "never").exists()  # a command that fails makes nothing


@pytest.fixture(scope="module")
def saved(exported: Path) -> Path:
    """Files the in-process cases read: one method without a report, and two methods."""
    two = TwoLinears()
    td.to_edge(torch.export.export(two, (torch.randn(2, 4),))).save(exported / "plain.tdp")
    methods = {name: torch.export.export(two, (torch.randn(rows, 4),)) for name, rows in (("a", 2), ("b", 3))}
    td.to_edge(methods).save(exported / "ab.tdp")
    (exported / "needs_missing.py").write_text("import a_module_nobody_installed\n")  # for --import
    return exported


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (("lower", "forward=x.npy", "-b", "reference", "-o", "x.tdp"), 1, "method 'forward': 'x.npy' is not a torch"),
        (
            ("lower", "forward=model.pt2", "-b", "reference", "--compile-spec", "reference", "-o", "x.tdp"),
            2,
            "--compile-spec 'reference' is not ID:KEY=VALUE (e.g. onnxruntime:intra_op_num_threads=2)",
        ),
        (
            ("lower", "forward=model.pt2", "-b", "reference", "--compile-spec", "onnxruntime:x=1", "-o", "x.tdp"),
            2,
            "compile specs given for 'onnxruntime', which is not among the backends",
        ),
        (
            ("lower", "forward=model.pt2", "f=model.pt2", "forward=model.pt2", "-b", "reference", "-o", "x.tdp"),
            2,
            "method 'forward' is given twice",
        ),
        (
            ("lower", "forward=model.pt2", "-b", "reference", "-o", "x.tdp", "--import", "needs_missing"),
            1,
            "--import needs_missing: importing it failed: ModuleNotFoundError: No module named 'a_module_nobody_",
        ),
        (("lower", "forward=model.pt2", "-b", "reference", "-o", "x.tdp", "--import", ""), 2, "--import '' is not"),
        (("inspect", "plain.tdp", "--report"), 1, "plain.tdp holds no partition report"),
        (("run", "model.pt2"), 1, "model.pt2: not a torchdelegate program file (magic bytes"),
        (("run", "ab.tdp"), 1, "the file has several methods (a, b); choose one with --method"),
        (("run", "ab.tdp", "--method", "c"), 1, "no method 'c' in ab.tdp; the methods are a, b"),
        (("run", "plain.tdp", "--input", "abc"), 1, "input 'abc' is neither a .npy file nor a number"),
        (("run", "plain.tdp", "--input", "missing.npy"), 1, "no input file 'missing.npy'"),
        (
            ("run", "plain.tdp", "-i", "x=1", "-i", "2"),
            2,
            "input '2' comes after a NAME= input; give positional inputs first",
        ),
        (("run", "plain.tdp", "-i", "x=1", "-i", "x=2"), 2, "input 'x' is given twice"),
        (("prepare", "model.pt2"), 1, "model.pt2: not a torchdelegate program file (magic bytes"),
        (
            ("lower", "forward=model.pt2", "-b", "reference", "-o", "x.tdp", "--group-size", "8"),
            2,
            "--group-size, --keep-float and --embeddings go with --quantize RECIPE",
        ),
        (
            ("lower", "forward=model.pt2", "-b", "reference", "-o", "x.tdp", "--quantize", "int4", "--group-size", "3"),
            2,
            "method 'forward': linear layer 'l1' (weight 'l1.weight'): group size 3 does not divide its 8 inputs",
        ),
        (("demo", "--tokens", "0"), 2, "--tokens must be at least 1, got 0"),
        (("demo", "--rounds", "0"), 2, "--rounds must be at least 1, got 0"),
    ],
)
@pytest.mark.usefixtures("cache_directory")
def test_a_command_used_wrongly_says_what_to_change(
    saved: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    args: tuple[str, ...],
    code: int,
    message: str,
) -> None:
    """In process, faster: each CommandError is one line on stderr and nothing is written; a UsageError
    (a command line whose values are wrong) exits 2, as argparse's own refusals, any other 1."""
    monkeypatch.chdir(saved)
    monkeypatch.syspath_prepend(str(saved))
    assert main(list(args)) == code
    error = capsys.readouterr().err
    assert error.startswith(f"torchdelegate: error: {message}") and error.count("\n") == 1, error
    assert not (saved / "x.tdp").exists()


@pytest.mark.usefixtures("cache_directory")
def test_prepare_says_when_there_is_nothing_to_prepare_or_the_cache_is_off(
    saved: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(saved)
    assert main(["prepare", "plain.tdp"]) == 0
    assert "plain.tdp: nothing to prepare" in capsys.readouterr().out
    monkeypatch.setenv("TORCHDELEGATE_CACHE", "off")
    assert main(["prepare", "plain.tdp"]) == 1
    assert (
        "the machine cache is off (TORCHDELEGATE_CACHE='off'): set it to a directory to keep" in capsys.readouterr().err
    )


def test_text_from_a_file_reaches_the_terminal_without_its_control_characters() -> None:
    from torchdelegate.cli import printable

    assert printable("forward:\x1b]0;title\x07\x1b[2Jok\n\tnext") == "forward:\\x1b]0;title\\x07\\x1b[2Jok\n\tnext"


def test_a_file_needing_an_operator_library_says_to_import_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    library = torch.library.Library("td_cli_unloaded", "DEF")
    library.define("twice(Tensor x) -> Tensor")
    library.impl("twice", lambda x: x * 2, "CompositeExplicitAutograd")

    class CustomOp(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.ops.td_cli_unloaded.twice(x) + 1

    td.to_edge(torch.export.export(CustomOp(), (torch.randn(3),))).save(tmp_path / "op.tdp")
    library._destroy()
    monkeypatch.chdir(tmp_path)
    for command in ("inspect", "run"):
        assert main([command, "op.tdp"]) == 1
        error = capsys.readouterr().err
        assert "the graph calls torch.ops.td_cli_unloaded.twice.default" in error
        assert error.endswith("(with this command: --import MODULE)\n")


def test_a_moved_data_file_says_how_to_name_it_with_this_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    td.to_edge(torch.export.export(TwoLinears(), (torch.randn(2, 4),))).save(
        tmp_path / "m.tdp", external_data_path=tmp_path / "m.tdd"
    )
    (tmp_path / "m.tdd").rename(tmp_path / "moved.tdd")
    monkeypatch.chdir(tmp_path)
    assert main(["inspect", "m.tdp"]) == 1
    error = capsys.readouterr().err
    assert "keeps its data in an external file 'm.tdd'" in error
    assert error.endswith("(with this command: --external-data FILE)\n")
    assert main(["inspect", "m.tdp", "--external-data", "moved.tdd"]) == 0


def test_outputs_are_named_by_their_place_unless_they_are_a_flat_tuple() -> None:
    from torch.utils._pytree import MappingKey, SequenceKey

    from torchdelegate.cli.outputs import output_names

    assert output_names([(SequenceKey(0),), (SequenceKey(1),)]) == ["", ""]
    nested = [(SequenceKey(0),), (SequenceKey(1), SequenceKey(0)), (SequenceKey(1), MappingKey("k"))]
    assert output_names(nested) == ["0", "1.0", "1.k"]
    assert output_names([(0,), (1,)]) == ["", ""]  # the paths of a process without torch: positions and keys
    assert output_names([(0,), (1, 0), (1, "k")]) == ["0", "1.0", "1.k"]
