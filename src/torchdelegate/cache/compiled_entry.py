"""A compiled partition as the compile cache keeps it and a worker returns it: the blob with the
keys of weights it stored unchanged replaced by slots, the named data it derived, its debug map
and delegate info; checksummed, nothing executable.

Weights are not kept. A result is made again from an entry and the unit's own state tensors
(:func:`refit`): each slot's key becomes that tensor's SHA-256, and its bytes are the tensor
itself (a view, no copy), exactly as the backend would have stored them.

An entry kept in the cache records what it stands for (its ``binding``: the digest of the partition's
graph and those of the weights it was compiled from, the document its key is the digest of), and a
look-up checks that record against the unit it would answer (:func:`binding_problem`): an entry moved
under another key is refused, signed or not.

Layout: ``MAGIC``, the signature (``entry_signature.py``; zeros when written without a key), the
SHA-256 of the rest (what the signature signs), an 8-byte little-endian header length, the header
(canonical JSON), then the payload the header's ``[offset, length]`` pairs point into.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from torchdelegate.cache.entry_signature import UNSIGNED
from torchdelegate.delegate.named_data import NamedDataStore, NamedDataStoreOutput
from torchdelegate.delegate.preprocess_checks import delegate_info_problem, json_data_problem
from torchdelegate.delegate.preprocess_result import PreprocessResult
from torchdelegate.exported.mapped_pages import hash_releasing, sha256_releasing
from torchdelegate.serialize.container import FramePayload, canonical_json, span_of, unframed
from torchdelegate.serialize.manifest import from_pairs

MAGIC = b"TDCUNIT2"
_PREFIX = len(MAGIC) + 64  # the magic, the signature, the digest
_SLOT = "<torchdelegate weight slot {:06d}>"


class EntryError(ValueError):
    """An entry that is not whole or not of this format."""


@dataclass(frozen=True)
class NamedItem:
    """One named data entry: from a state tensor (``slot``: its name; ``key`` None when keyed by
    content and named in the blob in the clear; ``bound`` when keyed by content the blob holds in
    another form, so only these bytes fit) or derived bytes kept in the entry (``data``)."""

    key: str | None
    slot: str | None
    alignment: int
    data: bytes | memoryview | None = None
    bound: bool = False


@dataclass(frozen=True)
class Entry:
    blob: bytes
    named_data: list[NamedItem]
    debug_handle_map: list[list[Any]] | None
    delegate_info: dict[str, Any] | None
    binding: dict[str, Any] | None = None  # what it stands for, once kept in the cache


@dataclass(frozen=True)
class Sealed:
    """An entry as read from its bytes, with the digest of its contents and the signature made over it."""

    entry: Entry
    digest: bytes
    signature: bytes


def slot_token(position: int) -> bytes:
    """What stands in a blob for the key of the named data item at ``position``: as long as a hex
    SHA-256, never one."""
    token = _SLOT.format(position).ljust(64, "~").encode()
    assert len(token) == 64
    return token


_CONTENT_KEY = re.compile(rb"(?<![0-9a-f])[0-9a-f]{64}(?![0-9a-f])")
_SLOT_TOKEN = re.compile(rb"<torchdelegate weight slot \d{6}>~*")


def _swapped(
    pattern: re.Pattern[bytes], data: bytes, replacements: Mapping[bytes, bytes], found: set[bytes] | None = None
) -> bytes:
    """``data`` with each match of ``pattern`` that ``replacements`` names replaced, in one pass; the
    matches replaced are added to ``found``."""

    def swap(match: re.Match[bytes]) -> bytes:
        text = match.group()
        if text not in replacements:
            return text
        if found is not None:
            found.add(text)
        return replacements[text]

    return pattern.sub(swap, data) if replacements else data


def template(result: PreprocessResult, digests: Mapping[str, str]) -> Entry | str:
    """``result`` with the keys of state tensors it stored unchanged as slots, or why it cannot be kept
    (a debug map or delegate info that is not JSON data)."""
    by_digest: dict[str, str] = {}
    for state_name, digest in sorted(digests.items()):
        by_digest.setdefault(digest, state_name)
    handles = _pairs(result.debug_handle_map)
    if isinstance(handles, str):
        return handles
    info = result.delegate_info
    problem = None if info is None else delegate_info_problem(info)
    if problem:
        return f"its delegate_info is not JSON data ({problem})"
    output = result.data_store_output or NamedDataStoreOutput()
    stored = [(key, entry, output.digests[entry.buffer_index].hex()) for key, entry in output.entries.items()]
    tokens = {
        key.encode(): slot_token(p)
        for p, (key, _, digest) in enumerate(stored)
        if key == digest and digest in by_digest
    }
    named: set[bytes] = set()  # the content keys the blob or its texts name in the clear
    blob = _swapped(_CONTENT_KEY, result.processed_bytes, tokens, named)
    texts = _swapped(_CONTENT_KEY, canonical_json({"handles": handles, "info": info}), tokens, named)
    items = []
    for key, entry, digest in stored:
        name = by_digest.get(digest)
        if name is None:
            items.append(NamedItem(key, None, entry.alignment, output.buffers[entry.buffer_index]))
        else:
            in_clear = key.encode() in named
            items.append(
                NamedItem(None if in_clear else key, name, entry.alignment, bound=key == digest and not in_clear)
            )
    restored = json.loads(texts)
    return Entry(blob, items, restored["handles"], restored["info"])


def _pairs(handles: Any) -> list[list[Any]] | None | str:
    if handles is None:
        return None
    if not isinstance(handles, Mapping):
        return f"its debug_handle_map is a {type(handles).__name__}"
    pairs = [[k, v] for k, v in handles.items()]
    problem = json_data_problem(pairs)
    return f"its debug_handle_map is not JSON data ({problem})" if problem else pairs


def passed_through(entry: Entry) -> set[str]:
    """The state tensors whose bytes the entry's result stored unchanged, under their own name or
    under a key the blob names in the clear (so that another tensor can take the slot); a key the
    blob holds in another form (compressed, say) binds its tensor's bytes."""
    return {item.slot for item in entry.named_data if item.slot is not None and not item.bound}


