"""An entry's files read safely: regular files inside the cache only, every read bounded.

Whoever can write a cache can put anything under an entry's names: a FIFO (opening it to read waits for
a writer, forever), a link to ``/dev/zero`` (reading it never ends), a link to a file outside the cache,
a manifest of gigabytes. So in a local directory each file of an entry is opened here without following
a link at any level below the cache's directory and without waiting, and its type and size are checked
on the opened descriptor (the file read is the file checked, whatever is renamed meanwhile) before a
byte of it is read. Only a regular file is read, never more than its manifest records, and never more
than a cap: :data:`MANIFEST_CAP` for a manifest, the caller's for any other file. At an fsspec URL,
whose objects are files or nothing, the same bounds hold on the sizes the object store reports.

What is refused is a ``ValueError`` naming the file and what is wrong; an absent file is an ``OSError``.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import mmap
import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from torchdelegate.exported.mapped_pages import register_mapping
from torchdelegate.serialize.bounded_json import JsonLimitError, bounded_json

MANIFEST = "manifest.json"
MANIFEST_CAP = 1 << 20
"""The largest manifest read: one lists a few files, in well under a kilobyte."""
FORMAT = 2  # the machine cache's manifests before the store was shared read the same
_CHUNK = 1 << 23
UNFOLLOWED = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
"""Flags of an open that neither follows a link in the last place nor waits for a FIFO's other end."""
_FILE_FLAGS = os.O_RDONLY | UNFOLLOWED
_FOLDER_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)
_LINKED = {errno.ELOOP, errno.EMLINK, errno.ENOTDIR}  # what opening a link without following it says
_TYPES: tuple[tuple[Callable[[int], bool], str], ...] = (
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISDIR, "a directory"),
)


class EntryFiles:
    """The files of entries ``<root>/<kind>/<key>/<name>``: in a local directory (``fs`` None) or in a
    folder of an fsspec filesystem; ``cap()`` is the most any file but a manifest may hold."""

    def __init__(self, root: str, fs: Any, cap: Callable[[], int]) -> None:
        self._root = root
        self._fs = fs
        self._cap = cap

    def manifest(self, kind: str, key: str) -> dict[str, dict[str, Any]]:
        """The files an entry's manifest lists, by name: an ``OSError`` if it has none, a ``ValueError``
        saying what is wrong with the one it has."""
        parts = (kind, key, MANIFEST)
        if self._fs is None:
            with opened_regular(self._root, parts) as (descriptor, size):
                if size > MANIFEST_CAP:
                    raise ValueError(f"its manifest is {size} bytes, more than a manifest may be ({MANIFEST_CAP})")
                data = _read_exactly(descriptor, size, MANIFEST)
        else:
            data = self._remote_bytes(parts, None)
        return checked_manifest(data)

    def read(self, kind: str, key: str, name: str, size: int) -> bytes | memoryview:
        """The ``size`` bytes of an entry's file (local: a view of its mapped pages): a ``ValueError`` if
        it is not a regular file of that size within the cap."""
        parts = (kind, key, name)
        self._check_cap(name, size)
        if self._fs is not None:
            return self._remote_bytes(parts, size)
        with opened_regular(self._root, parts) as (descriptor, found):
            _check_size(name, found, size)
            if size == 0:
                return memoryview(b"")
            mapping = mmap.mmap(descriptor, size, access=mmap.ACCESS_COPY)
        register_mapping(mapping)
        return memoryview(mapping).toreadonly()

    def problem(self, kind: str, key: str, name: str, record: dict[str, Any], verify: bool) -> str | None:
        """Why an entry's file does not match its record (with ``verify``, its digest too), or None."""
        parts, size = (kind, key, name), record["size"]
        try:
            self._check_cap(name, size)
            if self._fs is not None:
                found = self._remote_size(parts)
                if found != size:
                    return f"{name!r} is missing or not {size} bytes"
                digest = hashlib.sha256(self._remote_bytes(parts, size)).hexdigest() if verify else None
            else:
                with opened_regular(self._root, parts) as (descriptor, found):
                    _check_size(name, found, size)
                    digest = _descriptor_digest(descriptor, size, name) if verify else None
        except FileNotFoundError:
            return f"{name!r} is missing or not {size} bytes"
        except (OSError, ValueError) as e:
            return str(e)
        if digest is not None and digest != record["sha256"]:
            return f"{name!r} does not match its digest (damaged)"
        return None

    def _check_cap(self, name: str, size: int) -> None:
        cap = self._cap()
        if size > cap:
            raise ValueError(f"its manifest gives {name!r} {size} bytes, more than the cache reads in one file ({cap})")

    def _remote_size(self, parts: tuple[str, ...]) -> int | None:
        try:
            info = self._fs.info("/".join((self._root, *parts)))
        except (OSError, ValueError):
            return None
        return int(info.get("size") or 0) if info.get("type", "file") == "file" else None

    def _remote_bytes(self, parts: tuple[str, ...], size: int | None) -> bytes:
        """An object's bytes: exactly ``size``, or (a manifest) no more than :data:`MANIFEST_CAP`."""
        path = "/".join((self._root, *parts))
        found = self._remote_size(parts)
        if found is None:
            raise FileNotFoundError(errno.ENOENT, "no such object", path)
        if size is not None:
            _check_size(parts[-1], found, size)
        elif found > MANIFEST_CAP:
            raise ValueError(f"its manifest is {found} bytes, more than a manifest may be ({MANIFEST_CAP})")
        data = bytes(self._fs.cat_file(path, start=0, end=found)) if found else b""
        if len(data) != found:
            raise ValueError(f"{parts[-1]!r} changed while it was read ({len(data)} bytes, not {found})")
        return data


