"""The one store both caches keep their entries in: content-addressed, published whole, bounded.

Where it is (a directory or an fsspec URL) and its bound come from ``store_settings.py``; listing,
eviction and clearing are ``eviction.py``'s, the base class of :class:`Store`.

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
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from torchdelegate.cache.entry_files import MANIFEST, UNFOLLOWED, EntryFiles, file_digest, manifest_bytes
from torchdelegate.cache.eviction import ABSENT, StoreHousekeeping
from torchdelegate.cache.store_settings import CACHE_VARIABLE, normalized, read_cap
from torchdelegate.errors import TorchDelegateError
from torchdelegate.exported.mapped_pages import hash_releasing, sha256_releasing, write_releasing

_LOCK_FLAGS = os.O_RDWR | os.O_CREAT | UNFOLLOWED


class StoreError(TorchDelegateError, ValueError):
    """The location cannot hold a store, or cannot hold this kind of entry; the message says why, and
    ``reason`` the cause alone (``/a/b is a file, not a directory``)."""

    def __init__(self, message: str, reason: str | None = None) -> None:
        super().__init__(message)
        self.reason = reason or message


class Store(StoreHousekeeping):
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


def _flush(path: Path) -> None:
    """Have a file's (or a directory's) contents reach the disk before the entry is renamed into place."""
    with contextlib.suppress(OSError):  # some systems cannot open a directory to flush it
        descriptor = os.open(path, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)


FileParts = bytes | memoryview | Sequence[bytes | memoryview]
"""A file's bytes, or the parts that make them, in order."""


def _parts(data: FileParts) -> Sequence[bytes | memoryview]:
    return [data] if isinstance(data, (bytes, memoryview)) else data
