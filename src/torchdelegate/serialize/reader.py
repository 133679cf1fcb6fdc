"""Reading a program file: a checked manifest, and the bytes each part of it names.

Opening maps the file (and its external data file) and checks the headers, the manifests'
checksums, every segment's bounds and every manifest field's type, without reading any
segment. A segment's checksum is checked the first time it is read. Any problem is a
:class:`~torchdelegate.errors.FormatError` naming the file and the offending part.
"""

from __future__ import annotations

import base64
import binascii
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from torchdelegate.errors import FormatError
from torchdelegate.serialize.container import Container
from torchdelegate.serialize.writer import DATA_FORMAT, DATA_MAGIC, PROGRAM_FORMAT, PROGRAM_MAGIC
from torchdelegate.specs import CompileSpec

T = TypeVar("T")


@dataclass(frozen=True)
class MethodRecord:
    name: str
    graph: dict[str, Any]
    delegates: list[int]


@dataclass(frozen=True)
class DelegateRecord:
    name: str
    method: str
    backend_id: str
    blob: str
    compile_specs: list[CompileSpec]
    input_kinds: str
    output_count: int
    debug_handle_map: list[Any] | None
    delegate_info: dict[str, Any] | None = None
    """What the backend's ``preprocess`` said about this delegate (JSON data); None if nothing."""


@dataclass(frozen=True)
class StateRecord:
    name: str
    dtype: str
    shape: list[int]
    data: str | None
    """The segment of the tensor's bytes; None for a tensor of zeros."""
    mutable: bool


@dataclass(frozen=True)
class NamedDataRecord:
    key: str
    data: str
    alignment: int


class _Fields:
    """Typed access to one JSON object of the manifest; anything missing or mistyped is a FormatError."""

    def __init__(self, value: Any, where: str, path: Path) -> None:
        if not isinstance(value, dict):
            raise FormatError(f"{path}: {where} must be a JSON object")
        self.value, self.where, self.path = value, where, path

    def get(self, key: str, kind: type[T], check: Callable[[T], bool] = lambda _: True) -> T:
        value = self.value.get(key)
        if type(value) is not kind or not check(value):
            raise FormatError(f"{self.path}: {self.where}: field {key!r} is missing or invalid ({value!r:.80})")
        return value


def _list(value: Any, where: str, path: Path) -> list[Any]:
    if not isinstance(value, list):
        raise FormatError(f"{path}: {where} must be a JSON list")
    return value