@contextlib.contextmanager
def opened_regular(root: str, parts: tuple[str, ...]) -> Iterator[tuple[int, int]]:
    """A descriptor of the file ``root/parts...`` and its size, once that is a regular file reached
    without a link below ``root`` (a ``ValueError`` naming what it is instead); it is closed after."""
    descriptor = _open_below(root, parts)
    try:
        status = os.fstat(descriptor)
        if not stat.S_ISREG(status.st_mode):
            kind = next((name for test, name in _TYPES if test(status.st_mode)), "not a regular file")
            raise ValueError(f"{parts[-1]!r} is {kind}, not a regular file")
        yield descriptor, status.st_size
    finally:
        os.close(descriptor)


def _open_below(root: str, parts: tuple[str, ...]) -> int:
    """Open ``parts[-1]`` through the folders ``parts[:-1]`` below ``root``, following no link among them
    and never waiting for a writer (a FIFO opens at once, for the type check to refuse)."""
    if os.open not in os.supports_dir_fd:  # no openat here: only the file itself is kept from being a link
        return _open_unlinked(os.path.join(root, *parts), _FILE_FLAGS, parts[-1])
    folder = os.open(root, _FOLDER_FLAGS)
    try:
        for part in parts[:-1]:
            inner = _open_unlinked(part, _FOLDER_FLAGS | getattr(os, "O_NOFOLLOW", 0), part, folder)
            os.close(folder)
            folder = inner
        return _open_unlinked(parts[-1], _FILE_FLAGS, parts[-1], folder)
    finally:
        os.close(folder)


def _open_unlinked(path: str, flags: int, name: str, folder: int | None = None) -> int:
    try:
        return os.open(path, flags, dir_fd=folder)
    except OSError as e:
        if e.errno not in _LINKED:
            raise
        try:
            linked = stat.S_ISLNK(os.lstat(path, dir_fd=folder).st_mode)
        except OSError:
            linked = False
        what = "a symbolic link" if linked else "not a folder"
        raise ValueError(f"{name!r} is {what} (an entry is a folder of regular files, never links)") from e


def _check_size(name: str, found: int, size: int) -> None:
    if found != size:
        raise ValueError(f"{name!r} is missing or not {size} bytes (it has {found})")


def _read_exactly(descriptor: int, size: int, name: str) -> bytes:
    """The ``size`` bytes of an open regular file: a ``ValueError`` if it holds fewer or more by now."""
    parts, count = [], 0
    while count < size and (chunk := os.read(descriptor, min(_CHUNK, size - count))):
        parts.append(chunk)
        count += len(chunk)
    if count != size or os.read(descriptor, 1):
        raise ValueError(f"{name!r} changed while it was read")
    return b"".join(parts)


def _descriptor_digest(descriptor: int, size: int, name: str) -> str:
    """The SHA-256 of the ``size`` bytes of an open regular file, a chunk at a time into one buffer (no
    chunk-sized allocations left for the heap to keep)."""
    digest, count = hashlib.sha256(), 0
    view = memoryview(bytearray(min(_CHUNK, size)))
    with open(descriptor, "rb", buffering=0, closefd=False) as file:
        while count < size and (read := file.readinto(view[: min(len(view), size - count)])):
            digest.update(view[:read])
            count += read
    if count != size or os.read(descriptor, 1):
        raise ValueError(f"{name!r} changed while it was read")
    return digest.hexdigest()


def manifest_bytes(files: dict[str, dict[str, Any]]) -> bytes:
    return json.dumps({"format": FORMAT, "files": files}, sort_keys=True).encode()


def checked_manifest(data: bytes) -> dict[str, dict[str, Any]]:
    """An entry's files from its manifest: a ``ValueError`` saying what is wrong with it."""
    try:
        manifest = bounded_json(data, len(data))  # the size is capped where the file is read
    except JsonLimitError as e:
        raise ValueError(f"its manifest cannot be read ({e})") from e
    files = manifest.get("files") if isinstance(manifest, dict) and manifest.get("format") == FORMAT else None
    if not isinstance(files, dict) or not files:
        raise ValueError("its manifest lists no files")
    for name, record in files.items():
        if not isinstance(name, str) or os.path.basename(name) != name or name in (MANIFEST, "", ".", ".."):
            raise ValueError(f"its manifest names {name!r}")
        size = record.get("size") if isinstance(record, dict) else None
        if not (isinstance(size, int) and not isinstance(size, bool) and size >= 0 and record.get("sha256")):
            raise ValueError(f"its manifest's record of {name!r} is not a size and a digest")
    return files


def file_digest(path: Path) -> str:
    """The SHA-256 of a file this process wrote, read in chunks (through the page cache: nothing stays mapped)."""
    digest = hashlib.sha256()
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as file:
        while count := file.readinto(buffer):
            digest.update(view[:count])
    return digest.hexdigest()
