"""The program file's manifest: its records, their JSON field names, and the checks on them.

The writer makes these records and writes their JSON; the reader reads JSON back into them.
A field's name is written here only. docs/FORMAT.md is the specification; every record
read is checked for the presence and type of each field (a problem is a FormatError naming
the file and the field), before any segment it names is read.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from torchdelegate.delegate.specs import CompileSpec
from torchdelegate.errors import FormatError, located

PROGRAM_MAGIC = b"\x89TDP\r\n\x1a\n"
DATA_MAGIC = b"\x89TDD\r\n\x1a\n"
PROGRAM_FORMAT = "torchdelegate.program"
DATA_FORMAT = "torchdelegate.delegate.named_data"
REPORT_COMPRESSION = 6  # zlib's level for a saved partition report
MAX_REPORT_BYTES = 1 << 28  # what a saved report may inflate to

T = TypeVar("T")


class Fields:
    """Typed access to one JSON object of the manifest; anything missing or mistyped is a FormatError."""

    def __init__(self, value: Any, where: str) -> None:
        if not isinstance(value, dict):
            raise FormatError(f"{where} must be a JSON object")
        self.value, self.where = value, where

    def get(self, key: str, kind: type[T], check: Callable[[T], bool] = lambda _: True) -> T:
        value = self.value.get(key)
        if type(value) is not kind or not check(value):
            raise FormatError(f"{self.where}: field {key!r} is missing or invalid ({value!r:.80})")
        return value

    def records(self, key: str, read: Callable[[Any, str], T]) -> list[T]:
        """The list under ``key``, each item read by ``read(value, where)``."""
        values = self.value.get(key)
        where = key if self.where == "manifest" else f"{self.where}.{key}"
        if not isinstance(values, list):
            raise FormatError(f"{where} must be a JSON list")
        return [read(value, f"{where}[{index}]") for index, value in enumerate(values)]


@dataclass(frozen=True)
class MethodRecord:
    name: str
    graph: dict[str, Any]
    delegates: list[int]
    """Indices into the manifest's delegates."""

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "graph": self.graph, "delegates": self.delegates}

    @classmethod
    def from_json(cls, value: Any, where: str) -> MethodRecord:
        fields = Fields(value, where)
        delegates = fields.get("delegates", list)
        if any(type(d) is not int for d in delegates):
            raise FormatError(f"{where}.delegates must be integers")
        return cls(fields.get("name", str, bool), fields.get("graph", dict), delegates)


def from_pairs(pairs: list[list[Any]]) -> dict[Any, Any]:
    """A debug handle map from its JSON form, ``[[identifier, handles], ...]``: lists read as tuples."""
    return {_frozen(key): _frozen(value) for key, value in pairs}


def as_pairs(handles: dict[Any, Any]) -> list[list[Any]]:
    """A debug handle map in its JSON form, in its own order (a writer sorts it)."""
    return [[_thawed(key), _thawed(value)] for key, value in handles.items()]


def _frozen(value: Any) -> Any:
    return tuple(_frozen(v) for v in value) if isinstance(value, list) else value


def _thawed(value: Any) -> Any:
    return [_thawed(v) for v in value] if isinstance(value, (list, tuple)) else value


@dataclass(frozen=True)
class DelegateRecord:
    name: str
    method: str
    backend_id: str
    blob: str
    """The segment of the blob (its SHA-256, hex)."""
    compile_specs: list[CompileSpec]
    input_kinds: str
    """One letter per input: ``T`` a tensor, ``S`` a symbolic size."""
    output_count: int
    debug_handle_map: dict[Any, Any] | None
    """The backend's map, ``identifier -> debug handles`` (lists read as tuples); None if it gave none."""
    delegate_info: Any = None
    """What the backend's ``preprocess`` said about this delegate (a JSON value); None if nothing."""

    def to_json(self) -> dict[str, Any]:
        entry = {
            "name": self.name,
            "method": self.method,
            "backend_id": self.backend_id,
            "blob": self.blob,
            "compile_specs": [
                {"key": spec.key, "value": base64.b64encode(spec.value).decode("ascii")} for spec in self.compile_specs
            ],
            "inputs": self.input_kinds,
            "outputs": self.output_count,
            "debug_handle_map": None if self.debug_handle_map is None else as_pairs(self.debug_handle_map),
        }
        return entry if self.delegate_info is None else {**entry, "delegate_info": self.delegate_info}

    @classmethod
    def from_json(cls, value: Any, where: str) -> DelegateRecord:
        fields = Fields(value, where)
        specs = []
        for number, spec in enumerate(fields.get("compile_specs", list)):
            spec_fields = Fields(spec, f"{where}.compile_specs[{number}]")
            try:
                raw = base64.b64decode(spec_fields.get("value", str), validate=True)
            except (binascii.Error, ValueError):
                raise FormatError(f"{where}.compile_specs[{number}] is not base64") from None
            specs.append(CompileSpec(spec_fields.get("key", str), raw))
        handles = value.get("debug_handle_map")
        if handles is not None and not (
            isinstance(handles, list) and all(isinstance(p, list) and len(p) == 2 for p in handles)
        ):
            raise FormatError(f"{where}.debug_handle_map must be a list of [identifier, handles] pairs or null")
        info = value.get("delegate_info")  # optional, any JSON value: files of backends that return none lack it
        return cls(
            name=fields.get("name", str),
            method=fields.get("method", str),
            backend_id=fields.get("backend_id", str, bool),
            blob=fields.get("blob", str),
            compile_specs=specs,
            input_kinds=fields.get("inputs", str, lambda v: set(v) <= {"T", "S"}),
            output_count=fields.get("outputs", int, lambda v: 0 <= v <= 1 << 20),
            debug_handle_map=None if handles is None else from_pairs(handles),
            delegate_info=info,
        )


