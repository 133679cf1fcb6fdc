"""torchdelegate-runtime, the torch-free distribution (packaging/runtime): what setuptools declares for it
from the staged project, read without building or reaching an index. .ci/package builds and installs it."""

from __future__ import annotations

import configparser
import importlib.util
import re
import subprocess
import sys
from email.message import Message
from email.parser import Parser
from pathlib import Path
from types import ModuleType

import pytest

import torchdelegate

tomllib = pytest.importorskip("tomllib", reason="pyproject.toml is read by Python 3.11's tomllib")
ROOT = Path(__file__).resolve().parent.parent
RUNS_FILES = {"numpy", "onnxruntime", "ml-dtypes", "tokenizers", "jinja2"}
SERVES = {"starlette", "uvicorn", "h11"}
WRITE_METADATA = "prepare_metadata_for_build_wheel"  # PEP 517's hook: the wheel's METADATA, not the wheel


@pytest.fixture(scope="module")
def declared(tmp_path_factory: pytest.TempPathFactory) -> tuple[Message, str]:
    """The staged project's METADATA and entry_points.txt, as setuptools writes them for its wheel."""
    staged = _build_script().stage(tmp_path_factory.mktemp("runtime") / "project")
    written = subprocess.run(
        [sys.executable, "-c", f"from setuptools import build_meta; print(build_meta.{WRITE_METADATA}('.'))"],
        cwd=staged,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert written.returncode == 0, written.stderr
    info = staged / written.stdout.strip().splitlines()[-1]
    return Parser().parsestr((info / "METADATA").read_text()), (info / "entry_points.txt").read_text()


def test_it_runs_files_with_numpy_and_onnx_runtime_and_serves_with_starlette(declared: tuple[Message, str]) -> None:
    """No torch, transformers, onnx or onnxscript: lowering's dependencies are not running's."""
    metadata, _ = declared
    assert metadata["Name"] == "torchdelegate-runtime"
    required = [_parsed(requirement) for requirement in metadata.get_all("Requires-Dist") or []]
    assert {name for name, extra in required if extra is None} == RUNS_FILES
    assert {name for name, extra in required if extra == "serve"} == SERVES
    assert {extra for _, extra in required} == {None, "serve"} and metadata.get_all("Provides-Extra") == ["serve"]


def test_its_version_is_torchdelegates(declared: tuple[Message, str]) -> None:
    metadata, _ = declared
    main = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert metadata["Version"] == torchdelegate.__version__ == main


def test_it_installs_the_command_backends_and_package_data_torchdelegate_does(declared: tuple[Message, str]) -> None:
    """The same entry points (a file names its backends by their ids); the same package data but the demo's
    weights (the demo lowers, which needs torch)."""
    _, entry_points = declared
    main = tomllib.loads((ROOT / "pyproject.toml").read_text())
    runtime = tomllib.loads((ROOT / "packaging" / "runtime" / "pyproject.toml").read_text())
    groups = configparser.ConfigParser(delimiters=("=",))
    groups.optionxform = str  # type: ignore[assignment,method-assign]  # entry point names keep their case
    groups.read_string(entry_points)
    assert dict(groups["console_scripts"]) == main["project"]["scripts"]
    for group, entries in main["project"]["entry-points"].items():
        assert dict(groups[group]) == entries, group
    data = main["tool"]["setuptools"]["package-data"]["torchdelegate"]
    assert runtime["tool"]["setuptools"]["package-data"]["torchdelegate"] == [f for f in data if f != "demo/weights.pt"]


def test_staging_refuses_a_directory_that_exists(tmp_path: Path) -> None:
    script = ROOT / "packaging" / "runtime" / "build_runtime.py"
    done = subprocess.run([sys.executable, str(script), "--stage", str(tmp_path)], capture_output=True, text=True)
    assert done.returncode == 2 and f"--stage {tmp_path}: it exists; give a new directory" in done.stderr


def _parsed(requirement: str) -> tuple[str, str | None]:
    """A Requires-Dist line's normalized name and the extra it is for (None: always)."""
    name = re.match(r"[A-Za-z0-9._-]+", requirement)
    extra = re.search(r"extra == \"([^\"]+)\"", requirement)
    assert name is not None, requirement
    return re.sub(r"[-_.]+", "-", name.group(0)).lower(), extra.group(1) if extra else None


def _build_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("build_runtime", ROOT / "packaging" / "runtime" / "build_runtime.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
