"""The machine cache: what a backend derives from a blob for this machine, kept between processes.

Some of the work a backend does when it loads a blob depends on the machine as well as the
blob (ONNX Runtime packs weights into the layout of this CPU's kernels), so lowering cannot
do it for every machine a file will run on, and the file cannot carry it without growing by
the weights' size. :meth:`Program.prepare` (``torchdelegate prepare FILE``) does that work
once on a machine and keeps the result here; a later load finds it by a key that covers
everything the result is made from (the blob and the bytes of every weight it reads), the
backend runtime's version and build, and this machine's CPU. The key takes the weights' digests
from the file's manifest, so a backend that finds an entry still checks the file's weights against
them (``NamedDataMap.reading(keys, unread=True)``, while the entry loads): a damaged file is refused
whichever cache is warm. Nothing is written here unless asked.

Entries live in the one store (``store.py``: where ``TORCHDELEGATE_CACHE`` puts it, how an entry is
published whole under a lock, its size bound shared with the compile cache), which must be a local
directory here: a backend maps these files. Each entry holds a signed record (``signed.json``,
``entry_signature.py``: the team's key, or unsigned where this user alone writes) of the key it was
made for, which covers the blob and its weights' digests, and of its files' sizes and digests: an
entry whose record is unsigned where a signature is needed, signed with another key, made for
another key, or whose files are not those it lists, is never used. The record is checked by
:func:`find_entry` (the files' digests too with ``verify=True``: ``prepare`` does, and writes a
refused entry again) and, while a backend loads an entry, the files' digests by :class:`EntryCheck`
on another thread. Deleting the directory, or any entry in it, is always safe: loads then do the
work again.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import subprocess
import sys
import threading
import warnings
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

from torchdelegate.cache.entry_files import EntryFiles
from torchdelegate.cache.entry_signature import EntrySigner, signer_for
from torchdelegate.cache.store import Store, StoreError
from torchdelegate.cache.store_settings import CACHE_VARIABLE, cache_location, max_bytes_setting, read_cap
from torchdelegate.serialize.bounded_json import bounded_json
from torchdelegate.serialize.container import canonical_json

_FORMAT = 3  # 3: entries hold their signed record
SIGNED = "signed.json"
_SIGNED_CAP = 1 << 20
_warned_locations: set[tuple[str, str]] = set()


def cache_directory() -> Path | None:
    """Where entries live (absolute), or None when the cache is off or at a URL (nothing to map there)."""
    location = cache_location()
    return None if location is None or "://" in location else Path(location)


def _store() -> Store:
    """The store, local: a ``ValueError`` saying how to turn it on, or that it must be a directory."""
    location = cache_location()
    if location is None:
        value = os.environ.get(CACHE_VARIABLE)
        raise ValueError(
            f"the machine cache is off ({CACHE_VARIABLE}={value!r}): set it to a directory to keep entries"
        )
    found = Store(location, name="machine cache")
    if not found.local:
        raise ValueError(
            f"the machine cache keeps files a backend maps: it needs a local directory, and {CACHE_VARIABLE} is "
            f"{location!r}; set it to a directory"
        )
    return found


@cache
def machine_identity() -> dict[str, str]:
    """What a derived form may depend on besides its source: the architecture, the CPU's make and features."""
    described = [platform.system(), platform.machine(), *_cpu_description()]
    return {"machine": platform.machine(), "cpu": hashlib.sha256("\n".join(described).encode()).hexdigest()[:32]}


def _cpu_description() -> list[str]:
    """The CPU's vendor, model and feature flags, as this system describes them."""
    fields = ("vendor_id", "cpu family", "model", "model name", "flags", "features", "cpu implementer", "cpu part")
    found: dict[str, str] = {}
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as cpuinfo:
            for line in cpuinfo:
                name, _, value = line.partition(":")
                name = name.strip().lower()
                if name in fields and name not in found:
                    found[name] = " ".join(sorted(value.split())) if "features" in name or name == "flags" else value
    if not found and sys.platform == "darwin":
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            query = ["sysctl", "-n", "machdep.cpu.brand_string", "machdep.cpu.features", "machdep.cpu.leaf7_features"]
            found["sysctl"] = subprocess.run(query, capture_output=True, text=True, timeout=10).stdout
    return [f"{name}: {value.strip()}" for name, value in sorted(found.items())] or [platform.processor()]


