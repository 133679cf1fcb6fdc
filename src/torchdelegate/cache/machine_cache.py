"""The machine cache: what a backend derives from a blob for this machine, kept between processes.

Some of the work a backend does when it loads a blob depends on the machine as well as the
blob (ONNX Runtime packs weights into the layout of this CPU's kernels), so lowering cannot
do it for every machine a file will run on, and the file cannot carry it without growing by
the weights' size. :meth:`Program.prepare` (``torchdelegate prepare FILE``) does that work
once on a machine and keeps the result here; a later load finds it by a key that covers
everything the result is made from (the blob and the bytes of every weight it reads), the
backend runtime's version and build, and this machine's CPU. Nothing is written here unless
asked.

The directory is ``TORCHDELEGATE_CACHE`` if set (a relative path is taken from the current
directory; ``off``, ``0``, ``no``, ``false`` or ``none``: no cache), else
``$XDG_CACHE_HOME/torchdelegate``, else ``~/.cache/torchdelegate``. An entry is a directory
under its kind, named by its key, with a manifest of its files' sizes and SHA-256 digests. It
is written whole beside its place, flushed to disk, and renamed into it, so a reader sees a
whole entry or none. An entry whose files do not match their sizes is never used; their
digests are checked by :func:`find_entry` with ``verify=True`` (``prepare`` does, and writes a
damaged entry again) and, while a backend loads an entry, by :class:`EntryCheck` on another
thread. Deleting the directory, or any entry in it, is always safe: loads then do the work again.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import warnings
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

CACHE_VARIABLE = "TORCHDELEGATE_CACHE"
_OFF = ("off", "0", "none", "false", "no")
_MANIFEST = "manifest.json"
_FORMAT = 2
_CHUNK = 1 << 23


def turned_off(value: str) -> bool:
    """Whether a cache setting (``TORCHDELEGATE_CACHE``, ``--cache``) turns the cache off."""
    return value.strip().lower() in _OFF


def cache_setting() -> str | None:
    """``TORCHDELEGATE_CACHE`` as set ("" when unset), or None when it turns the caches off."""
    chosen = os.environ.get(CACHE_VARIABLE, "").strip()
    return None if turned_off(chosen) else chosen


def cache_directory() -> Path | None:
    """Where entries live (absolute), or None when the cache is turned off."""
    chosen = cache_setting()
    if chosen is None:
        return None
    if chosen:
        return Path(chosen).expanduser().absolute()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base).absolute() / "torchdelegate"


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
    root = cache_directory()
    if root is None:
        value = os.environ.get(CACHE_VARIABLE)
        raise ValueError(
            f"the machine cache is off ({CACHE_VARIABLE}={value!r}): set it to a directory to keep entries"
        )
    return root


def entry_path(kind: str, key: str) -> Path:
    """Where the entry ``key`` of ``kind`` is (or would be); a ``ValueError`` when the cache is off."""
    return required_cache_directory() / kind / key


def find_entry(kind: str, key: str, verify: bool = False, quiet: bool = False) -> Path | None:
    """The directory of a whole entry, or None: absent, cache off, or not what its manifest says (a
    warning, unless ``quiet``: the caller writes it again).

    ``verify``: also check every file's digest (reads the whole entry).
    """
    if cache_directory() is None:
        return None
    place = entry_path(kind, key)
    if not place.exists():
        return None
    why = _unusable(place, verify)
    if why is not None and not quiet:
        warnings.warn(
            f"the machine cache entry {place} is not used: {why}; `torchdelegate prepare FILE` writes it again",
            stacklevel=2,
        )
    return None if why is not None else place


def _manifest(place: Path) -> dict[str, dict[str, Any]]:
    """An entry's files: name -> {"size", "sha256"}; a ``ValueError`` saying what is wrong with it."""
    try:
        manifest = json.loads((place / _MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"its manifest cannot be read ({e})") from e
    files = manifest.get("files") if isinstance(manifest, dict) and manifest.get("format") == _FORMAT else None
    if not isinstance(files, dict) or not files:
        raise ValueError("its manifest lists no files")
    for name, record in files.items():
        if os.path.basename(name) != name or name == _MANIFEST:
            raise ValueError(f"its manifest names {name!r}")
        if not (isinstance(record, dict) and isinstance(record.get("size"), int) and record.get("sha256")):
            raise ValueError(f"its manifest's record of {name!r} is not a size and a digest")
    return files


def _unusable(place: Path, verify: bool) -> str | None:
    """Why an entry's directory cannot be used, or None."""
    try:
        files = _manifest(place)
    except ValueError as e:
        return str(e)
    for name, record in sorted(files.items()):
        path = place / name
        if not path.is_file() or path.stat().st_size != record["size"]:
            return f"{name!r} is missing or not {record['size']} bytes"
        if verify and _file_digest(path) != record["sha256"]:
            return f"{name!r} does not match its digest (damaged)"
    return None


def _file_digest(path: Path) -> str:
    """The SHA-256 of a file, read in chunks (through the page cache: nothing stays mapped)."""
    digest = hashlib.sha256()
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as file:
        while count := file.readinto(buffer):
            digest.update(view[:count])
    return digest.hexdigest()


class EntryCheck:
    """The digests of an entry's files, checked on another thread while a backend loads the entry."""

    def __init__(self, place: Path) -> None:
        self._place = place
        self._problem: str | None = None
        self._thread = threading.Thread(target=self._check, name="torchdelegate-entry-check", daemon=True)
        self._thread.start()

    def _check(self) -> None:
        try:
            self._problem = _unusable(self._place, verify=True)
        except BaseException as e:  # whatever stops the check makes the entry unusable
            self._problem = f"it cannot be checked ({type(e).__name__}: {e})"

    def problem(self) -> str | None:
        """Wait for the check; why the entry must not be used, or None."""
        self._thread.join()
        return self._problem


@contextlib.contextmanager
def entry_lock(kind: str, key: str) -> Iterator[None]:
    """Held while one process makes an entry, so two that prepare one program at once do the work once."""
    place = entry_path(kind, key)
    _directory(place.parent)
    try:
        import fcntl
    except ImportError:  # not POSIX: two writers each write a whole entry, and one of them stays
        yield
        return
    with open(place.parent / f".{key}.lock", "a+b") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


@contextlib.contextmanager
def new_entry(kind: str, key: str) -> Iterator[Path]:
    """A fresh directory to write an entry's files into; at the block's end it takes the entry's place,
    replacing an entry there (one ``find_entry`` refused). If the block fails, nothing is left behind."""
    place = entry_path(kind, key)
    _directory(place.parent)
    scratch = Path(tempfile.mkdtemp(prefix=f".{key[:16]}.", suffix=".partial", dir=place.parent))
    try:
        yield scratch
        files = {}
        for path in sorted(scratch.iterdir()):
            if path.is_file():
                _flush(path)
                files[path.name] = {"size": path.stat().st_size, "sha256": _file_digest(path)}
        manifest = json.dumps({"format": _FORMAT, "files": files}, sort_keys=True)
        (scratch / _MANIFEST).write_text(manifest, encoding="utf-8")
        _flush(scratch / _MANIFEST)
        _flush(scratch)
        if place.exists():
            shutil.rmtree(place)
        os.rename(scratch, place)
        _flush(place.parent)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def entry_size(place: Path) -> int:
    """The bytes an entry's files take."""
    return sum(path.stat().st_size for path in place.iterdir() if path.is_file())


def _directory(path: Path) -> None:
    """``path`` made if missing (the cache's own directories readable by the user only)."""
    failure: OSError | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        path.mkdir(exist_ok=True, mode=0o700)
    except OSError as e:
        failure = e
    if failure is None and os.access(path, os.W_OK | os.X_OK):
        return
    where = f"{CACHE_VARIABLE}={os.environ[CACHE_VARIABLE]!r}" if CACHE_VARIABLE in os.environ else "the default"
    blocking = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)
    why = f"{blocking} is a file, not a directory" if blocking is not None else "it is not writable"
    if blocking is None and failure is not None:
        why = failure.strerror or str(failure)
    raise OSError(
        f"the machine cache cannot be written at {path} ({where}): {why}; "
        f"set {CACHE_VARIABLE} to a directory you can write"
    ) from failure


def _flush(path: Path) -> None:
    """Have a file's (or a directory's) contents reach the disk before the entry is renamed into place."""
    with contextlib.suppress(OSError):  # some systems cannot open a directory to flush it
        descriptor = os.open(path, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)