@dataclass(frozen=True)
class StateRecord:
    name: str
    dtype: str
    shape: list[int]
    data: str | None
    """The segment of the tensor's bytes; None for a tensor of zeros."""
    mutable: bool

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "shape": self.shape, "data": self.data, "mutable": self.mutable}

    @classmethod
    def from_json(cls, value: Any, where: str) -> StateRecord:
        fields = Fields(value, where)
        data = None if value.get("data") is None else fields.get("data", str)
        return cls(
            fields.get("name", str, bool), fields.get("dtype", str), fields.get("shape", list), data,
            fields.get("mutable", bool),
        )  # fmt: skip


@dataclass(frozen=True)
class NamedDataRecord:
    key: str
    data: str
    alignment: int

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "data": self.data, "alignment": self.alignment}

    @classmethod
    def from_json(cls, value: Any, where: str) -> NamedDataRecord:
        fields = Fields(value, where)
        alignment = fields.get("alignment", int, lambda v: v >= 1 and not v & (v - 1))
        return cls(fields.get("key", str, bool), fields.get("data", str), alignment)


ASSET_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")
"""An asset's name: a plain file name (no directory, not hidden), at most 128 characters."""


@dataclass(frozen=True)
class AssetRecord:
    """A file a program carries for its users (a tokenizer, a generation config): bytes the
    runtime never interprets, in a segment of the program file."""

    name: str
    data: str

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "data": self.data}

    @classmethod
    def from_json(cls, value: Any, where: str) -> AssetRecord:
        fields = Fields(value, where)
        return cls(fields.get("name", str, lambda v: ASSET_NAME.fullmatch(v) is not None), fields.get("data", str))


@dataclass(frozen=True)
class ExternalDataRecord:
    """The external data file a program keeps its data in, and the segments it needs from it."""

    file_name: str
    segments: list[tuple[str, int]]
    """(SHA-256 hex, length) of each segment."""

    def to_json(self) -> dict[str, Any]:
        return {"file_name": self.file_name, "segments": [{"sha256": d, "length": n} for d, n in self.segments]}

    @classmethod
    def from_json(cls, value: Any, where: str) -> ExternalDataRecord:
        fields = Fields(value, where)
        name = fields.get(
            "file_name",
            str,
            lambda v: 0 < len(v) <= 255 and "\0" not in v and Path(v).name == v and v not in (".", ".."),
        )

        def segment(entry: Any, at: str) -> tuple[str, int]:
            need = Fields(entry, at)
            return need.get("sha256", str), need.get("length", int)

        return cls(name, fields.records("segments", segment))


@dataclass(frozen=True)
class ProgramManifest:
    """Everything a program file's manifest says (the container adds its segment table)."""

    producer: dict[str, Any]
    methods: list[MethodRecord]
    delegates: list[DelegateRecord]
    state: list[StateRecord]
    named_data: list[NamedDataRecord]
    external_data: ExternalDataRecord | None = None
    report: dict[str, Any] | None = None
    """A partition report written inline (files of torchdelegate 0.1.0); now ``report_segment``."""
    assets: list[AssetRecord] = dataclasses.field(default_factory=list)
    report_segment: str | None = None
    """The SHA-256 of the segment holding the partition report (zlib-compressed JSON)."""

    def to_json(self) -> dict[str, Any]:
        manifest: dict[str, Any] = {
            "format": PROGRAM_FORMAT,
            "producer": self.producer,
            "methods": [m.to_json() for m in self.methods],
            "delegates": [d.to_json() for d in self.delegates],
            "state": [s.to_json() for s in self.state],
            "named_data": [n.to_json() for n in self.named_data],
            "external_data": None if self.external_data is None else self.external_data.to_json(),
        }
        if self.report is not None:
            manifest["report"] = self.report
        if self.assets:
            manifest["assets"] = [a.to_json() for a in self.assets]
        if self.report_segment is not None:
            manifest["report_segment"] = self.report_segment
        return manifest

    @classmethod
    def from_json(cls, value: Any, path: Path) -> ProgramManifest:
        """The manifest of the file at ``path``; a ``FormatError`` naming the file and the field otherwise."""
        with located(str(path)):
            return cls._from_json(value)

    @classmethod
    def _from_json(cls, value: Any) -> ProgramManifest:
        fields = Fields(value, "manifest")
        fields.get("format", str, lambda v: v == PROGRAM_FORMAT)
        producer = fields.get("producer", dict)
        external = None
        if value.get("external_data") is not None:
            external = ExternalDataRecord.from_json(fields.get("external_data", dict), "external_data")
        methods = fields.records("methods", MethodRecord.from_json)
        delegates = fields.records("delegates", DelegateRecord.from_json)
        state = fields.records("state", StateRecord.from_json)
        named_data = fields.records("named_data", NamedDataRecord.from_json)
        report = value.get("report")
        if report is not None and not isinstance(report, dict):
            raise FormatError(f"manifest field 'report' is {type(report).__name__}; expected an object")
        assets = fields.records("assets", AssetRecord.from_json) if "assets" in value else []
        report_segment = fields.get("report_segment", str) if "report_segment" in value else None
        return cls(producer, methods, delegates, state, named_data, external, report, assets, report_segment)


def data_manifest() -> dict[str, Any]:
    """The manifest of an external data file (the container adds its segment table)."""
    return {"format": DATA_FORMAT}


def check_data_manifest(value: Any, path: Path) -> None:
    with located(str(path)):
        Fields(value, "manifest").get("format", str, lambda v: v == DATA_FORMAT)
