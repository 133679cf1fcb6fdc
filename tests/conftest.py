import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(1, str(Path(__file__).parent.parent / "benchmarks"))  # stack.py: the benchmarks' model


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    differential = sys.modules.get("test_differential")
    if differential is not None and differential.SEEN["examples"]:
        terminalreporter.write_line(differential.summary())