def entry_key(kind: str, content: dict[str, Any]) -> str:
    """The key of an entry derived from ``content`` (JSON values) on this machine."""
    described = {"format": _FORMAT, "kind": kind, "machine": machine_identity(), "content": content}
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()


def required_cache_directory() -> Path:
    """:func:`cache_directory`, where a caller needs one: a ``ValueError`` saying how to turn it on."""
    return Path(_store().location)


def entry_path(kind: str, key: str) -> Path:
    """Where the entry ``key`` of ``kind`` is (or would be); a ``ValueError`` when the cache is off."""
    return _store().local_place(kind, key)


def find_entry(kind: str, key: str, verify: bool = False, quiet: bool = False) -> Path | None:
    """The directory of a whole entry, or None: absent, cache off, or not what its manifest says (a
    warning, unless ``quiet``: the caller writes it again).

    ``verify``: also check every file's digest (reads the whole entry).
    """
    if cache_directory() is None:
        return None
    found = _store()
    place = found.local_place(kind, key)
    if not place.exists():
        return None
    why = found.problem(kind, key, verify=False)
    if why is None:
        signer = signer_for(found.location)
        record = _signed_record(found, signer, kind, key)
        if isinstance(record, _Refused):
            _say_refused(signer, str(record))
            return None
        why = record if isinstance(record, str) else _files_problem(found, kind, key, record) if verify else None
    if why is not None and not quiet:
        warnings.warn(
            f"the machine cache entry {place} is not used: {why}; `torchdelegate prepare FILE` writes it again",
            stacklevel=2,
        )
    if why is None:
        found.touch(kind, key)
    return None if why is not None else place


CHECKED_FILE = "checked-file"
"""Entries that say a program file, as it is on this machine (its identity), had every segment checked."""


def _checked_file_key(identity: list[Any]) -> str:
    return entry_key(CHECKED_FILE, {"files": identity})


def file_checked(identity: list[Any]) -> bool:
    """Whether ``prepare`` checked every byte of the file(s) of this identity (``ProgramFile.identity``):
    the same device and inode, unchanged since (size, modification and change times), the same header."""
    return find_entry(CHECKED_FILE, _checked_file_key(identity), quiet=True) is not None


def remember_checked(identity: list[Any], checked_from_ns: int) -> None:
    """Record that every segment of the file(s) of ``identity`` matched its checksum, in a check begun at
    ``checked_from_ns`` (``time.time_ns()``). Not recorded when a file changed too close to the check for
    its change time to tell a later write apart (a file system keeping whole seconds, or two)."""
    for file in identity:
        change = file[4]
        tick = 2_000_000_000 if change % 1_000_000_000 == 0 else 0
        if change + tick >= checked_from_ns:
            return
    key = _checked_file_key(identity)
    with entry_lock(CHECKED_FILE, key), new_entry(CHECKED_FILE, key) as scratch:
        (scratch / "files.json").write_text(json.dumps(identity))


class EntryCheck:
    """The digests of an entry's files, checked on another thread while a backend loads the entry."""

    def __init__(self, place: Path) -> None:
        self._place = place
        self._problem: str | None = None
        self._thread = threading.Thread(target=self._check, name="torchdelegate-entry-check", daemon=True)
        self._thread.start()

    def _check(self) -> None:
        try:
            found, kind, key = Store(self._place.parent.parent), self._place.parent.name, self._place.name
            self._problem = found.problem(kind, key, verify=False)
            if self._problem is None:
                record = _signed_record(found, signer_for(found.location), kind, key)
                if isinstance(record, _Refused):
                    self._problem = str(record)
                else:
                    self._problem = record if isinstance(record, str) else _files_problem(found, kind, key, record)
        except BaseException as e:  # whatever stops the check makes the entry unusable
            self._problem = f"it cannot be checked ({type(e).__name__}: {e})"

    def problem(self) -> str | None:
        """Wait for the check; why the entry must not be used, or None."""
        self._thread.join()
        return self._problem


@contextlib.contextmanager
def entry_lock(kind: str, key: str) -> Iterator[None]:
    """Held while one process makes an entry, so two that prepare one program at once do the work once."""
    found = _writable(kind)
    with found.lock(kind, key):
        yield


