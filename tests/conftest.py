import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(1, str(Path(__file__).parent.parent / "benchmarks"))  # stack.py: the benchmarks' model


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(autouse=True, scope="session")
def _machine_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The tests' own machine cache (commands they start inherit it): never the user's."""
    before = os.environ.get("TORCHDELEGATE_CACHE")
    os.environ["TORCHDELEGATE_CACHE"] = str(tmp_path_factory.mktemp("machine-cache"))
    yield
    if before is None:
        del os.environ["TORCHDELEGATE_CACHE"]
    else:
        os.environ["TORCHDELEGATE_CACHE"] = before


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The differential test's figures, from its report (it may have run in an xdist worker)."""
    for report in terminalreporter.stats.get("passed", []) + terminalreporter.stats.get("failed", []):
        for name, value in getattr(report, "user_properties", ()):
            if name == "differential":
                terminalreporter.write_line(str(value))
