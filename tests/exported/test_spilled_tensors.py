"""Spilled tensors: values kept exactly, small ones left in memory, many tensors in few mappings (one
file descriptor per arena, not per tensor), and their pages not held once written."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from torchdelegate.exported.spilled_tensors import ARENA, SpilledTensors


def _open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="counts /proc/self/fd")
def test_many_spilled_tensors_keep_their_values_in_few_mappings() -> None:
    spilled = SpilledTensors()
    before = _open_descriptors()
    torch.manual_seed(0)
    originals = [torch.randn(512, 1024) for _ in range(200)]  # 2 MiB each: 400 MiB in all
    copies = [spilled.tensor(t) for t in originals]
    assert all(torch.equal(a, b) for a, b in zip(originals, copies, strict=True))
    assert all(b.data_ptr() != a.data_ptr() for a, b in zip(originals, copies, strict=True))
    arenas = -(-sum(t.nbytes for t in originals) // ARENA)
    assert _open_descriptors() - before <= arenas + 1
    small = torch.arange(10)
    assert spilled.tensor(small) is small
    array = np.arange(1 << 20, dtype=np.int32)
    assert np.array_equal(spilled.array(array), array)
    filled = spilled.empty((1024, 1024), torch.int8)
    filled[:] = 7
    assert int(filled.sum()) == 7 * 1024 * 1024


def test_a_disk_without_room_is_an_error_naming_the_directory_not_a_crash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Blocks are reserved before they are mapped: a full disk is an OSError that says where and
    what to do, where writing into the mapping would have killed the process with SIGBUS."""
    import shutil
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    more_than_free = shutil.disk_usage(tmp_path).free + (1 << 30)
    with pytest.raises(OSError, match=f"no room left in {tmp_path}.*point TMPDIR at a larger disk"):
        SpilledTensors().empty((more_than_free,), torch.uint8)
