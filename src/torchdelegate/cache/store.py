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
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import shutil
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchdelegate.exported.mapped_pages import hash_releasing, mapped_file, sha256_releasing, write_releasing

CACHE_VARIABLE = "TORCHDELEGATE_CACHE"
MAX_BYTES_VARIABLE = "TORCHDELEGATE_CACHE_MAX_BYTES"
DEFAULT_MAX_BYTES = 16 << 30
MANIFEST = "manifest.json"
_FORMAT = 2  # the machine cache's manifests before the store was shared read the same
_OFF = ("off", "0", "none", "false", "no")
_CHUNK = 1 << 23
STALE_SECONDS = 3600.0  # a scratch folder or a half-written entry older than this was left by a crash


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


@dataclass(frozen=True)
class EntryInfo:
    kind: str
    key: str
    size: int  # bytes of its files
    used: float  # when it was last written or read, seconds since the epoch
    whole: bool  # False: a scratch folder or an entry without a whole manifest (left by a crash)
    place: str  # its folder


class StoreError(ValueError):
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
        that is there but damaged is a ``ValueError`` saying how."""
        place = self.entry_place(kind, key)
        try:
            manifest = self._read_bytes(f"{place}/{MANIFEST}")
        except OSError:
            return None
        files = _checked_manifest(manifest)
        record = files.get(name)
        if record is None:
            raise ValueError(f"its manifest lists no {name!r}")
        try:
            data = mapped_file(f"{place}/{name}") if self.local else self._read_bytes(f"{place}/{name}")
        except OSError as e:
            raise ValueError(f"{name!r} cannot be read ({e})") from e
        if len(data) != record["size"] or sha256_releasing(data).hex() != record["sha256"]:
            raise ValueError(f"{name!r} does not match its manifest (damaged)")
        self.touch(kind, key)
        return data

    def problem(self, kind: str, key: str, *, verify: bool) -> str | None:
        """Why an entry cannot be used (absent, not whole, or with ``verify`` a file not matching its
        digest), or None."""
        place = self.entry_place(kind, key)
        try:
            files = _checked_manifest(self._read_bytes(f"{place}/{MANIFEST}"))
        except OSError:
            return "it is absent or has no manifest"
        except ValueError as e:
            return str(e)
        for name, record in sorted(files.items()):
            path = f"{place}/{name}"
            if self._size(path) != record["size"]:
                return f"{name!r} is missing or not {record['size']} bytes"
            if verify and self._digest(path) != record["sha256"]:
                return f"{name!r} does not match its digest (damaged)"
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
        if not self.local:
            yield
            return
        folder = self.directory() / kind
        folder.mkdir(exist_ok=True, mode=0o700)
        try:
            import fcntl
        except ImportError:
            yield
            return
        with open(folder / f".{key}.lock", "a+b") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock.fileno(), fcntl.LOCK_UN)

    @contextlib.contextmanager
    def new_entry(self, kind: str, key: str) -> Iterator[Path]:
        """A local scratch folder to write an entry's files into; when the block ends it is published
        in the entry's place (replacing one there); if the block fails, nothing is left."""
        place = self.local_place(kind, key)
        self.directory()
        place.parent.mkdir(exist_ok=True, mode=0o700)
        scratch = Path(f"{place.parent}/.{key}.{secrets.token_hex(6)}.partial")
        scratch.mkdir(mode=0o700)
        try:
            yield scratch
            files = {}
            for path in sorted(scratch.iterdir()):
                if path.is_file() and path.name != MANIFEST:
                    _flush(path)
                    files[path.name] = {"size": path.stat().st_size, "sha256": file_digest(path)}
            (scratch / MANIFEST).write_bytes(_manifest_bytes(files))
            _flush(scratch / MANIFEST)
            _flush(scratch)
            if place.exists():
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
        self._fs.pipe_file(f"{place}/{MANIFEST}", _manifest_bytes(records))

    # ------------------------------------------------------------------ housekeeping
    def entries(self, kind: str | None = None) -> list[EntryInfo]:
        """Every entry (of ``kind``, or of every kind), whole or left by a crash, in a stable order."""
        found: list[EntryInfo] = []
        for entry_kind in [kind] if kind is not None else self.kinds():
            for place in self._list(f"{self._root}/{entry_kind}"):
                found.append(self._info(entry_kind, place))
        return sorted(found, key=lambda e: (e.kind, e.key))

    def kinds(self) -> list[str]:
        return sorted(p.rsplit("/", 1)[-1] for p in self._list(self._root) if not p.rsplit("/", 1)[-1].startswith("."))

    def evict(self, max_bytes: int) -> int:
        """Remove what a crash left (older than an hour), then the least recently used entries until
        the rest take at most ``max_bytes``; the bytes freed. The entry used last always stays."""
        listed = self.entries()
        now = time.time()
        freed = 0
        for entry in listed:
            if not entry.whole and now - entry.used > STALE_SECONDS:
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
        """Remove every entry (of ``kind``); the bytes freed."""
        return sum(self._remove(entry) for entry in self.entries(kind))

    def _info(self, kind: str, place: str) -> EntryInfo:
        name = place.rsplit("/", 1)[-1]
        key = name.lstrip(".").split(".", 1)[0]
        sizes, times = [], []
        for path in self._list(place, files=True):
            size, used = self._stat(path)
            sizes.append(size)
            times.append(used)
        whole = not name.startswith(".") and self.problem(kind, key, verify=False) is None
        if whole:
            used = self._stat(place)[1] if self.local else self._stat(f"{place}/{MANIFEST}")[1]
        else:  # a scratch folder: when it was last written to
            used = max(times, default=0.0) or self._stat(place)[1]
        return EntryInfo(kind, key, sum(sizes), used, whole, place)

    def _remove(self, entry: EntryInfo) -> int:
        try:
            if self.local:
                shutil.rmtree(entry.place)
            else:
                self._fs.rm(entry.place, recursive=True)
        except OSError:
            return 0
        return entry.size

    def _list(self, path: str, files: bool = False) -> list[str]:
        if self.local:
            try:
                with os.scandir(path) as scan:
                    return sorted(
                        e.path for e in scan if (e.is_file() if files else e.is_dir()) and not e.name.endswith(".lock")
                    )
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
                status = os.stat(path)
                return status.st_size, status.st_mtime
            info = self._fs.info(path)
        except OSError:
            return 0, 0.0
        return int(info.get("size") or 0), _seconds(info.get("mtime") or info.get("LastModified") or 0)

    def _read_bytes(self, path: str) -> bytes:
        if self.local:
            with open(path, "rb") as file:
                return file.read()
        return bytes(self._fs.cat_file(path))

    def _digest(self, path: str) -> str:
        return file_digest(Path(path)) if self.local else hashlib.sha256(self._read_bytes(path)).hexdigest()

    def _size(self, path: str) -> int | None:
        try:
            return os.path.getsize(path) if self.local else int(self._fs.size(path))
        except (OSError, FileNotFoundError, TypeError, ValueError):
            return None


