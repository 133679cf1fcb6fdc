"""One store for both caches: one location rule, entries published whole, one size bound over every
kind (least recently used first), crash leftovers swept, and a command that shows and empties it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from torchdelegate.cache.compile_cache import ENTRIES, CompileCache
from torchdelegate.cache.machine_cache import cache_directory, entry_key, find_entry, new_entry
from torchdelegate.cache.store import Store, StoreError
from torchdelegate.compile.options import environment_cache


def _machine_entry(kind: str, size: int) -> Path:
    key = entry_key(kind, {"size": size})
    with new_entry(kind, key) as scratch:
        (scratch / "data.bin").write_bytes(b"m" * size)
    place = find_entry(kind, key)
    assert place is not None
    return place


def test_both_kinds_share_one_location_whatever_the_variable_says(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TORCHDELEGATE_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    compile_cache = environment_cache()
    assert (
        compile_cache is not None
        and Path(compile_cache.location) == cache_directory() == tmp_path / "xdg" / "torchdelegate"
    )
    monkeypatch.setenv("TORCHDELEGATE_CACHE", str(tmp_path / "mine"))
    compile_cache = environment_cache()
    assert compile_cache is not None and Path(compile_cache.location) == cache_directory() == tmp_path / "mine"
    monkeypatch.setenv("TORCHDELEGATE_CACHE", "off")
    assert environment_cache() is None and cache_directory() is None


def test_machine_entries_need_a_directory_and_compile_entries_take_a_url(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHDELEGATE_CACHE", "memory://torchdelegate-store-test")
    assert cache_directory() is None and find_entry("kind", "k") is None
    with pytest.raises(ValueError, match=r"needs a local directory, and TORCHDELEGATE_CACHE is 'memory://"):
        with new_entry("kind", "k"):
            pass
    store = Store("memory://torchdelegate-store-test")
    store.publish(ENTRIES, "ab" * 32, {"entry": b"compiled"})
    assert store.read(ENTRIES, "ab" * 32, "entry") == b"compiled"
    with pytest.raises(StoreError, match="need a local directory"):
        store.local_place("kind", "k")


@pytest.mark.usefixtures("cache_directory")
def test_one_bound_covers_every_kind_least_recently_used_first() -> None:
    store = Store(os.environ["TORCHDELEGATE_CACHE"])
    old = _machine_entry("machine-kind", 4000)
    os.utime(old, (1000, 1000))
    store.publish(ENTRIES, "cd" * 32, {"entry": b"c" * 3000})
    newer = _machine_entry("machine-kind", 2000)
    assert {e.kind for e in store.entries()} == {ENTRIES, "machine-kind"}
    freed = store.evict(6000)
    assert freed >= 4000 and not old.exists()  # the machine entry used longest ago went first
    assert newer.exists() and store.read(ENTRIES, "cd" * 32, "entry") == b"c" * 3000


@pytest.mark.usefixtures("cache_directory")
def test_what_a_crashed_writer_left_is_swept_and_a_damaged_entry_is_not_read() -> None:
    store = Store(os.environ["TORCHDELEGATE_CACHE"])
    left = store.directory() / "machine-kind" / ".0123.abcdef.partial"
    left.mkdir(parents=True)
    (left / "data.bin").write_bytes(b"x" * 10)
    assert [e.whole for e in store.entries("machine-kind")] == [False]
    assert store.evict(1 << 30) == 0 and left.exists()  # perhaps still being written
    os.utime(left / "data.bin", (time.time() - 7200,) * 2)
    assert store.evict(1 << 30) == 10 and not left.exists()
    store.publish(ENTRIES, "ef" * 32, {"entry": b"0123456789"})
    (store.directory() / ENTRIES / ("ef" * 32) / "entry").write_bytes(b"0123456780")
    with pytest.raises(ValueError, match="does not match its manifest"):
        store.read(ENTRIES, "ef" * 32, "entry")


def test_the_command_shows_and_empties_the_cache_by_kind(cache_directory: Path) -> None:
    _machine_entry("onnxruntime", 100)
    CompileCache(cache_directory).store.publish(ENTRIES, "12" * 32, {"entry": b"c" * 50})

    def command(*args: str) -> str:
        done = subprocess.run([sys.executable, "-m", "torchdelegate", "cache", *args], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        return done.stdout

    shown = command("info")
    assert f"{cache_directory}: " in shown and "of at most 17.2 GB" in shown
    assert "  compile: 1 entries" in shown and "  onnxruntime: 1 entries" in shown
    assert "removed compile entries" in command("clear", "--kind", "compile")
    shown = command("info")
    assert "  compile: 0 entries" in shown and "  onnxruntime: 1 entries" in shown
    assert "removed every entry" in command("clear")
    assert "  onnxruntime: 0 entries" in command("info")


@pytest.mark.usefixtures("cache_directory")
def test_a_manifest_past_its_cap_and_a_file_past_twice_the_bound_are_never_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    store = Store(os.environ["TORCHDELEGATE_CACHE"])
    store.publish(ENTRIES, "01" * 32, {"entry": b"e" * 4000})
    manifest = store.directory() / ENTRIES / ("01" * 32) / "manifest.json"
    manifest.write_bytes(manifest.read_bytes() + b" " * (1 << 20))  # still a valid manifest, in 1 MiB of blanks
    with pytest.raises(ValueError, match=r"its manifest is \d+ bytes, more than a manifest may be \(1048576\)"):
        store.read(ENTRIES, "01" * 32, "entry")
    assert store.read(ENTRIES, "01" * 32, "entry") is None  # said once: then a miss
    store.publish(ENTRIES, "02" * 32, {"entry": b"e" * 4000})
    monkeypatch.setenv("TORCHDELEGATE_CACHE_MAX_BYTES", "1000")
    with pytest.raises(ValueError, match=r"gives 'entry' 4000 bytes, more than the cache reads in one file \(2000\)"):
        store.read(ENTRIES, "02" * 32, "entry")
    monkeypatch.setenv("TORCHDELEGATE_CACHE_MAX_BYTES", "2000")
    assert store.read(ENTRIES, "02" * 32, "entry") == b"e" * 4000


def test_at_a_url_an_object_past_its_record_or_its_cap_is_never_read() -> None:
    import fsspec

    store = Store("memory://torchdelegate-store-bounds")
    store.publish(ENTRIES, "03" * 32, {"entry": b"e" * 100})
    place = store.entry_place(ENTRIES, "03" * 32)
    memory = fsspec.filesystem("memory")
    memory.pipe_file(f"{place}/entry", b"e" * 200)
    with pytest.raises(ValueError, match=r"'entry' is missing or not 100 bytes \(it has 200\)"):
        store.read(ENTRIES, "03" * 32, "entry")
    memory.pipe_file(f"{place}/manifest.json", b" " * (1 << 20) + b"{}")
    assert store.problem(ENTRIES, "03" * 32, verify=False) == (
        "its manifest is 1048578 bytes, more than a manifest may be (1048576)"
    )
