"""The store's entries listed, evicted and cleared: the housekeeping half of :class:`~torchdelegate.cache.store.Store`.

An entry's folder is listed with its size and when it was last used (its folder's time, at a URL its
manifest's), whole or not: a scratch folder or an entry without a whole manifest was left by a writer,
maybe one still writing, and counts as left by a crash once older than :data:`STALE_SECONDS`.
:meth:`StoreHousekeeping.evict` removes damaged entries and crash leftovers, then the least recently used
entries of every kind until the rest fit the bound. Listing never goes through a link, and removing a
link in an entry's place removes the link, never what it names. The store reads entries and writes
them; this base class only lists and removes, through the attributes it declares.
"""

from __future__ import annotations

import os
import shutil
import time
import warnings
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from torchdelegate.cache.entry_files import MANIFEST

ABSENT = "it is absent or has no manifest"
STALE_SECONDS = 3600.0  # a scratch folder or a half-written entry older than this was left by a crash


@dataclass(frozen=True)
class EntryInfo:
    kind: str
    key: str
    size: int  # bytes of its files
    used: float  # when it was last written or read, seconds since the epoch
    whole: bool  # False: a scratch folder or an entry without a whole manifest (left by a crash)
    place: str  # its folder
    damage: str | None = None  # why an entry in place (not a scratch folder) with a manifest cannot be used


class StoreHousekeeping(ABC):
    """Listing, eviction and clearing of a store's entries; :class:`~torchdelegate.cache.store.Store` is one."""

    name: str
    local: bool  # a local directory (else an fsspec file system, ``_fs``)
    _root: str
    _fs: Any

    @abstractmethod
    def problem(self, kind: str, key: str, *, verify: bool) -> str | None:
        """Why an entry cannot be used, or None: the store's reading half says."""

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


def _seconds(value: Any) -> float:
    if hasattr(value, "timestamp"):
        return float(value.timestamp())
    try:
        return float(value)
    except (TypeError, ValueError):
        return 0.0
