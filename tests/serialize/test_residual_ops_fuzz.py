"""The operators a saved graph may call, over crafted graphs with hostile arguments: no crash, and
no output that depends on the memory around the inputs (fuzz/residual_ops.py; `make fuzz` runs it
under atheris for longer)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

FUZZ = Path(__file__).parent.parent.parent / "fuzz" / "residual_ops.py"


@pytest.mark.parametrize("seed", [0])
def test_crafted_graphs_over_the_allowed_operators_read_only_their_inputs(seed: int) -> None:
    """Run in a process of its own: a crash fails the test instead of ending the test run."""
    done = subprocess.run(
        [sys.executable, "-W", "ignore", str(FUZZ), "--runs", "300", "--seed", str(seed)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stderr[-3000:]}"
    assert done.stdout.strip().startswith("300 graphs: "), done.stdout


def test_the_harness_finds_a_read_outside_the_inputs() -> None:
    """Without its contract, as_strided reads past its input: the harness must say so."""
    script = f"""
import sys
sys.path.insert(0, {str(FUZZ.parent)!r})
import residual_ops, torch
from torchdelegate.serialize import operator_contracts
residual_ops.bounded_process()
residual_ops.OPERATORS = [torch.ops.aten.as_strided.default]
operator_contracts._CONTRACTS.pop(torch.ops.aten.as_strided.default)
import random
generator, found = random.Random(0), 0
for _ in range(200):
    try:
        residual_ops.check_one(generator.randbytes(64))
    except residual_ops.ReadOutside:
        found += 1
print(found)
"""
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert int(done.stdout.strip().splitlines()[-1]) > 0
