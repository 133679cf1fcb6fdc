"""Processes where libraries cannot be imported, as where they are not installed: a ``sitecustomize.py``
on the path of every Python process started with :func:`blocked_environment` (workers included)."""

from __future__ import annotations

import os
from pathlib import Path

BLOCKED = "TORCHDELEGATE_TEST_BLOCKED"
SITECUSTOMIZE = f'''
import importlib.abc, os, sys

_BLOCKED = set(os.environ.get("{BLOCKED}", "").split(","))


class _NotInstalled(importlib.abc.MetaPathFinder):
    """Imports of the blocked libraries fail as they would where those are not installed."""

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in _BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None


sys.meta_path.insert(0, _NotInstalled())
'''


def blocking_site(directory: Path) -> Path:
    """``directory`` holding the ``sitecustomize.py`` that blocks what :data:`BLOCKED` names."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return directory


def blocked_environment(site: Path, blocked: str = "torch,transformers") -> dict[str, str]:
    """This process's environment, with the blocker of ``site`` on the path of every process started in it."""
    return {**os.environ, "PYTHONPATH": str(site), BLOCKED: blocked}
