"""A crafted reference blob cannot call anything but the operators a saved graph may call."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from crafted import lowered_with_blob, reference_calling

import torchdelegate as td
from torchdelegate.backends.reference import ReferencePartitioner


@pytest.mark.parametrize("target", ["builtins.eval", "torch.ops.aten.from_file.default", "os.system"])
def test_a_reference_blob_calling_an_operator_outside_the_allow_list_is_refused(tmp_path: Path, target: str) -> None:
    path = lowered_with_blob(ReferencePartitioner(), reference_calling(target), tmp_path / "x.tdp")
    with td.load(path) as program, pytest.raises(td.FormatError, match="not an operator a saved graph may call"):
        program.run("forward", torch.randn(2, 4))
