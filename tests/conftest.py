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
def _machine_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test's own machine cache (commands it starts inherit it): never the user's, nor another test's."""
    monkeypatch.setenv("TORCHDELEGATE_CACHE", str(tmp_path_factory.mktemp("machine-cache")))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The differential test's figures, from its report (it may have run in an xdist worker)."""
    for report in terminalreporter.stats.get("passed", []) + terminalreporter.stats.get("failed", []):
        for name, value in getattr(report, "user_properties", ()):
            if name == "differential":
                terminalreporter.write_line(str(value))
