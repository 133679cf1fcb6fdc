"""The public names where torch cannot be imported (the torchdelegate-runtime install): loading needs
none; a name that needs it, the lowering API's first, says so in one line with what to install."""

from __future__ import annotations

import subprocess
import sys

WITHOUT_TORCH = """
import importlib.abc, sys


class _NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "torch":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, _NotInstalled())
import torchdelegate

assert callable(torchdelegate.load) and torchdelegate.Program is not None
try:
    torchdelegate.to_edge_transform_and_lower
except ImportError as e:
    print(type(e).__name__, isinstance(e, torchdelegate.TorchDelegateError))
    print(e)
"""


def test_lowering_where_torch_cannot_be_imported_says_to_install_the_full_distribution() -> None:
    done = subprocess.run([sys.executable, "-c", WITHOUT_TORCH], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "TorchRequiredError True",
        "torchdelegate.to_edge_transform_and_lower needs torch, which cannot be imported here (No module named "
        "'torch'): pip install torchdelegate (the full distribution; torchdelegate-runtime only runs files)",
    ]