def refit(entry: Entry, state: Mapping[str, torch.Tensor], digests: Mapping[str, str]) -> PreprocessResult:
    """The result the entry stands for, with these state tensors in its slots."""
    store = NamedDataStore()
    keys = {}
    for position, item in enumerate(entry.named_data):
        if item.slot is None:
            assert item.key is not None and item.data is not None
            store.add_named_data(item.key, item.data, item.alignment)
            continue
        digest = digests[item.slot]
        if item.key is None:
            keys[slot_token(position)] = digest.encode()
        store.add_with_digest(item.key or digest, state[item.slot], item.alignment, bytes.fromhex(digest))
    blob = _swapped(_SLOT_TOKEN, entry.blob, keys)
    texts = canonical_json({"handles": entry.debug_handle_map, "info": entry.delegate_info})
    restored = json.loads(_swapped(_SLOT_TOKEN, texts, keys))
    handles = restored["handles"]
    return PreprocessResult(
        blob,
        debug_handle_map=None if handles is None else from_pairs(handles),
        data_store_output=store.get_named_data_store_output(),
        delegate_info=restored["info"],
    )


def encode(entry: Entry, sign: Callable[[bytes], bytes] | None = None) -> list[bytes | memoryview]:
    """The entry's bytes as the parts that make them, in order: the named data it made stays where it
    is (spilled weights, say), read a chunk at a time when the parts are hashed and written. ``sign``
    makes the signature of the contents' SHA-256 (none: unsigned)."""
    payload = FramePayload()
    header = {
        "blob": payload.place(entry.blob),
        "named_data": [
            {
                "key": i.key,
                "slot": i.slot,
                "alignment": i.alignment,
                "data": None if i.data is None else payload.place(i.data),
                "bound": i.bound,
            }
            for i in entry.named_data
        ],
        "debug_handle_map": entry.debug_handle_map,
        "delegate_info": entry.delegate_info,
        "binding": entry.binding,
    }
    text = canonical_json(header)
    parts: list[bytes | memoryview] = [len(text).to_bytes(8, "little"), text, *payload.parts]
    digest = hashlib.sha256()
    for part in parts:
        hash_releasing(digest, part)
    signature = UNSIGNED if sign is None else sign(digest.digest())
    return [MAGIC + signature + digest.digest(), *parts]


