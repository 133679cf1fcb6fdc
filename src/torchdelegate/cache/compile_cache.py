"""The compile cache: compiled partitions kept by content, in a directory or at any fsspec URL.

Layout under the location: ``compile-v1/entries/<key[:2]>/<key>`` holds one entry (``compiled_entry.py``),
``compile-v1/bindings/<structure[:2]>/<structure>.json`` the ways the weights of that structure
have been found to bind its entries (which state tensors a key must cover by their bytes). An
entry is written under a temporary name, then moved into place, so a reader sees a whole entry
or none (on object stores a write is whole by itself); a damaged entry is compiled again, with a
warning. Reading an entry marks it used; past ``max_bytes`` the least recently used go first.
Deleting the directory, or any file in it, is always safe.
"""

from __future__ import annotations

import json
import os
import secrets
import time
import warnings
from pathlib import Path
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from torchdelegate.cache.compiled_entry import Entry, EntryError, decode, encode

DEFAULT_MAX_BYTES = 4 << 30
_ROOT = "compile-v1"
_KEEP_BINDINGS = 8
_STALE_PARTIAL = 3600.0  # seconds after which an entry's unfinished write is left over, not in progress


class CompileCache:
    """Compiled partitions at ``location`` (a directory, or an fsspec URL such as ``s3://bucket/cache``),
    at most ``max_bytes`` of entries."""

    def __init__(self, location: str | os.PathLike[str], *, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        if not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"max_bytes must be a number of bytes >= 0, got {max_bytes!r}")
        self.location = os.fspath(location)
        if not self.location.strip():
            raise ValueError("the compile cache needs a directory or an fsspec URL, got an empty name")
        if "://" not in self.location:
            self.location = os.path.abspath(os.path.expanduser(self.location))
        try:
            self._fs, root = fsspec.core.url_to_fs(self.location)
        except (ImportError, ValueError) as e:
            raise ValueError(f"the compile cache {self.location!r} cannot be opened: {e}") from e
        self._root = f"{root.rstrip('/')}/{_ROOT}"
        self.max_bytes = max_bytes
        if isinstance(self._fs, LocalFileSystem):
            self._check_directory()

    def _check_directory(self) -> None:
        """A local cache's directory, made if missing: a ``ValueError`` saying why it cannot be one."""
        place = Path(self.location)
        blocking = next((p for p in (place, *place.parents) if p.is_file()), None)
        if blocking is not None:
            raise ValueError(f"the compile cache {self.location!r} cannot be a directory: {blocking} is a file")
        try:
            os.makedirs(self._root, exist_ok=True)
        except OSError as e:
            raise ValueError(f"the compile cache {self.location!r} cannot be written ({e.strerror or e})") from e

    def __repr__(self) -> str:
        return f"CompileCache({self.location!r}, max_bytes={self.max_bytes})"

    def _entry_path(self, key: str) -> str:
        return f"{self._root}/entries/{key[:2]}/{key}"

    def _bindings_path(self, structure: str) -> str:
        return f"{self._root}/bindings/{structure[:2]}/{structure}.json"

    def bindings(self, structure: str) -> list[list[str]]:
        """The sets of state tensors whose bytes entries of this structure were keyed by, most recent
        first; none (a warning) when the file listing them is damaged."""
        found = self._bindings(structure)
        if found is None:
            path = self._bindings_path(structure)
            warnings.warn(
                f"compile cache: {path} is not a list of bindings; its entries are compiled again", stacklevel=2
            )
        return found or []

    def _bindings(self, structure: str) -> list[list[str]] | None:
        try:
            found = json.loads(self._fs.cat_file(self._bindings_path(structure)))
        except (FileNotFoundError, OSError):
            return []
        except ValueError:
            return None
        valid = isinstance(found, list) and all(
            isinstance(b, list) and all(isinstance(n, str) for n in b) for b in found
        )
        return found if valid else None

    def get(self, key: str, where: str) -> Entry | None:
        """The entry under ``key``, or None: absent, or damaged (a warning; it is compiled again)."""
        path = self._entry_path(key)
        try:
            data = self._fs.cat_file(path)
        except (FileNotFoundError, OSError):
            return None
        try:
            entry = decode(data)
        except EntryError as e:
            warnings.warn(
                f"compile cache: the entry for {where} at {path} is not used: {e}; it is compiled again", stacklevel=2
            )
            return None
        self._touch(path)
        return entry

    def put(self, structure: str, bound: list[str], key: str, entry: Entry) -> None:
        """Keep ``entry`` under ``key``, and ``bound`` among the structure's bindings."""
        self._write(self._entry_path(key), encode(entry))
        known = self._bindings(structure) or []
        if bound not in known[:1]:
            updated = [bound, *(b for b in known if b != bound)][:_KEEP_BINDINGS]
            self._write(self._bindings_path(structure), json.dumps(updated).encode())

    def _write(self, path: str, data: bytes) -> None:
        parent = path.rsplit("/", 1)[0]
        scratch = f"{path}.{secrets.token_hex(8)}.partial"
        try:
            self._fs.makedirs(parent, exist_ok=True)
            self._fs.pipe_file(scratch, data)
            self._fs.mv(scratch, path)
        except OSError as e:
            warnings.warn(f"compile cache: {path} cannot be written ({e}); lowering goes on without it", stacklevel=2)
            try:
                self._fs.rm_file(scratch)
            except OSError:
                pass

    def _touch(self, path: str) -> None:
        try:
            if isinstance(self._fs, LocalFileSystem):
                os.utime(path)
            else:
                self._fs.touch(path, truncate=False)
        except (OSError, NotImplementedError, ValueError):
            pass  # where recency cannot be marked, eviction goes by the time of writing

    def entries(self) -> list[dict[str, Any]]:
        """Every entry, and every write left unfinished for an hour (``.partial``): ``{"name", "size",
        "used"}`` (last use as seconds since the epoch)."""
        try:
            found = self._fs.find(f"{self._root}/entries", detail=True)
        except (FileNotFoundError, OSError):
            return []
        listed = []
        for name, info in sorted(found.items()):
            used = _seconds(info.get("mtime") or info.get("created") or info.get("LastModified") or 0)
            if name.endswith(".partial") and time.time() - used < _STALE_PARTIAL:
                continue  # being written
            listed.append({"name": name, "size": int(info.get("size") or 0), "used": used})
        return listed

    def evict(self) -> int:
        """Remove the least recently used entries until the rest fit ``max_bytes``, and what a write
        that never finished left behind; the bytes freed."""
        listed = self.entries()
        total = sum(e["size"] for e in listed)
        freed = 0
        for entry in sorted(listed, key=lambda e: (not e["name"].endswith(".partial"), e["used"], e["name"])):
            if total - freed <= self.max_bytes and not entry["name"].endswith(".partial"):
                break
            try:
                self._fs.rm_file(entry["name"])
            except OSError:
                continue
            freed += entry["size"]
        return freed


def _seconds(value: Any) -> float:
    if hasattr(value, "timestamp"):
        return float(value.timestamp())
    try:
        return float(value)
    except (TypeError, ValueError):
        return 0.0
