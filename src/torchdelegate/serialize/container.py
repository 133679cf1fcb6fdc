"""The container both file kinds share: a fixed header, a JSON manifest, aligned segments.

::

    offset 0   header (64 bytes, little-endian)
               magic (8) | version u32 | reserved u32 = 0 | manifest length u64 |
               data offset u64 | SHA-256 of the manifest (32)
    offset 64  manifest: canonical JSON (UTF-8, sorted keys, no spaces)
    data offset: segments, each at data offset + its offset, zero padding between

The manifest's ``segments`` list gives each segment's offset (from the data offset, a
multiple of its alignment, at least 64), length and SHA-256; ``data_length`` is the size
of the data area, so the file is exactly ``data offset + data_length`` bytes. The reader
checks the header, the manifest's checksum and every segment's bounds when it opens a
file, and a segment's checksum the first time the segment is read (docs/FORMAT.md).
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import struct
import threading
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

from torchdelegate.errors import FormatError
from torchdelegate.exported.mapped_pages import CHUNK, release_pages, sha256_releasing, write_releasing
from torchdelegate.serialize.bounded_json import JsonLimitError, bounded_json
from torchdelegate.serialize.foreign_files import EXPORTED_PROGRAM, PICKLED, TORCH_SAVE_ADVICE, zip_kind

FORMAT_VERSION = 1
HEADER = struct.Struct("<8sIIQQ32s")
SEGMENT_ALIGNMENT = 64
MAX_ALIGNMENT = 1 << 16
MAX_MANIFEST_BYTES = 1 << 30


_ZIP_MAGIC = b"PK\x03\x04"  # torch.export.save writes a zip archive


_TRUNCATED = "it is truncated; copy it again, or save it again from its program"
_CORRUPT = "it is corrupt; copy it again, or save it again from its program"


def _zip_hint(path: str | os.PathLike[str]) -> str:
    """What to do with a zip given where a program file was expected, by what the zip holds."""
    kind = zip_kind(path)
    if kind == EXPORTED_PROGRAM:
        return (
            "; it is a torch.export.save file: lower it first "
            f"(torchdelegate.to_edge_transform_and_lower, or torchdelegate lower forward={path} ...)"
        )
    if kind == PICKLED:
        return f"; {TORCH_SAVE_ADVICE}"
    return "; it is a zip archive, not a program file"


class ChangedDataError(ValueError):
    """A segment's bytes no longer have the digest they were added with."""

    def __init__(self, digest: bytes) -> None:
        super().__init__(digest.hex())
        self.digest = digest


@dataclass(frozen=True)
class SegmentSource:
    """A segment to write: its bytes, their SHA-256, and the alignment its reader needs."""

    data: bytes | memoryview
    digest: bytes
    alignment: int = SEGMENT_ALIGNMENT
    recheck: bool = True
    """Hash the bytes again as they are written: the digest was computed earlier (when named
    data was added, at lowering), and the tensor behind them may have been written since."""


