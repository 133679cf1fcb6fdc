"""The one store both caches keep their entries in: content-addressed, published whole, bounded.

Where it is: ``TORCHDELEGATE_CACHE``, when set, names a directory (a relative path is taken from the
current directory) or an fsspec URL (``s3://bucket/cache``); ``off``, ``0``, ``no``, ``false`` or
``none`` turn every cache off; unset, it is ``$XDG_CACHE_HOME/torchdelegate``, else
``~/.cache/torchdelegate``.

An entry is a folder ``<kind>/<key>/`` of files and a manifest of their sizes and SHA-256
digests, written last: an entry without a whole manifest, or whose files do not match it, does not
exist for a reader. In a local directory an entry is written in a scratch folder beside its place,
flushed to disk and renamed into it, under a lock per key, so two writers never both make it; at a
URL each file is written whole by the object store and the manifest goes last. Reading an entry
marks it used; :meth:`Store.evict` removes the least recently used entries of every kind until the
rest fit the bound, and what a crashed writer left. Deleting the store, or any entry, is always safe.
Every file of an entry is read through ``entry_files.py``: regular files inside the store only, no more
than the manifest records, and no file larger than twice the bound (no entry written here has one:
``prepare`` writes none whose weights pass the bound); an entry refused is damaged, never a hang.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import shutil
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchdelegate.cache.entry_files import MANIFEST, UNFOLLOWED, EntryFiles, file_digest, manifest_bytes
from torchdelegate.errors import TorchDelegateError
from torchdelegate.exported.mapped_pages import hash_releasing, sha256_releasing, write_releasing

CACHE_VARIABLE = "TORCHDELEGATE_CACHE"
MAX_BYTES_VARIABLE = "TORCHDELEGATE_CACHE_MAX_BYTES"
DEFAULT_MAX_BYTES = 16 << 30
_OFF = ("off", "0", "none", "false", "no")
ABSENT = "it is absent or has no manifest"
STALE_SECONDS = 3600.0  # a scratch folder or a half-written entry older than this was left by a crash
_LOCK_FLAGS = os.O_RDWR | os.O_CREAT | UNFOLLOWED


def turned_off(value: str) -> bool:
    """Whether a cache setting (``TORCHDELEGATE_CACHE``, ``--cache``) turns the caches off."""
    return value.strip().lower() in _OFF


def default_location() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(os.path.abspath(base), "torchdelegate")


def cache_location() -> str | None:
    """Where ``TORCHDELEGATE_CACHE`` puts the store (absolute, or a URL), or None when it turns it off."""
    chosen = os.environ.get(CACHE_VARIABLE, "").strip()
    if turned_off(chosen):
        return None
    return normalized(chosen) if chosen else default_location()


def normalized(location: str) -> str:
    """A local path made absolute (``~`` expanded); a URL as it is."""
    return location if "://" in location else os.path.abspath(os.path.expanduser(location))


def max_bytes_setting() -> int:
    """The store's bound: ``TORCHDELEGATE_CACHE_MAX_BYTES`` if set, else 16 GiB."""
    value = os.environ.get(MAX_BYTES_VARIABLE, "").strip()
    if not value:
        return DEFAULT_MAX_BYTES
    try:
        bound = int(value)
    except ValueError:
        bound = -1
    if bound < 0:
        raise ValueError(f"{MAX_BYTES_VARIABLE}={value!r}: give a number of bytes >= 0")
    return bound


def read_cap() -> int:
    """The most one file of an entry may hold to be read: twice the store's bound (an entry holds the
    weights beside their packed form), the default bound's if the setting is not a number."""
    try:
        return 2 * max_bytes_setting()
    except ValueError:
        return 2 * DEFAULT_MAX_BYTES


@dataclass(frozen=True)
class EntryInfo:
    kind: str
    key: str
    size: int  # bytes of its files
    used: float  # when it was last written or read, seconds since the epoch
    whole: bool  # False: a scratch folder or an entry without a whole manifest (left by a crash)
    place: str  # its folder
    damage: str | None = None  # why an entry in place (not a scratch folder) with a manifest cannot be used


class StoreError(TorchDelegateError, ValueError):
    """The location cannot hold a store, or cannot hold this kind of entry; the message says why, and
    ``reason`` the cause alone (``/a/b is a file, not a directory``)."""

    def __init__(self, message: str, reason: str | None = None) -> None:
        super().__init__(message)
        self.reason = reason or message


