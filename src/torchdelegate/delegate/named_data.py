"""Named data: blobs that backends store beside their compiled code, shared by key.

Ahead of time a backend adds data (typically weights) to a :class:`NamedDataStore`; its
:class:`PreprocessResult` carries the store's output. Identical bytes are stored once,
whatever their keys, so two partitions or two methods that use the same weight share it.
At run time a backend reads the data through a :class:`NamedDataMap`, as zero-copy views.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING

from torchdelegate.errors import NamedDataConflictError
from torchdelegate.exported.mapped_pages import release_buffer, sha256_releasing

if TYPE_CHECKING:
    import torch

Buffer = bytes | memoryview


def _is_tensor(data: object) -> bool:
    """Whether ``data`` is a torch tensor, without importing torch: a process that has not imported it
    holds none (a loaded program's named data map runs where torch is not installed)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(data, torch.Tensor)


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A read-only byte view of a tensor's data: no copy unless it is not contiguous.

    The view keeps the tensor's storage alive. Bytes are in the machine's native order.
    """
    if not _is_tensor(tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    import torch

    if tensor.device.type != "cpu":
        raise ValueError(f"named data must live on the CPU, got a tensor on {tensor.device}")
    flat = tensor.detach().contiguous().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy()).toreadonly()  # type: ignore[arg-type]


def _as_buffer(data: bytes | bytearray | memoryview | torch.Tensor) -> Buffer:
    if _is_tensor(data):
        return tensor_bytes(data)  # type: ignore[arg-type]
    if isinstance(data, bytes):
        return data
    if isinstance(data, memoryview) and isinstance(data.obj, bytes):
        return data.cast("B") if data.format != "B" or data.ndim != 1 else data  # bytes never change
    if isinstance(data, (bytearray, memoryview)):
        return bytes(data)
    raise TypeError(f"named data must be bytes or a torch.Tensor, got {type(data).__name__}")


def _digest(buffer: Buffer) -> bytes:
    return sha256_releasing(buffer)


def content_key(data: bytes | bytearray | memoryview | torch.Tensor) -> str:
    """The key :meth:`NamedDataStore.add_by_content` gives ``data``: the hex SHA-256 of its bytes."""
    return _digest(_as_buffer(data)).hex()


@dataclass(frozen=True)
class DataEntry:
    """Where a key's bytes are: an index into the output's buffers, and their alignment."""

    buffer_index: int
    alignment: int


@dataclass(frozen=True)
class NamedDataStoreOutput:
    """A frozen snapshot of a store: unique buffers and the keys that point into them."""

    buffers: tuple[Buffer, ...] = ()
    entries: Mapping[str, DataEntry] = field(default_factory=dict)
    digests: tuple[bytes, ...] = ()
    """SHA-256 of each buffer (computed when not given), so merging never hashes twice."""
    owners: Mapping[str, str] = field(default_factory=dict)
    """Which delegate added each key, where known (for reports and conflict messages)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "entries", MappingProxyType(dict(sorted(self.entries.items()))))
        object.__setattr__(self, "owners", MappingProxyType(dict(sorted(self.owners.items()))))
        if len(self.digests) != len(self.buffers):
            object.__setattr__(self, "digests", tuple(_digest(b) for b in self.buffers))

    def __len__(self) -> int:
        return len(self.entries)

    def nbytes(self) -> int:
        """Bytes held, each unique buffer counted once."""
        return sum(len(b) for b in self.buffers)

    def summary(self) -> NamedDataSummary:
        """Entries, unique bytes, and the bytes deduplication saved."""
        referenced = sum(len(self.buffers[e.buffer_index]) for e in self.entries.values())
        unique = self.nbytes()
        return NamedDataSummary(len(self.entries), len(self.buffers), unique, referenced - unique)


@dataclass(frozen=True)
class NamedDataSummary:
    """How much named data a program holds, and how much storing identical bytes once saved."""

    entries: int
    unique_buffers: int
    unique_bytes: int
    saved_bytes: int

    def __str__(self) -> str:
        return (
            f"{self.entries} named data entries in {self.unique_buffers} unique buffers, "
            f"{self.unique_bytes} bytes ({self.saved_bytes} bytes saved by deduplication)"
        )


def _check_alignment(key: str, alignment: int) -> None:
    if not isinstance(alignment, int) or alignment < 1 or alignment & (alignment - 1):
        raise ValueError(f"named data {key!r}: alignment must be a power of two >= 1, got {alignment!r}")


