from __future__ import annotations

import hashlib
import json
import threading
import time
from pathlib import Path

import pytest

from torchdelegate.cache import machine_cache
from torchdelegate.cache.machine_cache import (
    EntryCheck,
    cache_directory,
    entry_key,
    entry_lock,
    find_entry,
    machine_identity,
    new_entry,
)

pytestmark = pytest.mark.usefixtures("cache_directory")


def test_the_directory_is_the_environments_or_the_users_cache_and_off_means_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCHDELEGATE_CACHE", str(tmp_path / "mine"))
    assert cache_directory() == tmp_path / "mine"
    for off in ("off", "OFF", "0", "no", "false", " none "):
        monkeypatch.setenv("TORCHDELEGATE_CACHE", off)
        assert cache_directory() is None
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TORCHDELEGATE_CACHE", "relative")
    assert cache_directory() == tmp_path / "relative"  # the same wherever the program is run from later
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    for unset in ("", None):
        if unset is None:
            monkeypatch.delenv("TORCHDELEGATE_CACHE")
        else:
            monkeypatch.setenv("TORCHDELEGATE_CACHE", unset)
        assert cache_directory() == tmp_path / "xdg" / "torchdelegate"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_directory() == tmp_path / "home" / ".cache" / "torchdelegate"


def test_a_key_covers_the_kind_the_content_and_this_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    key = entry_key("kind", {"model": "a", "version": "1"})
    assert key == entry_key("kind", {"version": "1", "model": "a"})  # order of the content's keys: no matter
    assert key != entry_key("other", {"model": "a", "version": "1"})
    assert key != entry_key("kind", {"model": "b", "version": "1"})
    assert set(machine_identity()) == {"machine", "cpu"}
    monkeypatch.setattr(machine_cache, "machine_identity", lambda: {"machine": "x86_64", "cpu": "another"})
    assert key != entry_key("kind", {"model": "a", "version": "1"})


def test_an_entry_is_found_whole_or_not_at_all() -> None:
    key = entry_key("test-whole", {"n": 1})
    assert find_entry("test-whole", key) is None
    with pytest.raises(RuntimeError, match="failed"), new_entry("test-whole", key) as scratch:
        (scratch / "data.bin").write_bytes(b"half")
        raise RuntimeError("the writer failed")
    assert find_entry("test-whole", key) is None
    root = cache_directory()
    assert root is not None and list((root / "test-whole").iterdir()) == []  # nothing left behind
    with new_entry("test-whole", key) as scratch:
        (scratch / "data.bin").write_bytes(b"whole")
        assert find_entry("test-whole", key) is None  # not before the block's end
    place = find_entry("test-whole", key)
    assert place is not None and (place / "data.bin").read_bytes() == b"whole"
    manifest = json.loads((place / "manifest.json").read_text())
    record = {"size": 5, "sha256": hashlib.sha256(b"whole").hexdigest()}
    assert manifest["files"]["data.bin"] == record and sorted(manifest["files"]) == ["data.bin", "signed.json"]
    assert json.loads((place / "signed.json").read_text())["files"] == {"data.bin": record}


def test_an_entry_whose_files_differ_from_its_manifest_is_not_used_and_can_be_written_again() -> None:
    key = entry_key("test-damaged", {"n": 1})
    with new_entry("test-damaged", key) as scratch:
        (scratch / "data.bin").write_bytes(b"0123456789")
    place = find_entry("test-damaged", key)
    assert place is not None
    with open(place / "data.bin", "r+b") as data:
        data.truncate(4)
    with pytest.warns(UserWarning, match=r"not used: 'data.bin' is missing or not 10 bytes.*torchdelegate prepare"):
        assert find_entry("test-damaged", key) is None
    with new_entry("test-damaged", key) as scratch:
        (scratch / "data.bin").write_bytes(b"0123456789")
    assert find_entry("test-damaged", key, verify=True) == place
    assert sorted(path.name for path in place.parent.iterdir()) == [key]  # the damaged one replaced


def test_an_entry_damaged_at_its_size_is_found_by_its_digests() -> None:
    key = entry_key("test-digest", {"n": 1})
    with new_entry("test-digest", key) as scratch:
        (scratch / "data.bin").write_bytes(b"0123456789")
    place = find_entry("test-digest", key)
    assert place is not None and EntryCheck(place).problem() is None
    (place / "data.bin").write_bytes(b"0123456780")  # same size: only the digest tells
    assert find_entry("test-digest", key) == place  # sizes only: a load checks the digests meanwhile
    why = EntryCheck(place).problem()
    assert why == "its files are not those its signed record lists: 'data.bin' does not match its digest (damaged)"
    with pytest.warns(UserWarning, match="does not match its digest"):
        assert find_entry("test-digest", key, verify=True) is None


def test_processes_making_one_entry_take_turns() -> None:
    key = entry_key("test-lock", {"n": 1})
    order: list[str] = []
    held = threading.Event()

    def first() -> None:
        with entry_lock("test-lock", key):
            held.set()
            time.sleep(0.2)
            order.append("first done")

    def second() -> None:
        held.wait()
        with entry_lock("test-lock", key):
            order.append("second in")

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert order == ["first done", "second in"]


def test_a_cache_that_cannot_be_written_says_where_and_what_to_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("TORCHDELEGATE_CACHE", str(tmp_path / "a-file" / "cache"))
    message = r"at .*a-file/cache/kind \(TORCHDELEGATE_CACHE=.*\): .*a-file is a file, not a directory; set TORCHD"
    with pytest.raises(OSError, match=message), new_entry("kind", "k"):
        pass


def test_with_the_cache_off_nothing_is_found_and_writing_says_how_to_turn_it_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TORCHDELEGATE_CACHE", "off")
    assert find_entry("kind", entry_key("kind", {})) is None
    with pytest.raises(ValueError, match="machine cache is off.*set it to a directory"), new_entry("kind", "k"):
        pass
