from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture(scope="session")  # one server for the worker that runs the serve tests (one xdist group)
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The `llm serve` the serve tests share (served.py says what it is), stopped by SIGTERM at the end."""
    from served import running_server

    yield from running_server(tmp_path_factory)