class NamedDataStore:
    """The ahead-of-time half of named data: add blobs by key, deduplicated by content.

    Adding the same key twice with the same bytes is a no-op (the larger alignment wins);
    the same key with different bytes is a ``ValueError``.
    """

    def __init__(self) -> None:
        self._buffers: list[Buffer] = []
        self._by_digest: dict[bytes, int] = {}
        self._digests: list[bytes] = []
        self._entries: dict[str, DataEntry] = {}
        self._owners: dict[str, str] = {}
        self._map: NamedDataMap | None = None

    def add_named_data(self, key: str, data: bytes | bytearray | memoryview | torch.Tensor, alignment: int = 1) -> None:
        """Store ``data`` under ``key``. Tensors are kept as views (no copy: they must not change
        afterwards, which saving checks); bytes and views of bytes are kept; others are copied."""
        if not isinstance(key, str) or not key:
            raise TypeError(f"named data key must be a non-empty str, got {key!r}")
        _check_alignment(key, alignment)
        self._add(key, _as_buffer(data), alignment, None, None)

    def _add(self, key: str, buffer: Buffer, alignment: int, digest: bytes | None, owner: str | None) -> None:
        digest = digest if digest is not None else _digest(buffer)
        previous = self._entries.get(key)
        if previous is not None:
            if self._digests[previous.buffer_index] != digest:
                first = self._owners.get(key)
                who = f" (by {first}, now by {owner})" if first and owner else ""
                raise NamedDataConflictError(
                    f"named data {key!r} is stored twice with different bytes{who}; "
                    "use a key derived from the content (e.g. its hash) or a distinct name",
                    key,
                )
            if alignment > previous.alignment:
                self._entries[key] = DataEntry(previous.buffer_index, alignment)
            return
        index = self._by_digest.get(digest)
        if index is None:
            index = len(self._buffers)
            self._buffers.append(buffer)
            self._digests.append(digest)
            self._by_digest[digest] = index
        self._entries[key] = DataEntry(index, alignment)
        if owner is not None:
            self._owners[key] = owner

    def add_by_content(self, data: bytes | bytearray | memoryview | torch.Tensor, alignment: int = 1) -> str:
        """Store ``data`` under the hex SHA-256 of its bytes, and return that key.

        The key a backend should use for weights: equal bytes get equal keys, so every
        partition and method that adds one weight shares one entry.
        """
        _check_alignment("(by content)", alignment)
        buffer = _as_buffer(data)
        digest = _digest(buffer)
        key = digest.hex()
        self._add(key, buffer, alignment, digest, None)
        return key

    def add_with_digest(
        self, key: str, data: bytes | bytearray | memoryview | torch.Tensor, alignment: int, digest: bytes
    ) -> None:
        """Store ``data`` under ``key`` when its SHA-256 (``digest``) is already known: it is not hashed again."""
        _check_alignment(key, alignment)
        self._add(key, _as_buffer(data), alignment, digest, None)

    def merge(self, output: NamedDataStoreOutput, owner: str | None = None) -> None:
        """Add every entry of ``output``; a key already stored with other bytes is a ``ValueError``.

        ``owner`` names who added them (a delegate), else the output's own record is kept.
        """
        for key, entry in output.entries.items():
            index = entry.buffer_index
            who = owner if owner is not None else output.owners.get(key)
            self._add(key, output.buffers[index], entry.alignment, output.digests[index], who)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def get_named_data_store_output(self) -> NamedDataStoreOutput:
        return NamedDataStoreOutput(tuple(self._buffers), dict(self._entries), tuple(self._digests), dict(self._owners))

    def data_map(self) -> NamedDataMap:
        """The run-time view of what the store holds, one map until a key is added: the delegates
        of one lowering share what a backend keeps per map (one session for several delegates)."""
        if self._map is None or len(self._map) != len(self._entries):
            self._map = NamedDataMap(self.get_named_data_store_output())
        return self._map


class NamedDataMap:
    """The run-time view of named data: ``get_data(key)`` is a zero-copy, read-only view."""

    def __init__(self, output: NamedDataStoreOutput | None = None) -> None:
        self._output = output if output is not None else NamedDataStoreOutput()

    def get_data(self, key: str) -> memoryview:
        try:
            entry = self._output.entries[key]
        except KeyError:
            raise KeyError(
                f"no named data {key!r}; {len(self._output.entries)} keys are stored "
                "(did the backend's preprocess add it to its data store?)"
            ) from None
        return memoryview(self._output.buffers[entry.buffer_index]).toreadonly()

    def digest(self, key: str) -> str:
        """The SHA-256 (hex) of ``key``'s bytes, without reading them: what a backend keys what it
        derives from them by (a map over a file gives its recorded checksum, checked on reading)."""
        self.get_data(key)  # a missing key: the same KeyError
        return self._output.digests[self._output.entries[key].buffer_index].hex()

    @contextlib.contextmanager
    def reading(self, keys: Iterable[str], *, unread: bool = False) -> Iterator[dict[str, memoryview]]:
        """The views of ``keys``, for a backend that hands them all to its runtime at once.

        A map over a file checks their checksums while the block runs, on another thread, so
        the runtime's loading overlaps the check, and raises the check's ``FormatError`` when
        the block ends; nothing made from the views in the block may outlive that error. Data
        held in memory, as here, needs no check.

        ``unread``: the backend runs something derived from these bytes instead (a machine-cache
        entry made from them): a damaged file is refused all the same, and each page is let go once
        checked, so the check costs no resident memory.
        """
        yield {key: self.get_data(key) for key in keys}

    def release_pages(self, key: str) -> None:
        """A hint that ``key``'s bytes need not stay in memory now: a backend that made its own
        form of them (packed weights) says so once it has. A map over a file lets the OS drop
        them from the process's resident memory (they are read from the file again if touched);
        here, data that is a view of a mapped file (weights bound from a checkpoint, tensors
        spilled while lowering) is let go the same way, and data held in memory stays."""
        release_buffer(self.get_data(key))

    def keys(self) -> Iterator[str]:
        return iter(self._output.entries)

    def __contains__(self, key: object) -> bool:
        return key in self._output.entries

    def __len__(self) -> int:
        return len(self._output.entries)