def _manifest_bytes(files: dict[str, dict[str, Any]]) -> bytes:
    return json.dumps({"format": _FORMAT, "files": files}, sort_keys=True).encode()


def _checked_manifest(data: bytes) -> dict[str, dict[str, Any]]:
    """An entry's files from its manifest: a ``ValueError`` saying what is wrong with it."""
    try:
        manifest = json.loads(data)
    except ValueError as e:
        raise ValueError(f"its manifest cannot be read ({e})") from e
    files = manifest.get("files") if isinstance(manifest, dict) and manifest.get("format") == _FORMAT else None
    if not isinstance(files, dict) or not files:
        raise ValueError("its manifest lists no files")
    for name, record in files.items():
        if not isinstance(name, str) or os.path.basename(name) != name or name in (MANIFEST, "", ".", ".."):
            raise ValueError(f"its manifest names {name!r}")
        if not (isinstance(record, dict) and isinstance(record.get("size"), int) and record.get("sha256")):
            raise ValueError(f"its manifest's record of {name!r} is not a size and a digest")
    return files


def file_digest(path: Path) -> str:
    """The SHA-256 of a file, read in chunks (through the page cache: nothing stays mapped)."""
    digest = hashlib.sha256()
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as file:
        while count := file.readinto(buffer):
            digest.update(view[:count])
    return digest.hexdigest()


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
