"""Prepared models planted in the machine cache by whoever can write it: a FIFO, a link to /dev/zero or
out of the cache, a manifest that lies about a size. Neither a load nor `prepare` (which `llm serve` runs
before it starts) hangs or reads without bound: the entry is skipped with one warning naming it and what
is wrong, the program computes what it would without the cache, and `prepare` writes the entry again."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import torchdelegate as td

pytest.importorskip("onnxruntime")
from torchdelegate.backends.onnxruntime import OnnxRuntimePartitioner  # noqa: E402

pytestmark = [pytest.mark.timeout(60), pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")]
FAST = 20.0  # seconds: a load, or a prepare, takes ~1 s here


def _prepared(path: Path) -> tuple[torch.nn.Module, torch.Tensor, Path]:
    """A model of two Linear(256) lowered to ONNX Runtime, saved at ``path`` and prepared: the model,
    an input, and the machine cache entry of its prepared model."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256)).eval()
    x = torch.randn(4, 256)
    td.to_edge(torch.export.export(model, (x,))).to_backend(OnnxRuntimePartitioner()).save(path)
    with td.load(path) as program:
        (line,) = program.prepare()
    return model, x, Path(line.rpartition(" in ")[2])


def _run(path: Path, x: torch.Tensor) -> tuple[torch.Tensor, list[str]]:
    """What a fresh load of ``path`` computes, and every warning it gave (each, however often repeated)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with td.load(path) as program:
            output = program.run("forward", x)
    return output, [str(w.message) for w in caught]


def _record(folder: Path, name: str, size: int, digest: str) -> None:
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["files"][name] = {"size": size, "sha256": digest}
    (folder / "manifest.json").write_text(json.dumps(manifest))


def _planted_empty(folder: Path, name: str, plant: Callable[[Path], None]) -> None:
    """``name`` replaced by what ``plant`` makes, the manifest recording it as the empty file it seems."""
    (folder / name).unlink()
    plant(folder / name)
    _record(folder, name, 0, hashlib.sha256(b"").hexdigest())


def _manifest_says_less(folder: Path) -> None:
    size = (folder / "model.onnx").stat().st_size
    _record(folder, "model.onnx", size - 7, hashlib.sha256((folder / "model.onnx").read_bytes()[:-7]).hexdigest())


def _fifo_manifest(folder: Path) -> None:
    (folder / "manifest.json").unlink()
    os.mkfifo(folder / "manifest.json")


def _model_linked_out(folder: Path) -> None:
    outside = folder.parent.parent.parent / f"outside-{folder.name[:8]}.onnx"
    shutil.copyfile(folder / "model.onnx", outside)  # the very model, but not in the cache
    (folder / "model.onnx").unlink()
    (folder / "model.onnx").symlink_to(outside)


PLANTED: dict[str, tuple[Callable[[Path], None], str]] = {
    "a FIFO as the manifest": (_fifo_manifest, "'manifest.json' is a FIFO, not a regular file"),
    "a FIFO as the model, recorded empty": (
        lambda f: _planted_empty(f, "model.onnx", os.mkfifo),
        "'model.onnx' is a FIFO, not a regular file",
    ),
    "the model linked out of the cache": (_model_linked_out, "'model.onnx' is a symbolic link"),
    "the weights linked to /dev/zero, recorded empty": (
        lambda f: _planted_empty(f, "weights.data", lambda p: p.symlink_to("/dev/zero")),
        "'weights.data' is a symbolic link",
    ),
    "a manifest recording less than the model": (_manifest_says_less, r"'model.onnx' is missing or not \d+ bytes \(it"),
}


@pytest.mark.parametrize("planted", sorted(PLANTED))
def test_a_load_and_prepare_skip_a_planted_prepared_model_with_one_warning(
    planted: str, cache_directory: Path, tmp_path: Path
) -> None:
    model, x, place = _prepared(tmp_path / "m.tdp")
    assert {"manifest.json", "model.onnx", "weights.data"} <= {p.name for p in place.iterdir()}
    plant, problem = PLANTED[planted]
    plant(place)
    started = time.monotonic()
    output, warned = _run(tmp_path / "m.tdp", x)
    assert time.monotonic() - started < FAST
    (about,) = [w for w in warned if str(place) in w]
    assert "is not used" in about and re.search(problem, about), about
    with torch.no_grad():
        torch.testing.assert_close(output, model(x), atol=1e-4, rtol=1e-4)
    started = time.monotonic()
    with td.load(tmp_path / "m.tdp") as program:
        (line,) = program.prepare()  # what `llm serve` runs before it starts: the entry written again
    assert time.monotonic() - started < FAST and line.endswith(f" in {place}")
    assert all(not p.is_symlink() and p.is_file() for p in place.iterdir())
    again, warned = _run(tmp_path / "m.tdp", x)
    assert not [w for w in warned if str(place) in w] and torch.equal(again, output)
