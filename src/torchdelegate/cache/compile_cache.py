"""The compile cache: compiled partitions kept by content in the one store (``store.py``), in a
directory or at any fsspec URL.

Kinds in the store: ``compile`` holds one entry per compiled unit (its file ``entry``: a
``compiled_entry.py`` entry), ``compile-bindings`` per structure the ways the weights of that
structure have been found to bind its entries (which state tensors a key must cover by their bytes).
A damaged entry is compiled again, with a warning. An entry is used only when its signature is one
this process accepts (``entry_signature.py``: made with the team's key, or none where only this user
writes) and it records what the unit looked up stands for (``compiled_entry.binding_problem``); the
others are compiled again, with one warning per cache saying what to do. The bindings only steer
look-ups (an entry found through a wrong one is refused by its own record), so they are not signed.
Past ``max_bytes`` the least recently used entries of every kind go first (the machine cache's count
too). Deleting the directory, or any entry in it, is always safe.
"""

from __future__ import annotations

import json
import os
import time
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from torchdelegate.cache.entry_signature import signer_for
from torchdelegate.cache.eviction import STALE_SECONDS
from torchdelegate.cache.store import FileParts, Store
from torchdelegate.cache.store_settings import max_bytes_setting
from torchdelegate.serialize.bounded_json import bounded_json

if TYPE_CHECKING:  # its module imports torch, which `cache info` and `cache clear` need not
    from torchdelegate.cache.compiled_entry import Entry

ENTRIES, BINDINGS = "compile", "compile-bindings"
_ENTRY, _BINDINGS = "entry", "bindings.json"
_KEEP_BINDINGS = 8
_MAX_BINDINGS_BYTES = 1 << 20  # unsigned (it only steers look-ups): read no more than a few bindings need


class CompileCache:
    """Compiled partitions at ``location`` (a directory, or an fsspec URL such as ``s3://bucket/cache``);
    the store holds at most ``max_bytes`` (default: ``TORCHDELEGATE_CACHE_MAX_BYTES``, else 16 GiB)."""

    def __init__(self, location: str | os.PathLike[str], *, max_bytes: int | None = None) -> None:
        if max_bytes is None:
            max_bytes = max_bytes_setting()
        if not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"max_bytes must be a number of bytes >= 0, got {max_bytes!r}")
        self.store = Store(location, name="compile cache")
        self.location = self.store.location
        self.max_bytes = max_bytes
        if self.store.local:
            self.store.directory()
        self.signer = signer_for(self.location)
        self._warned = False

    def __repr__(self) -> str:
        return f"CompileCache({self.location!r}, max_bytes={self.max_bytes})"

    def bindings(self, structure: str) -> list[list[str]]:
        """The sets of state tensors whose bytes entries of this structure were keyed by, most recent
        first; none (a warning) when what lists them is damaged."""
        try:
            data = self.store.read(BINDINGS, structure, _BINDINGS)
            found = [] if data is None else bounded_json(data, _MAX_BINDINGS_BYTES)
        except ValueError as e:
            return self._damaged_bindings(structure, str(e))
        if not (
            isinstance(found, list) and all(isinstance(b, list) and all(isinstance(n, str) for n in b) for b in found)
        ):
            return self._damaged_bindings(structure, "not a list of bindings")
        return found[:_KEEP_BINDINGS]

    def _damaged_bindings(self, structure: str, why: str) -> list[list[str]]:
        place = self.store.entry_place(BINDINGS, structure)
        warnings.warn(f"compile cache: {place} is damaged ({why}); its entries are compiled again", stacklevel=3)
        return []

    def get(self, key: str, where: str, binding: Mapping[str, Any], digests: Mapping[str, str]) -> Entry | None:
        """The entry under ``key`` for the unit at ``where``, whose ``binding`` and weight ``digests`` it must
        record, or None: absent, damaged, bound to something else (a warning each), or signed in a way this
        cache does not accept (one warning per cache); it is compiled again."""
        from torchdelegate.cache import compiled_entry

        if self.signer.key is None and self.signer.unsigned_refused is not None:
            self._refused(self.signer.unsigned_refused)
            return None
        place = self.store.entry_place(ENTRIES, key)
        try:
            data = self.store.read(ENTRIES, key, _ENTRY)
            if data is None:
                return None
            sealed = compiled_entry.decode_sealed(data)
        except (ValueError, compiled_entry.EntryError) as e:
            why: str | None = str(e)
        else:
            refusal = self.signer.problem(ENTRIES, sealed.digest, sealed.signature)
            if refusal is not None:
                self._refused(refusal)
                return None
            why = compiled_entry.binding_problem(sealed.entry, binding, digests)
        if why is not None:
            warnings.warn(
                f"compile cache: the entry for {where} at {place} is not used: {why}; it is compiled again",
                stacklevel=2,
            )
            return None
        return sealed.entry

    def _refused(self, why: str) -> None:
        """Say once for this cache that entries are refused for their signature, and what to do."""
        if not self._warned:
            self._warned = True
            warnings.warn(
                f"compile cache: entries at {self.location} are not used: {why}; they are compiled here instead. "
                f"{self.signer.advice()}",
                stacklevel=3,
            )

    def put(self, structure: str, bound: list[str], key: str, entry: Entry) -> None:
        """Keep ``entry`` (which records its binding) under ``key``, signed when this cache has a key, and
        ``bound`` among the structure's bindings."""
        from torchdelegate.cache import compiled_entry

        self._publish(
            ENTRIES, key, _ENTRY, compiled_entry.encode(entry, lambda digest: self.signer.signature(ENTRIES, digest))
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            known = self.bindings(structure)
        if bound not in known[:1]:
            updated = [bound, *(b for b in known if b != bound)][:_KEEP_BINDINGS]
            self._publish(BINDINGS, structure, _BINDINGS, json.dumps(updated).encode())

    def _publish(self, kind: str, key: str, name: str, data: FileParts) -> None:
        try:
            self.store.publish(kind, key, {name: data})
        except OSError as e:
            place = self.store.entry_place(kind, key)
            warnings.warn(f"compile cache: {place} cannot be written ({e}); lowering goes on without it", stacklevel=2)

    def entries(self) -> list[dict[str, Any]]:
        """Every compiled entry, and every write left unfinished for an hour: ``{"name", "size", "used"}``
        (its folder; last use as seconds since the epoch)."""
        return [
            {"name": e.place, "size": e.size, "used": e.used}
            for e in self.store.entries(ENTRIES)
            if e.whole or e.used < time.time() - STALE_SECONDS
        ]

    def evict(self) -> int:
        """Keep the store within ``max_bytes`` (least recently used first, every kind), removing what a
        write that never finished left; the bytes freed."""
        return self.store.evict(self.max_bytes)
