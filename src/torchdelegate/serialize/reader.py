"""Reading a program file: a checked manifest, and the bytes each part of it names.

Opening maps the file (and its external data file) and checks the headers, the manifests'
checksums, every segment's bounds and every manifest field's type, without reading any
segment. A segment's checksum is checked the first time it is read. Any problem is a
:class:`~torchdelegate.errors.FormatError` naming the file and the offending part.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from torchdelegate.errors import FormatError
from torchdelegate.serialize.container import Container, inflated_json
from torchdelegate.serialize.manifest import (
    DATA_MAGIC,
    MAX_REPORT_BYTES,
    PROGRAM_MAGIC,
    ExternalDataRecord,
    ProgramManifest,
    check_data_manifest,
)


class ProgramFile:
    """A program file (and its external data file), checked and mapped."""

    def __init__(self, path: str | os.PathLike[str], external_data_path: str | os.PathLike[str] | None = None) -> None:
        self.container = Container(path, PROGRAM_MAGIC, "program")
        self.path = self.container.path
        manifest = ProgramManifest.from_json(self.container.manifest, self.path)
        self.producer = manifest.producer
        self._locations: dict[str, tuple[Container, int]] = {}
        for number, segment in enumerate(self.container.segments):
            self._locations.setdefault(segment.digest.hex(), (self.container, number))
        self.external: Container | None = None
        if manifest.external_data is not None:
            self.external = self._open_external(manifest.external_data, external_data_path)
        self.methods = manifest.methods
        self.delegates = manifest.delegates
        self.state = manifest.state
        self.named_data = manifest.named_data
        self._report = manifest.report
        self._report_segment = manifest.report_segment
        self._asset_records = manifest.assets
        self._check_references()
        self.assets = {asset.name: asset.data for asset in manifest.assets}
        """Each asset's name and the SHA-256 of its segment."""

    def _open_external(self, record: ExternalDataRecord, given: str | os.PathLike[str] | None) -> Container:
        name = record.file_name
        path = Path(given) if given is not None else self.path.parent / name
        try:
            exists = path.is_file()
        except OSError as e:
            raise FormatError(f"{self.path}: external data file {name!r}: {e}") from None
        if not exists:
            raise FileNotFoundError(
                f"{self.path} keeps its data in an external file {name!r}, not found at {str(path)!r}; "
                "pass external_data_path= to say where it is"
            )
        external = Container(path, DATA_MAGIC, "external data")
        check_data_manifest(external.manifest, external.path)
        available = {s.digest.hex(): (n, s.length) for n, s in enumerate(external.segments)}
        for digest, length in record.segments:
            found = available.get(digest)
            if found is None or found[1] != length:
                raise FormatError(
                    f"{external.path} lacks the {length}-byte segment sha256:{digest[:16]}… that {self.path} needs; "
                    "is it the data file this program was saved with?"
                )
            self._locations.setdefault(digest, (external, found[0]))
        return external

    def _check_references(self) -> None:
        for record in self.delegates:
            self._location(record.blob, f"the blob of delegate {record.name!r}")
        for state in self.state:
            if state.data is not None:
                self._location(state.data, f"state {state.name!r}")
        for named in self.named_data:
            container, number = self._location(named.data, f"named data {named.key!r}")
            start = container.segments[number].start
            if start % named.alignment:
                raise FormatError(
                    f"{self.path}: named data {named.key!r} needs {named.alignment}-byte alignment; "
                    f"its segment is at offset {start}"
                )
        for asset in self._asset_records:
            self._location(asset.data, f"asset {asset.name!r}")
        if self._report_segment is not None:
            self._location(self._report_segment, "the partition report")
        for method in self.methods:
            for index in method.delegates:
                if not 0 <= index < len(self.delegates):
                    raise FormatError(
                        f"{self.path}: method {method.name!r} names delegate {index}, which does not exist"
                    )
        for what, names in (
            ("method name", [m.name for m in self.methods]),
            ("state name", [s.name for s in self.state]),
            ("named data key", [n.key for n in self.named_data]),
            ("asset name", [a.name for a in self._asset_records]),
        ):
            if len(set(names)) != len(names):
                twice = sorted({n for n in names if names.count(n) > 1})[:3]
                raise FormatError(f"{self.path}: {what} {', '.join(map(repr, twice))} appears twice")
        for method in self.methods:
            if len(set(method.delegates)) != len(method.delegates):
                raise FormatError(f"{self.path}: method {method.name!r} lists a delegate twice")

    def _location(self, digest: str, what: str) -> tuple[Container, int]:
        location = self._locations.get(digest)
        if location is None:
            raise FormatError(
                f"{self.path}: {what} refers to segment sha256:{digest[:16]}…, which is in no segment table"
            )
        return location

    def segment_length(self, digest: str, what: str) -> int:
        """The byte length of a segment, without reading it."""
        container, number = self._location(digest, what)
        return container.segments[number].length

    def report(self) -> dict[str, Any] | None:
        """The partition report saved with the program, read from its segment now (None: none saved);
        a ``FormatError`` if it is not a whole, compressed JSON object."""
        if self._report_segment is None:
            return self._report
        compressed = self.data(self._report_segment, "the partition report")
        try:
            value = inflated_json(compressed, MAX_REPORT_BYTES)
        except ValueError as e:
            raise FormatError(f"{self.path}: the partition report cannot be read ({e})") from None
        if not isinstance(value, dict):
            raise FormatError(f"{self.path}: the partition report is {type(value).__name__}; expected an object")
        return value

    def data(self, digest: str, what: str, *, verify: bool = True, release: bool = False) -> memoryview:
        """The bytes of the segment ``digest`` names, checked against it the first time (if ``verify``);
        ``release``: as :meth:`Container.segment`'s."""
        container, number = self._location(digest, what)
        return container.segment(number, what, verify=verify, release=release)

    def release_pages(self, digest: str) -> None:
        """Let the OS drop the segment's pages from memory (see :meth:`Container.release_pages`)."""
        container, number = self._location(digest, "released data")
        container.release_pages(number)

    def identity(self) -> list[list[object]]:
        """The identities of the files the program was read from (its data file's too): see
        :attr:`Container.identity`."""
        return [self.container.identity] + ([self.external.identity] if self.external is not None else [])

    def close(self) -> None:
        self.container.close()
        if self.external is not None:
            self.external.close()
