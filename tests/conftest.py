import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(1, str(Path(__file__).parent.parent / "benchmarks"))  # stack.py: the benchmarks' model


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _no_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """No test (nor a command it starts) uses a cache unless it asks for one: never the user's."""
    monkeypatch.setenv("TORCHDELEGATE_CACHE", "off")


@pytest.fixture(autouse=True)
def _sleeping_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """ONNX Runtime's threads sleep between nodes: two test workers share the cores, where spinning
    threads (the default, for a machine a program has to itself) would wait on each other."""
    monkeypatch.setenv("TORCHDELEGATE_BACKEND_OPTIONS", "onnxruntime.intra_op_spinning=0")


@pytest.fixture
def cache_directory(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The test's own cache (both kinds; commands it starts inherit it), asked for by name."""
    place = tmp_path_factory.mktemp("cache")
    monkeypatch.setenv("TORCHDELEGATE_CACHE", str(place))
    return place


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The differential test's figures, from its report (it may have run in an xdist worker)."""
    for report in terminalreporter.stats.get("passed", []) + terminalreporter.stats.get("failed", []):
        for name, value in getattr(report, "user_properties", ()):
            if name == "differential":
                terminalreporter.write_line(str(value))
