"""Entries planted by whoever can write the cache: a FIFO, a link to /dev/zero or out of the cache, a
manifest that lies about a size. None hangs or exhausts memory anywhere the cache is read (a lowering's
look-up, eviction, `cache info` and `cache clear`); each is skipped with one warning naming the entry and
what is wrong, and the answer is what it would have been without the cache."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import torchdelegate as td
from torchdelegate.backends.reference import ReferencePartitioner
from torchdelegate.cache.compile_cache import ENTRIES
from torchdelegate.cache.store import Store

pytestmark = [pytest.mark.timeout(60), pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")]
FAST = 20.0  # seconds: what a lowering, a command or an eviction may take here (each takes ~1-4 s)


class Small(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * 2 + 1


INPUT = (torch.randn(2, 8),)


def _lowered(rows: int = 2) -> tuple[list[str | None], torch.Tensor, list[warnings.WarningMessage]]:
    """Small lowered on the reference backend through TORCHDELEGATE_CACHE: the cache's answers, what
    the lowered program computes, and every warning (each one, however often it is repeated)."""
    torch.manual_seed(0)
    model = Small()
    program = torch.export.export(model, (torch.randn(rows, 8),))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lowered = td.to_edge_transform_and_lower(program, partitioner=[ReferencePartitioner()])
    answers = [d.meta["compile_cache"] for d in lowered.delegates()["forward"]]
    x = torch.randn(rows, 8)
    output = lowered.exported_program().module()(x)
    torch.testing.assert_close(output, model(x))
    return answers, output, list(caught)


def _about(caught: list[warnings.WarningMessage], place: Path) -> list[str]:
    return [str(w.message) for w in caught if str(place) in str(w.message)]


def _entry_folder(cache: Path) -> Path:
    (entry,) = (cache / "compile").glob("*/entry")
    return entry.parent


def _fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def _link_to_zero(path: Path) -> None:
    path.unlink()
    path.symlink_to("/dev/zero")


def _manifest_says_less(folder: Path) -> None:
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["files"]["entry"]["size"] -= 7
    (folder / "manifest.json").write_text(json.dumps(manifest))


PLANTED: dict[str, tuple[Callable[[Path], None], str]] = {
    "a FIFO as the manifest": (lambda f: _fifo(f / "manifest.json"), "'manifest.json' is a FIFO, not a regular file"),
    "a FIFO as the data": (lambda f: _fifo(f / "entry"), "'entry' is a FIFO, not a regular file"),
    "the data linked to /dev/zero": (lambda f: _link_to_zero(f / "entry"), "'entry' is a symbolic link"),
    "the manifest linked to /dev/zero": (lambda f: _link_to_zero(f / "manifest.json"), "'manifest.json' is a symbolic"),
    "a manifest recording less than the file": (_manifest_says_less, r"'entry' is missing or not \d+ bytes \(it has"),
}


@pytest.mark.parametrize("planted", sorted(PLANTED))
def test_a_lowering_skips_a_planted_entry_with_one_warning_and_compiles_it_again(
    planted: str, cache_directory: Path
) -> None:
    answers, expected, _ = _lowered()
    assert answers == ["miss"]
    folder = _entry_folder(cache_directory)
    plant, problem = PLANTED[planted]
    plant(folder)
    started = time.monotonic()
    answers, output, caught = _lowered()
    assert time.monotonic() - started < FAST
    (warned,) = _about(caught, folder)
    assert "is not used" in warned and re.search(problem, warned), warned
    assert answers == ["miss"] and torch.equal(output, expected)
    assert _lowered()[0] == ["hit"]  # the entry written again, whole


def test_a_lowering_never_reads_an_entry_through_a_link_out_of_the_cache(cache_directory: Path, tmp_path: Path) -> None:
    _lowered()
    folder = _entry_folder(cache_directory)
    outside = tmp_path / "outside"
    shutil.copytree(folder, outside)  # a whole entry, but not in the cache
    (folder / "entry").unlink()
    (folder / "entry").symlink_to(outside / "entry")
    answers, _, caught = _lowered()
    (warned,) = _about(caught, folder)
    assert "'entry' is a symbolic link" in warned
    assert answers == ["miss"] and (outside / "entry").exists()
    shutil.rmtree(folder)
    folder.symlink_to(outside, target_is_directory=True)  # the entry's own folder a link out
    answers, _, caught = _lowered()
    (warned,) = _about(caught, folder)
    assert f"'{folder.name}' is a symbolic link" in warned
    assert answers == ["miss"] and (outside / "entry").exists() and not folder.is_symlink()


def test_eviction_after_a_miss_removes_a_planted_entry_of_another_key_with_one_warning(cache_directory: Path) -> None:
    _lowered(rows=1)
    other = _entry_folder(cache_directory)
    _fifo(other / "manifest.json")  # under another key: eviction, after any miss, reads every manifest
    started = time.monotonic()
    answers, _, caught = _lowered(rows=3)
    assert time.monotonic() - started < FAST
    (warned,) = _about(caught, other)
    assert "is damaged ('manifest.json' is a FIFO, not a regular file); removed" in warned
    assert answers == ["miss"] and not other.exists()


def test_eviction_removes_a_link_in_an_entrys_place_and_never_what_it_names(
    cache_directory: Path, tmp_path: Path
) -> None:
    _lowered(rows=1)
    outside = tmp_path / "outside"
    (outside / "keep").mkdir(parents=True)
    (outside / "keep" / "data").write_bytes(b"not the cache's")
    old = time.time() - 7200
    os.utime(outside / "keep", (old, old))  # older than a crash's leftovers: what eviction sweeps
    (cache_directory / "compile" / ("ab" * 32)).symlink_to(outside, target_is_directory=True)
    (cache_directory / "machine-kind").symlink_to(outside, target_is_directory=True)  # a kind's folder a link
    answers, _, caught = _lowered(rows=3)
    assert answers == ["miss"]
    assert len(_about(caught, cache_directory / "compile" / ("ab" * 32))) == 1
    assert (outside / "keep" / "data").read_bytes() == b"not the cache's"
    assert not (cache_directory / "compile" / ("ab" * 32)).is_symlink()


def _command(*args: str) -> subprocess.CompletedProcess[str]:
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "torchdelegate", "cache", *args], capture_output=True, text=True, timeout=50
    )
    assert done.returncode == 0, done.stderr
    assert time.monotonic() - started < FAST
    return done


def test_cache_info_and_clear_name_each_planted_entry_once_and_clear_only_the_cache(
    cache_directory: Path, tmp_path: Path
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_bytes(b"x" * 1000)
    store = Store(cache_directory)
    for number, (plant, _) in enumerate(PLANTED.values()):
        store.publish(ENTRIES, f"{number:02d}" * 32, {"entry": b"compiled" * 100})
        plant(cache_directory / ENTRIES / (f"{number:02d}" * 32))
    (cache_directory / "compile" / ("cd" * 32)).symlink_to(outside, target_is_directory=True)
    planted = sorted(p for p in (cache_directory / "compile").iterdir() if not p.name.startswith("."))
    assert len(planted) == len(PLANTED) + 1
    shown = _command("info")
    warned = [line for line in shown.stderr.splitlines() if "torchdelegate: warning:" in line]
    assert len(warned) == len(planted), shown.stderr
    for place in planted:
        (line,) = [w for w in warned if str(place) in w]
        assert "is damaged (" in line and "torchdelegate cache clear` removes it" in line
    assert f"  compile: {len(planted)} entries" in shown.stdout and f"{len(planted)} damaged" in shown.stdout
    cleared = _command("clear")
    assert sum("is damaged (" in line for line in cleared.stderr.splitlines()) == len(planted), cleared.stderr
    assert [p for p in (cache_directory / "compile").iterdir() if not p.name.endswith(".lock")] == []
    assert (outside / "precious").read_bytes() == b"x" * 1000