@contextlib.contextmanager
def new_entry(kind: str, key: str) -> Iterator[Path]:
    """A fresh directory to write an entry's files into; at the block's end it takes the entry's place,
    replacing an entry there (one ``find_entry`` refused), and the store is kept within its bound. If the
    block fails, nothing is left behind."""
    found = _writable(kind)
    with found.new_entry(kind, key) as scratch:
        yield scratch
        _sign(signer_for(found.location), kind, key, scratch)
    found.evict(max_bytes_setting())


class _Refused(str):
    """Why an entry's signature is not accepted here (said once per location, not per entry)."""


def _sign(signer: EntrySigner, kind: str, key: str, scratch: Path) -> None:
    """Write the entry's record: the key it was made for, its files' sizes and digests, signed."""
    files = {
        path.name: {"size": path.stat().st_size, "sha256": _digest(path)}
        for path in sorted(scratch.iterdir())
        if path.is_file() and path.name != SIGNED
    }
    record: dict[str, Any] = {"kind": kind, "key": key, "files": files}
    signature = signer.signature(kind, hashlib.sha256(canonical_json(record)).digest())
    (scratch / SIGNED).write_bytes(canonical_json({**record, "signature": signature.hex()}))


def _digest(path: Path) -> str:
    """The SHA-256 of a file this process just wrote, a chunk at a time."""
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(1 << 23):
            digest.update(chunk)
    return digest.hexdigest()


def _signed_record(found: Store, signer: EntrySigner, kind: str, key: str) -> dict[str, dict[str, Any]] | str:
    """The files an entry's signed record lists; else why the entry is not to be used (a ``_Refused``
    when its signature is not accepted here)."""
    if signer.key is None and signer.unsigned_refused is not None:
        return _Refused(signer.unsigned_refused)
    try:
        data = found.read(kind, key, SIGNED)
        record = bounded_json(data if data is not None else b"", _SIGNED_CAP)
        signature = bytes.fromhex(record.pop("signature"))
        files = record["files"]
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        return f"its signed record cannot be read ({type(e).__name__}: {e})"
    refusal = signer.problem(kind, hashlib.sha256(canonical_json(record)).digest(), signature)
    if refusal is not None:
        return _Refused(refusal)
    if record.get("kind") != kind or record.get("key") != key:
        return f"it was made for something else (its record names the key {str(record.get('key'))[:16]})"
    if not isinstance(files, dict) or not all(
        isinstance(r, dict) and isinstance(r.get("size"), int) and isinstance(r.get("sha256"), str)
        for r in files.values()
    ):
        return "its signed record of its files is malformed"
    return files


def _files_problem(found: Store, kind: str, key: str, files: dict[str, dict[str, Any]]) -> str | None:
    """Why an entry's files are not those its signed record lists (sizes and digests), or None."""
    reader = EntryFiles(found.location, None, read_cap)
    for name, record in sorted(files.items()):
        why = reader.problem(kind, key, name, record, verify=True)
        if why is not None:
            return f"its files are not those its signed record lists: {why}"
    return None


def _say_refused(signer: EntrySigner, why: str) -> None:
    """Warn once per process, location and reason that entries are refused for their signature, and what to do."""
    if (signer.location, why) in _warned_locations:
        return
    _warned_locations.add((signer.location, why))
    warnings.warn(
        f"machine cache: entries at {signer.location} are not used: {why}; loads do their work again, and "
        f"`torchdelegate prepare FILE` writes them again. {signer.advice()}",
        stacklevel=3,
    )


def entry_size(place: Path) -> int:
    """The bytes an entry's files take."""
    return sum(path.stat().st_size for path in place.iterdir() if path.is_file())


def _writable(kind: str) -> Store:
    """The store, its directory made: an ``OSError`` saying where and what to do when it cannot be."""
    found = _store()
    try:
        found.directory()
    except StoreError as e:
        where = f"{CACHE_VARIABLE}={os.environ[CACHE_VARIABLE]!r}" if CACHE_VARIABLE in os.environ else "the default"
        raise OSError(
            f"the machine cache cannot be written at {Path(found.location) / kind} ({where}): {e.reason}; "
            f"set {CACHE_VARIABLE} to a directory you can write"
        ) from e
    return found
