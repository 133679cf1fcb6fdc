"""A backend installed by entry point, in a distribution of its own, is named on the command line
like a shipped one: it proposes its partitioner, lowers, and the file runs through the entry point."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
from backends_for_tests import installed_distribution

_PACKAGE = """
from torchdelegate.backends.reference import ReferenceBackend, reference_support
from torchdelegate.delegate.specs import DelegationSpec
from torchdelegate.partition.capability import CapabilityPartitioner


class InstalledBackend(ReferenceBackend):
    backend_id = "installed_reference"

    @classmethod
    def partitioner(cls, compile_specs=None):
        return CapabilityPartitioner(reference_support, DelegationSpec(cls.backend_id, list(compile_specs or [])))
"""


def _distribution(root: Path) -> Path:
    return installed_distribution(root, "installed_backend_pkg", _PACKAGE, "installed_reference", "InstalledBackend")


def test_a_backend_installed_by_entry_point_is_named_with_backend_and_lowers(tmp_path: Path) -> None:
    site = _distribution(tmp_path / "site")
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    x = torch.randn(2, 4)
    torch.export.save(torch.export.export(model, (x,)), tmp_path / "model.pt2")
    np.save(tmp_path / "x.npy", x.numpy())
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "torchdelegate"]
    lowered = subprocess.run(
        [
            *command,
            "lower",
            f"forward={tmp_path / 'model.pt2'}",
            "-b",
            "installed_reference",
            "-o",
            str(tmp_path / "m.tdp"),
        ],
        capture_output=True,
        text=True,
        env=env,
    )
    assert lowered.returncode == 0, lowered.stderr
    assert "installed_reference" in lowered.stdout
    ran = subprocess.run(
        [
            *command,
            "run",
            str(tmp_path / "m.tdp"),
            "--input",
            str(tmp_path / "x.npy"),
            "--save",
            str(tmp_path / "y.npz"),
        ],
        capture_output=True,
        text=True,
        env=env,
    )
    assert ran.returncode == 0, ran.stderr
    with torch.no_grad():
        expected = model(x).numpy()
    np.testing.assert_allclose(np.load(tmp_path / "y.npz")["output_0"], expected, rtol=1e-6, atol=1e-6)