class ProgramFile:
    """A program file (and its external data file), checked and mapped."""

    def __init__(self, path: str | os.PathLike[str], external_data_path: str | os.PathLike[str] | None = None) -> None:
        self.container = Container(path, PROGRAM_MAGIC, "program")
        self.path = self.container.path
        manifest = _Fields(self.container.manifest, "manifest", self.path)
        manifest.get("format", str, lambda v: v == PROGRAM_FORMAT)
        self.producer = manifest.get("producer", dict)
        self._locations: dict[str, tuple[Container, int]] = {}
        for number, segment in enumerate(self.container.segments):
            self._locations.setdefault(segment.digest.hex(), (self.container, number))
        self.external: Container | None = None
        if manifest.value.get("external_data") is not None:
            self.external = self._open_external(manifest.get("external_data", dict), external_data_path)
        self.methods = [
            self._method(v, i) for i, v in enumerate(_list(manifest.value.get("methods"), "methods", self.path))
        ]
        self.delegates = [
            self._delegate(v, i) for i, v in enumerate(_list(manifest.value.get("delegates"), "delegates", self.path))
        ]
        self.state = [self._state(v, i) for i, v in enumerate(_list(manifest.value.get("state"), "state", self.path))]
        self.named_data = [
            self._named(v, i) for i, v in enumerate(_list(manifest.value.get("named_data"), "named_data", self.path))
        ]
        self._check_references()
        report = manifest.value.get("report")
        if report is not None and not isinstance(report, dict):
            raise FormatError(f"{self.path}: manifest field 'report' is {type(report).__name__}; expected an object")
        self.report: dict[str, Any] | None = report

    def _open_external(self, entry: dict[str, Any], given: str | os.PathLike[str] | None) -> Container:
        fields = _Fields(entry, "external_data", self.path)
        name = fields.get(
            "file_name",
            str,
            lambda v: 0 < len(v) <= 255 and "\0" not in v and Path(v).name == v and v not in (".", ".."),
        )
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
        _Fields(external.manifest, "manifest", external.path).get("format", str, lambda v: v == DATA_FORMAT)
        available = {s.digest.hex(): (n, s.length) for n, s in enumerate(external.segments)}
        for number, needed in enumerate(_list(fields.value.get("segments"), "external_data.segments", self.path)):
            need = _Fields(needed, f"external_data.segments[{number}]", self.path)
            digest, length = need.get("sha256", str), need.get("length", int)
            found = available.get(digest)
            if found is None or found[1] != length:
                raise FormatError(
                    f"{external.path} lacks the {length}-byte segment sha256:{digest[:16]}… that {self.path} needs; "
                    "is it the data file this program was saved with?"
                )
            self._locations.setdefault(digest, (external, found[0]))
        return external

    def _method(self, value: Any, index: int) -> MethodRecord:
        fields = _Fields(value, f"methods[{index}]", self.path)
        delegates = fields.get("delegates", list)
        if any(type(d) is not int for d in delegates):
            raise FormatError(f"{self.path}: methods[{index}].delegates must be integers")
        return MethodRecord(fields.get("name", str, bool), fields.get("graph", dict), delegates)

    def _delegate(self, value: Any, index: int) -> DelegateRecord:
        fields = _Fields(value, f"delegates[{index}]", self.path)
        specs = []
        for number, spec in enumerate(fields.get("compile_specs", list)):
            spec_fields = _Fields(spec, f"delegates[{index}].compile_specs[{number}]", self.path)
            try:
                raw = base64.b64decode(spec_fields.get("value", str), validate=True)
            except (binascii.Error, ValueError):
                raise FormatError(f"{self.path}: delegates[{index}].compile_specs[{number}] is not base64") from None
            specs.append(CompileSpec(spec_fields.get("key", str), raw))
        handles = value.get("debug_handle_map")
        if handles is not None and not isinstance(handles, list):
            raise FormatError(f"{self.path}: delegates[{index}].debug_handle_map must be a list or null")
        info = value.get("delegate_info")  # optional: files of backends that return none lack it
        if info is not None and not isinstance(info, dict):
            raise FormatError(f"{self.path}: delegates[{index}].delegate_info must be an object or absent")
        return DelegateRecord(
            name=fields.get("name", str),
            method=fields.get("method", str),
            backend_id=fields.get("backend_id", str, bool),
            blob=fields.get("blob", str),
            compile_specs=specs,
            input_kinds=fields.get("inputs", str, lambda v: set(v) <= {"T", "S"}),
            output_count=fields.get("outputs", int, lambda v: 0 <= v <= 1 << 20),
            debug_handle_map=handles,
            delegate_info=info,
        )

    def _state(self, value: Any, index: int) -> StateRecord:
        fields = _Fields(value, f"state[{index}]", self.path)
        data = None if value.get("data") is None else fields.get("data", str)
        return StateRecord(
            fields.get("name", str, bool),
            fields.get("dtype", str),
            fields.get("shape", list),
            data,
            fields.get("mutable", bool),
        )

    def _named(self, value: Any, index: int) -> NamedDataRecord:
        fields = _Fields(value, f"named_data[{index}]", self.path)
        alignment = fields.get("alignment", int, lambda v: v >= 1 and not v & (v - 1))
        return NamedDataRecord(fields.get("key", str, bool), fields.get("data", str), alignment)

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

    def data(self, digest: str, what: str, *, verify: bool = True) -> memoryview:
        """The bytes of the segment ``digest`` names, checked against it the first time (if ``verify``)."""
        container, number = self._location(digest, what)
        return container.segment(number, what, verify=verify)

    def release_pages(self, digest: str) -> None:
        """Let the OS drop the segment's pages from memory (see :meth:`Container.release_pages`)."""
        container, number = self._location(digest, "released data")
        container.release_pages(number)

    def close(self) -> None:
        self.container.close()
        if self.external is not None:
            self.external.close()