class Store:
    """Entries by kind and key at ``location``: a local directory or an fsspec URL."""

    def __init__(self, location: str | os.PathLike[str], name: str = "cache") -> None:
        self.name = name
        text = os.fspath(location).strip()
        if not text:
            raise StoreError(f"the {name} needs a directory or an fsspec URL, got an empty name")
        self.location = normalized(text)
        self.local = "://" not in self.location or self.location.startswith("file://")
        if self.local:
            self._fs: Any = None
            self._root = self.location.removeprefix("file://")
        else:
            try:
                import fsspec

                self._fs, root = fsspec.core.url_to_fs(self.location)
            except (ImportError, ValueError) as e:
                raise StoreError(f"the {name} {self.location!r} cannot be opened: {e}") from e
            self._root = root.rstrip("/")
        self._files = EntryFiles(self._root, self._fs, read_cap)
        self._reported: dict[tuple[str, str], str] = {}  # damaged entries read, and how

    def __repr__(self) -> str:
        return f"Store({self.location!r})"

    # ------------------------------------------------------------------ places
    def entry_place(self, kind: str, key: str) -> str:
        return f"{self._root}/{kind}/{key}"

    def local_place(self, kind: str, key: str) -> Path:
        """An entry's folder on this machine: a ``StoreError`` if the store is at a URL."""
        if not self.local:
            raise StoreError(
                f"{kind} entries are files this process maps: they need a local directory, and the {self.name} "
                f"is {self.location!r}; set {CACHE_VARIABLE} to a directory"
            )
        return Path(self.entry_place(kind, key))

    def directory(self) -> Path:
        """The local directory, made (user only) if missing: a ``StoreError`` saying why it cannot be one."""
        place = Path(self._root)
        blocking = next((p for p in (place, *place.parents) if p.exists() and not p.is_dir()), None)
        where = f"the {self.name} {self.location!r}"
        if blocking is not None:
            raise StoreError(
                f"{where} cannot be a directory: {blocking} is a file", f"{blocking} is a file, not a directory"
            )
        try:
            place.mkdir(parents=True, exist_ok=True, mode=0o700)
        except OSError as e:
            raise StoreError(f"{where} cannot be written ({e.strerror or e})", e.strerror or str(e)) from e
        if not os.access(place, os.W_OK | os.X_OK):
            raise StoreError(f"{where} cannot be written (it is not writable)", "it is not writable")
        return place

    # ------------------------------------------------------------------ reading
    def read(self, kind: str, key: str, name: str) -> bytes | memoryview | None:
        """One file of an entry, checked against the entry's manifest (in a local store, a view of the
        file's mapped pages); None if there is no entry (or one still being written at a URL). An entry
        that is there but damaged is a ``ValueError`` saying how, once: read again, damaged the same way,
        it is None (a caller that looks twice warns once)."""
        try:
            found = self._read(kind, key, name)
        except ValueError as e:
            if self._reported.get((kind, key)) == str(e):
                return None
            self._reported[(kind, key)] = str(e)
            raise
        self._reported.pop((kind, key), None)
        return found

    def _read(self, kind: str, key: str, name: str) -> bytes | memoryview | None:
        try:
            files = self._files.manifest(kind, key)
        except OSError:
            return None
        record = files.get(name)
        if record is None:
            raise ValueError(f"its manifest lists no {name!r}")
        try:
            data = self._files.read(kind, key, name, record["size"])
        except OSError as e:
            raise ValueError(f"{name!r} cannot be read ({e})") from e
        if sha256_releasing(data).hex() != record["sha256"]:
            raise ValueError(f"{name!r} does not match its manifest (damaged)")
        self.touch(kind, key)
        return data

    def problem(self, kind: str, key: str, *, verify: bool) -> str | None:
        """Why an entry cannot be used (absent, not whole, or with ``verify`` a file not matching its
        digest), or None."""
        try:
            files = self._files.manifest(kind, key)
        except OSError:
            return ABSENT
        except ValueError as e:
            return str(e)
        for name, record in sorted(files.items()):
            why = self._files.problem(kind, key, name, record, verify)
            if why is not None:
                return why
        return None

    def touch(self, kind: str, key: str) -> None:
        """Mark an entry used, for least-recently-used eviction: its folder's time (at a URL, where folders
        are names only, its manifest's); its files stay as written."""
        place = self.entry_place(kind, key)
        with contextlib.suppress(OSError, NotImplementedError, ValueError):
            if self.local:
                os.utime(place)
            else:
                self._fs.touch(f"{place}/{MANIFEST}", truncate=False)

    # ------------------------------------------------------------------ writing
    @contextlib.contextmanager
    def lock(self, kind: str, key: str) -> Iterator[None]:
        """Held while one process makes an entry, so two that need it at once make it once (local
        directories on POSIX; elsewhere two writers each publish a whole entry and one stays)."""
        try:
            import fcntl

            descriptor = os.open(self._kind_folder(kind) / f".{key}.lock", _LOCK_FLAGS, 0o600) if self.local else -1
        except (ImportError, OSError):  # no lock to take (one planted as a link or a FIFO included): none held
            descriptor = -1
        if descriptor < 0:
            yield
            return
        with open(descriptor, "r+b") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock.fileno(), fcntl.LOCK_UN)

    def _kind_folder(self, kind: str) -> Path:
        """The local folder of ``kind``'s entries, made if missing: an ``OSError`` if a link or a file is
        in its place (entries are written inside the store only)."""
        folder = self.directory() / kind
        folder.mkdir(exist_ok=True, mode=0o700)
        if folder.is_symlink() or not folder.is_dir():
            raise OSError(f"{folder} is a link or a file, not a folder of the {self.name}: remove it")
        return folder

    @contextlib.contextmanager
    def new_entry(self, kind: str, key: str) -> Iterator[Path]:
        """A local scratch folder to write an entry's files into; when the block ends it is published
        in the entry's place (replacing one there); if the block fails, nothing is left."""
        place = self.local_place(kind, key)
        self._kind_folder(kind)
        scratch = Path(f"{place.parent}/.{key}.{secrets.token_hex(6)}.partial")
        scratch.mkdir(mode=0o700)
        try:
            yield scratch
            files = {}
            for path in sorted(scratch.iterdir()):
                if path.is_file() and path.name != MANIFEST:
                    _flush(path)
                    files[path.name] = {"size": path.stat().st_size, "sha256": file_digest(path)}
            (scratch / MANIFEST).write_bytes(manifest_bytes(files))
            _flush(scratch / MANIFEST)
            _flush(scratch)
            if os.path.islink(place) or (place.exists() and not place.is_dir()):
                place.unlink()  # planted in an entry's place: the link goes, never what it names
            elif place.exists():
                shutil.rmtree(place)
            os.rename(scratch, place)
            _flush(place.parent)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    def publish(self, kind: str, key: str, files: Mapping[str, FileParts]) -> None:
        """Write an entry of ``files`` (name -> bytes, or the parts that make them, written one after
        another a chunk at a time: an entry as large as a model's weights never exists whole in
        memory) whole, replacing one there."""
        if self.local:
            with self.new_entry(kind, key) as scratch:
                for name, data in files.items():
                    with open(scratch / name, "wb") as out:
                        for part in _parts(data):
                            write_releasing(out, part)
            return
        place = self.entry_place(kind, key)
        self._fs.makedirs(place, exist_ok=True)
        if self._fs.exists(f"{place}/{MANIFEST}"):
            self._fs.rm_file(f"{place}/{MANIFEST}")  # not whole until its new manifest is written
        records = {}
        for name, data in sorted(files.items()):
            digest, size = hashlib.sha256(), 0
            with self._fs.open(f"{place}/{name}", "wb") as out:
                for part in _parts(data):
                    hash_releasing(digest, part)
                    write_releasing(out, part)
                    size += len(part)
            records[name] = {"size": size, "sha256": digest.hexdigest()}
        self._fs.pipe_file(f"{place}/{MANIFEST}", manifest_bytes(records))

    # ------------------------------------------------------------------ housekeeping
    def entries(self, kind: str | None = None) -> list[EntryInfo]:
        """Every entry (of ``kind``, or of every kind), whole or left by a crash, in a stable order."""
        found: list[EntryInfo] = []
        for entry_kind in [kind] if kind is not None else self.kinds():
            for place in self._list(f"{self._root}/{entry_kind}", links=True):
                found.append(self._info(entry_kind, place))
        return sorted(found, key=lambda e: (e.kind, e.key))

    def kinds(self) -> list[str]:
        return sorted(p.rsplit("/", 1)[-1] for p in self._list(self._root) if not p.rsplit("/", 1)[-1].startswith("."))

    def evict(self, max_bytes: int) -> int:
        """Remove damaged entries (a warning names each), what a crash left (older than an hour), then the
        least recently used entries until the rest take at most ``max_bytes``; the bytes freed. The entry
        used last always stays."""
        listed = self.entries()
        now = time.time()
        freed = 0
        for entry in listed:
            if entry.damage is not None:
                self.warn_damaged(entry, "removed")
                freed += self._remove(entry)
            elif not entry.whole and now - entry.used > STALE_SECONDS:
                freed += self._remove(entry)
        whole = sorted((e for e in listed if e.whole), key=lambda e: (e.used, e.kind, e.key))
        total = sum(e.size for e in whole)
        for entry in whole[:-1]:
            if total <= max_bytes:
                break
            removed = self._remove(entry)
            total -= removed
            freed += removed
        return freed

    def clear(self, kind: str | None = None) -> int:
        """Remove every entry (of ``kind``), damaged ones included (a warning names each); the bytes freed."""
        listed = self.entries(kind)
        for entry in listed:
            if entry.damage is not None:
                self.warn_damaged(entry, "removed")
        return sum(self._remove(entry) for entry in listed)

    def warn_damaged(self, entry: EntryInfo, outcome: str) -> None:
        """The one warning about a damaged entry: where it is, what is wrong, what became of it."""
        warnings.warn(f"the {self.name} entry {entry.place} is damaged ({entry.damage}); {outcome}", stacklevel=3)

    def _info(self, kind: str, place: str) -> EntryInfo:
        name = place.rsplit("/", 1)[-1]
        key = name.lstrip(".").split(".", 1)[0]
        sizes, times = [], []
        for path in self._list(place, files=True):
            size, used = self._stat(path)
            sizes.append(size)
            times.append(used)
        problem = None if name.startswith(".") else self.problem(kind, key, verify=False)
        whole = not name.startswith(".") and problem is None
        if whole:
            used = self._stat(place)[1] if self.local else self._stat(f"{place}/{MANIFEST}")[1]
        else:  # a scratch folder: when it was last written to
            used = max(times, default=0.0) or self._stat(place)[1]
        damage = problem if problem not in (None, ABSENT) else None  # without a manifest: maybe being written
        return EntryInfo(kind, key, sum(sizes), used, whole, place, damage)

    def _remove(self, entry: EntryInfo) -> int:
        try:
            if self.local and os.path.islink(entry.place):
                os.unlink(entry.place)  # a link in an entry's place: the link goes, never what it names
            elif self.local:
                shutil.rmtree(entry.place)
            else:
                self._fs.rm(entry.place, recursive=True)
        except OSError:
            return 0
        return entry.size

    def _list(self, path: str, files: bool = False, links: bool = False) -> list[str]:
        """The folders in ``path`` (with ``links``, links too), or its files; never through a link: what a
        link names is not the store's to list, count or remove."""
        if self.local:
            if os.path.islink(path):
                return []
            try:
                with os.scandir(path) as scan:
                    return sorted(e.path for e in scan if _listed(e, files, links) and not e.name.endswith(".lock"))
            except OSError:
                return []
        try:
            listed = self._fs.ls(path, detail=True)
        except OSError:
            return []
        wanted = "file" if files else "directory"
        return sorted(str(i["name"]).rstrip("/") for i in listed if i.get("type") == wanted)

    def _stat(self, path: str) -> tuple[int, float]:
        try:
            if self.local:
                status = os.lstat(path)
                return status.st_size, status.st_mtime
            info = self._fs.info(path)
        except OSError:
            return 0, 0.0
        return int(info.get("size") or 0), _seconds(info.get("mtime") or info.get("LastModified") or 0)


def _listed(found: os.DirEntry[str], files: bool, links: bool) -> bool:
    if files:
        return not found.is_dir(follow_symlinks=False)
    return found.is_dir(follow_symlinks=False) or (links and found.is_symlink())


def _flush(path: Path) -> None:
    """Have a file's (or a directory's) contents reach the disk before the entry is renamed into place."""
    with contextlib.suppress(OSError):  # some systems cannot open a directory to flush it
        descriptor = os.open(path, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)


def _seconds(value: Any) -> float:
    if hasattr(value, "timestamp"):
        return float(value.timestamp())
    try:
        return float(value)
    except (TypeError, ValueError):
        return 0.0


FileParts = bytes | memoryview | Sequence[bytes | memoryview]
"""A file's bytes, or the parts that make them, in order."""


def _parts(data: FileParts) -> Sequence[bytes | memoryview]:
    return [data] if isinstance(data, (bytes, memoryview)) else data