def encoded_bytes(entry: Entry) -> bytes:
    """The entry's bytes, whole (an entry that travels between processes)."""
    return b"".join(encode(entry))


def decode(data: bytes | memoryview) -> Entry:
    """The entry ``data`` holds (its named data views of ``data``); an ``EntryError`` saying why it is not whole."""
    return decode_sealed(data).entry


def decode_sealed(data: bytes | memoryview) -> Sealed:
    """:func:`decode`, with the digest and the signature the entry carries (checked by the caller)."""
    if len(data) < _PREFIX + 8 or bytes(data[: len(MAGIC)]) != MAGIC:
        raise EntryError(f"it is not a compile cache entry of this version ({len(data)} bytes)")
    rest = memoryview(data)[_PREFIX:]
    digest = sha256_releasing(rest)
    if digest != bytes(data[_PREFIX - 32 : _PREFIX]):
        raise EntryError("its checksum does not match (truncated or damaged)")
    signature = bytes(data[len(MAGIC) : _PREFIX - 32])
    try:
        header, payload = unframed(rest)
        items = [
            NamedItem(
                i["key"],
                i["slot"],
                i["alignment"],
                None if i["data"] is None else span_of(payload, i["data"]),
                i["bound"],
            )
            for i in header["named_data"]
        ]
        blob = bytes(span_of(payload, header["blob"]))
        binding = header["binding"]
        if binding is not None and not isinstance(binding, dict):
            raise TypeError("its binding is not an object")
        entry = Entry(blob, items, header["debug_handle_map"], header["delegate_info"], binding)
    except (KeyError, TypeError, ValueError) as e:
        raise EntryError(f"its header is malformed ({type(e).__name__}: {e})") from e
    return Sealed(entry, digest, signature)


def binding_of(structure: str, bound: list[str], digests: Mapping[str, str]) -> dict[str, Any]:
    """What an entry of a unit stands for: the digest of its graph (``structure``), the digests of the
    ``bound`` weights (those whose bytes the entry holds in some form), and which of the others are
    equal. Its digest is the entry's key."""
    others: dict[str, list[str]] = {}
    for name in sorted(set(digests) - set(bound)):
        others.setdefault(digests[name], []).append(name)
    equal = sorted(names for names in others.values() if len(names) > 1)
    return {"structure": structure, "bound": {name: digests[name] for name in sorted(bound)}, "equal": equal}


def binding_problem(entry: Entry, expected: Mapping[str, Any], digests: Mapping[str, str]) -> str | None:
    """Why ``entry`` is not what a unit of these weight ``digests`` whose binding is ``expected`` would
    compile to, or None: it records another graph or other weights, or a weight of the unit reaches it
    neither by its digest nor by a slot the unit's own tensor fills (its bytes would be the entry's)."""
    recorded = entry.binding
    if recorded is None:
        return "it records nothing of what it was compiled from"
    structure = str(recorded.get("structure"))
    if structure != expected["structure"]:
        return f"it was compiled from another graph (graph digest {structure[:12]}, not {expected['structure'][:12]})"
    bound = recorded.get("bound")
    if not isinstance(bound, dict):
        return "its record of its weights is malformed"
    wanted = expected["bound"]
    other = sorted(name for name in set(bound) | set(wanted) if bound.get(name) != wanted.get(name))
    if other:
        return f"it was compiled with other weights ({', '.join(repr(name) for name in other[:3])})"
    if recorded.get("equal") != expected["equal"]:
        return "it was compiled with other weights equal to one another"
    given = passed_through(entry)
    unbound = sorted(name for name in digests if name not in bound and name not in given)
    if unbound:
        return (
            f"weight {unbound[0]!r} of this partition reaches it neither by its digest nor by a slot its own "
            "tensor fills (its bytes would be the entry's)"
        )
    foreign = sorted(given - set(digests))
    if foreign:
        return f"it has a slot for {foreign[0]!r}, which this partition does not have"
    return None