def canonical_json(document: Any) -> bytes:
    """The one byte form of a manifest: sorted keys, no spaces, ASCII, no NaN."""
    return json.dumps(document, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def inflated_json(data: bytes | memoryview, limit: int) -> Any:
    """The JSON value zlib-compressed in ``data``, which an author wrote: ``ValueError`` unless it is
    one whole stream that inflates to at most ``limit`` bytes, with nothing after it, of JSON."""
    inflater = zlib.decompressobj()
    try:
        text = inflater.decompress(data, limit)
        if inflater.unconsumed_tail or inflater.unused_data or not inflater.eof:
            raise ValueError(f"not one whole zlib stream of at most {limit} bytes")
    except zlib.error as e:
        raise ValueError(str(e) or type(e).__name__) from None
    return bounded_json(text, limit)


def framed(header: Any, *payload: bytes | memoryview) -> bytes:
    """``header`` as canonical JSON behind its 8-byte little-endian length, then ``payload``: the form
    of the shipped backends' blobs, of compile units sent to workers and of compile cache entries."""
    text = canonical_json(header)
    return b"".join([len(text).to_bytes(8, "little"), text, *payload])


def unframed(data: memoryview) -> tuple[Any, memoryview]:
    """The header and payload of :func:`framed` bytes; a ``ValueError`` if they are not framed, or the
    header is not JSON within the bounded reader's limits."""
    size = int.from_bytes(data[:8], "little")
    if len(data) < 8 or 8 + size > len(data):
        raise ValueError(f"a header of {size} bytes does not fit in {len(data)} bytes")
    return bounded_json(data[8 : 8 + size], MAX_MANIFEST_BYTES), data[8 + size :]


class FramePayload:
    """A framed payload as it is built: each part placed after the last, found again by its span."""

    def __init__(self) -> None:
        self.parts: list[bytes | memoryview] = []
        self._size = 0

    def place(self, data: bytes | memoryview) -> list[int]:
        """Add ``data``; its span, ``[offset, length]``."""
        span = [self._size, len(data)]
        self.parts.append(data)
        self._size += len(data)
        return span


def span_of(payload: memoryview, span: Any) -> memoryview:
    """The part of a framed payload at ``span`` (``[offset, length]``); a ``ValueError`` if it lies outside."""
    start, length = span
    if not (isinstance(start, int) and isinstance(length, int) and 0 <= start and 0 <= length):
        raise ValueError(f"a span {span!r:.80} is not two sizes")
    if start + length > len(payload):
        raise ValueError(f"a span {span!r:.80} lies outside its payload of {len(payload)} bytes")
    return payload[start : start + length]


def _align(value: int, alignment: int) -> int:
    return -(-value // alignment) * alignment


def layout_segments(sources: Sequence[SegmentSource]) -> tuple[list[dict[str, Any]], int, int]:
    """The manifest's segment table, the data area's length, and the largest alignment."""
    table = []
    position = 0
    largest = SEGMENT_ALIGNMENT
    for source in sources:
        if source.alignment > MAX_ALIGNMENT:
            raise ValueError(f"alignment {source.alignment} is larger than the format allows ({MAX_ALIGNMENT})")
        alignment = max(SEGMENT_ALIGNMENT, source.alignment)
        largest = max(largest, alignment)
        position = _align(position, alignment)
        table.append(
            {"offset": position, "length": len(source.data), "sha256": source.digest.hex(), "alignment": alignment}
        )
        position += len(source.data)
    return table, position, largest


def write_container(
    path: Path, magic: bytes, manifest: dict[str, Any], sources: Sequence[SegmentSource], largest_alignment: int
) -> int:
    """Write header, manifest and segments to ``path`` atomically (a temporary file, then a rename).

    ``manifest`` must already hold the table of :func:`layout_segments`. Returns the file's size.
    """
    manifest_bytes = canonical_json(manifest)
    data_offset = _align(HEADER.size + len(manifest_bytes), largest_alignment)
    header = HEADER.pack(
        magic, FORMAT_VERSION, 0, len(manifest_bytes), data_offset, hashlib.sha256(manifest_bytes).digest()
    )
    path = Path(path)
    if not path.parent.is_dir():
        where = f"cannot save {str(path)!r}: its directory {str(path.parent)!r}"
        raise FileNotFoundError(f"{where} does not exist; create it first")
    # A unique name beside the target (so the rename is atomic), created with the user's umask.
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(temporary, "xb") as out:
            out.write(header)
            out.write(manifest_bytes)
            _pad(out, data_offset - HEADER.size - len(manifest_bytes))
            position = 0
            for entry, source in zip(manifest["segments"], sources, strict=True):
                if source.recheck and sha256_releasing(source.data) != source.digest:
                    raise ChangedDataError(source.digest)
                _pad(out, entry["offset"] - position)
                write_releasing(out, source.data)
                position = entry["offset"] + len(source.data)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return data_offset + int(manifest["data_length"])


def _pad(out: BinaryIO, count: int) -> None:
    if count:
        out.write(b"\0" * count)


class Segment(NamedTuple):
    """Where a segment's bytes are in the file, their SHA-256, and the alignment they were written at."""

    start: int
    length: int
    digest: bytes
    alignment: int


class Container:
    """A mapped file whose header, manifest and segment bounds have been checked.

    Segments are zero-copy views of a private (copy-on-write) mapping: tensors can be
    built over them without a copy, and writes never reach the file.
    """

    def __init__(self, path: str | os.PathLike[str], magic: bytes, kind: str) -> None:
        self.path = Path(path)
        self.kind = kind
        try:
            with open(self.path, "rb") as handle:
                stat = os.fstat(handle.fileno())
                size = stat.st_size
                header = handle.read(HEADER.size)
                self.manifest, data_offset = self._read_manifest(handle, header, size, magic)
                self._mapping: mmap.mmap | None = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
        except FileNotFoundError:
            raise FileNotFoundError(f"no {kind} file at {str(self.path)!r}") from None
        except OSError as e:
            if isinstance(e, FormatError):
                raise
            raise FormatError(f"{self.path}: cannot read the {kind} file: {e}") from e
        self._view = memoryview(self._mapping)
        self.identity = [stat.st_dev, stat.st_ino, size, stat.st_mtime_ns, stat.st_ctime_ns, header.hex()]
        """The file as this process opened it: which file (device, inode), unchanged since when (any write
        moves its change time, which no user may set back), and its header (the manifest's checksum)."""
        self._data_offset = data_offset
        self.segments = self._check_segments(size - data_offset)
        self._verified = [False] * len(self.segments)

    def _error(self, message: str) -> FormatError:
        return FormatError(f"{self.path}: {message}")

    def _read_manifest(self, handle: BinaryIO, header: bytes, size: int, magic: bytes) -> tuple[dict[str, Any], int]:
        if len(header) < HEADER.size:
            raise self._error(
                f"{size} bytes is too short for a {self.kind} file (its header alone is 64 bytes): {_TRUNCATED}"
            )
        found, version, reserved, manifest_length, data_offset, digest = HEADER.unpack(header)
        if found != magic:
            hint = ""
            if found.startswith(_ZIP_MAGIC):
                hint = _zip_hint(self.path)
            raise self._error(f"not a torchdelegate {self.kind} file (magic bytes {found!r} at offset 0){hint}")
        if version != FORMAT_VERSION:
            raise self._error(
                f"format version {version} at offset 8; this torchdelegate reads version {FORMAT_VERSION} "
                "(write the file again with this version, or upgrade torchdelegate)"
            )
        if reserved != 0:
            raise self._error(f"reserved header field at offset 12 is {reserved}, expected 0")
        if manifest_length > MAX_MANIFEST_BYTES:
            raise self._error(f"manifest length {manifest_length} at offset 16 is past any manifest's: {_CORRUPT}")
        if manifest_length > size - HEADER.size:
            where = f"its manifest length {manifest_length} at offset 16"
            raise self._error(f"the file is {size} bytes, and {where} ends past it: {_TRUNCATED}")
        if data_offset > size:
            where = f"its data offset {data_offset} at offset 24"
            raise self._error(f"the file is {size} bytes, and {where} is past it: {_TRUNCATED}")
        if data_offset < HEADER.size + manifest_length or data_offset % SEGMENT_ALIGNMENT:
            where = f"data offset {data_offset} at offset 24"
            raise self._error(f"{where} is inside the manifest or not 64-byte aligned: {_CORRUPT}")
        manifest_bytes = handle.read(manifest_length)
        if len(manifest_bytes) != manifest_length or hashlib.sha256(manifest_bytes).digest() != digest:
            raise self._error("manifest checksum mismatch (offset 64): the file is corrupt or truncated")
        try:
            manifest = bounded_json(manifest_bytes, MAX_MANIFEST_BYTES)
        except JsonLimitError as e:
            raise self._error(f"the manifest cannot be read: {e}") from None
        if not isinstance(manifest, dict):
            raise self._error("the manifest is not a JSON object")
        data_length = manifest.get("data_length")
        if type(data_length) is not int:
            raise self._error(f"the manifest's data_length is {data_length!r}, not a number of bytes: {_CORRUPT}")
        if data_offset + data_length != size:
            said = f"the file is {size} bytes; its manifest says {data_offset} + data_length {data_length}"
            cause = _TRUNCATED if size < data_offset + data_length else "bytes were appended to it; copy it again"
            raise self._error(f"{said}: {cause}")
        return manifest, data_offset

    def _check_segments(self, data_length: int) -> list[Segment]:
        table = self.manifest.get("segments")
        if not isinstance(table, list):
            raise self._error("the manifest has no segment table")
        segments = []
        for number, entry in enumerate(table):
            fields = entry if isinstance(entry, dict) else {}
            offset, length, digest = fields.get("offset"), fields.get("length"), fields.get("sha256")
            alignment = fields.get("alignment")
            if not (type(offset) is type(length) is type(alignment) is int) or not _is_digest(digest):
                raise self._error(f"segment {number}: needs integer offset, length, alignment and a hex sha256")
            start = self._data_offset + offset
            if not _valid_alignment(alignment) or start % alignment:
                raise self._error(f"segment {number}: alignment {alignment} is invalid or not met by offset {start}")
            if offset < 0 or length < 0 or offset + length > data_length:
                raise self._error(
                    f"segment {number}: offset {offset} and length {length} fall outside the data area "
                    f"({data_length} bytes at file offset {self._data_offset})"
                )
            segments.append(Segment(start, length, bytes.fromhex(str(digest)), alignment))
        return segments

    def segment(self, number: int, what: str, *, verify: bool = True, release: bool = False) -> memoryview:
        """Segment ``number``'s bytes, its checksum verified on first use; ``what`` names it in errors.
        ``release``: the caller will not read the bytes, so each page checked is let go (see
        :meth:`release_pages`; only for a segment nothing writes)."""
        start, length, digest, _ = self.segments[number]
        view = self._view[start : start + length]
        if verify and not self._verified[number]:
            found = self._digest_letting_go(start, length) if release else hashlib.sha256(view).digest()
            if found != digest:
                raise self._error(
                    f"checksum mismatch in segment {number} ({what}, {length} bytes at offset {start}): "
                    "the file is corrupt"
                )
            self._verified[number] = True
        return view

    def _digest_letting_go(self, start: int, length: int) -> bytes:
        """The SHA-256 of ``[start, start + length)``, a chunk at a time, each chunk's pages released after."""
        digest = hashlib.sha256()
        for offset in range(start, start + length, CHUNK):
            end = min(offset + CHUNK, start + length)
            digest.update(self._view[offset:end])
            if self._mapping is not None:
                release_pages(self._mapping, offset, end - offset)
        return digest.digest()

    def release_pages(self, number: int) -> None:
        """Let the OS drop the pages that lie wholly inside segment ``number`` from this process's
        resident memory; they are read from the file again when next touched.

        Only for a segment nothing has written: the mapping is private, so a page written
        through it would go back to the file's bytes. The program's mutable state is a copy,
        and named data is handed out read-only.
        """
        start, length, _, _ = self.segments[number]
        if self._mapping is not None:
            release_pages(self._mapping, start, length)

    def verify_all(self) -> None:
        """Check every segment's checksum now."""
        for number in range(len(self.segments)):
            self.segment(number, f"segment {number}")

    def close(self) -> None:
        """Drop this container's references to the mapping; it is unmapped once no tensor or
        view made from it is alive (closing it under them would leave them dangling)."""
        self._view = memoryview(b"")
        self._mapping = None


def _valid_alignment(alignment: int) -> bool:
    return SEGMENT_ALIGNMENT <= alignment <= MAX_ALIGNMENT and not alignment & (alignment - 1)


def _is_digest(value: Any) -> bool:
    return isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)
