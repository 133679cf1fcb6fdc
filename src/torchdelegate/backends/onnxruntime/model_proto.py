"""An ONNX model's bytes read without the ``onnx`` package: the fields the run-time checks look at.

Making a session checks what a blob's model may reach (``confinement.py``) and which outputs may be
written in place (``in_place.py``). Both read a few fields of the model: nodes, their domains and
attributes, tensors' external data, opset imports, metadata. This reader decodes the protocol-buffer
wire format for those fields only, skipping the rest by length, so a process that runs files needs
neither ``onnx`` nor its protobuf runtime (nor their import and memory).

It is strict where a lenient reader and ONNX Runtime's could disagree about the model: a field this
reader knows, given twice where it is singular or with another wire type than ONNX's, a group, an
unknown ``data_location``, a truncated value, a string that is not UTF-8, or nesting past
``MAX_DEPTH`` is a ``ModelProtoError``. Anything it accepts, protobuf reads the same way.
"""

from __future__ import annotations

from typing import Any

MAX_DEPTH = 64
"""Messages nested deeper than this are refused (protobuf's own parser stops at 100)."""

EXTERNAL = 1  # TensorProto.DataLocation.EXTERNAL
_VARINT, _FIXED64, _BYTES, _START_GROUP, _END_GROUP, _FIXED32 = 0, 1, 2, 3, 4, 5
_STRING, _RAW, _ENUM = "string", "bytes", "enum"

# message: {field number: (name, type (a message's name, or _STRING/_RAW/_ENUM), repeated)}
_SCHEMA: dict[str, dict[int, tuple[str, str, bool]]] = {
    "ModelProto": {
        7: ("graph", "GraphProto", False),
        8: ("opset_import", "OperatorSetIdProto", True),
        14: ("metadata_props", "StringStringEntryProto", True),
        20: ("training_info", "TrainingInfoProto", True),
        25: ("functions", "FunctionProto", True),
    },
    "OperatorSetIdProto": {1: ("domain", _STRING, False)},
    "StringStringEntryProto": {1: ("key", _STRING, False), 2: ("value", _STRING, False)},
    "TrainingInfoProto": {1: ("initialization", "GraphProto", False), 2: ("algorithm", "GraphProto", False)},
    "FunctionProto": {
        1: ("name", _STRING, False),
        7: ("node", "NodeProto", True),
        10: ("domain", _STRING, False),
        11: ("attribute_proto", "AttributeProto", True),
    },
    "GraphProto": {
        1: ("node", "NodeProto", True),
        5: ("initializer", "TensorProto", True),
        12: ("output", "ValueInfoProto", True),
        15: ("sparse_initializer", "SparseTensorProto", True),
    },
    "ValueInfoProto": {1: ("name", _STRING, False)},
    "NodeProto": {
        1: ("input", _STRING, True),
        2: ("output", _STRING, True),
        3: ("name", _STRING, False),
        4: ("op_type", _STRING, False),
        5: ("attribute", "AttributeProto", True),
        7: ("domain", _STRING, False),
    },
    "AttributeProto": {
        1: ("name", _STRING, False),
        4: ("s", _RAW, False),
        5: ("t", "TensorProto", False),
        6: ("g", "GraphProto", False),
        10: ("tensors", "TensorProto", True),
        11: ("graphs", "GraphProto", True),
        22: ("sparse_tensor", "SparseTensorProto", False),
        23: ("sparse_tensors", "SparseTensorProto", True),
    },
    "TensorProto": {
        8: ("name", _STRING, False),
        13: ("external_data", "StringStringEntryProto", True),
        14: ("data_location", _ENUM, False),
    },
    "SparseTensorProto": {1: ("values", "TensorProto", False), 2: ("indices", "TensorProto", False)},
}
_ENUM_VALUES = {"data_location": frozenset({0, EXTERNAL})}
_DEFAULTS = {_STRING: "", _RAW: b"", _ENUM: 0}


class ModelProtoError(ValueError):
    """The bytes are not an ONNX model this reader reads exactly as protobuf does."""


class Message:
    """A decoded message: its known fields as attributes (a repeated one a list, an absent one its
    default: ``""``, ``b""``, 0, or an empty message), and ``HasField`` for singular messages."""

    __slots__ = ("_kind", "_fields")

    def __init__(self, kind: str, fields: dict[str, Any]) -> None:
        self._kind = kind
        self._fields = fields

    def __getattr__(self, name: str) -> Any:
        fields = object.__getattribute__(self, "_fields")
        if name in fields:
            return fields[name]
        for field, kind, repeated in _SCHEMA[object.__getattribute__(self, "_kind")].values():
            if field == name:
                return [] if repeated else _DEFAULTS.get(kind) if kind in _DEFAULTS else Message(kind, {})
        raise AttributeError(f"{object.__getattribute__(self, '_kind')} has no field {name!r} this reader reads")

    def HasField(self, name: str) -> bool:  # noqa: N802 - protobuf's name, which the checks call
        return name in self._fields


def read_model(data: bytes) -> Message:
    """The ``ModelProto`` in ``data``; a ``ModelProtoError`` saying what is wrong with it."""
    return _message(memoryview(data), "ModelProto", 0)


def _message(data: memoryview, kind: str, depth: int) -> Message:
    if depth > MAX_DEPTH:
        raise ModelProtoError(f"messages nested deeper than {MAX_DEPTH} levels")
    schema = _SCHEMA[kind]
    fields: dict[str, Any] = {}
    position, end = 0, len(data)
    while position < end:
        start = position
        key, position = _varint(data, position)
        if key > 0xFFFFFFFF or position - start > 5:  # protobuf reads a key in 5 bytes, its low 32 bits
            raise ModelProtoError(f"{kind}: a field's key is longer than protobuf reads one")
        number, wire = key >> 3, key & 7
        if number == 0 or wire in (_START_GROUP, _END_GROUP) or wire > _FIXED32:
            raise ModelProtoError(f"{kind}: field {number} has wire type {wire}, which ONNX never writes")
        known = schema.get(number)
        if known is None:
            position = _skipped(data, position, wire)
            continue
        name, field_kind, repeated = known
        expected = _VARINT if field_kind == _ENUM else _BYTES
        if wire != expected:
            raise ModelProtoError(f"{kind}.{name} has wire type {wire}, not {expected}")
        if not repeated and name in fields:
            raise ModelProtoError(f"{kind}.{name} is given twice")
        if field_kind == _ENUM:
            value, position = _varint(data, position)
            if value not in _ENUM_VALUES[name]:
                raise ModelProtoError(f"{kind}.{name} is {value}, which ONNX does not define")
        else:
            length, position = _varint(data, position)
            if length > end - position:
                raise ModelProtoError(f"{kind}.{name} runs past the end of its message")
            chunk = data[position : position + length]
            position += length
            value = _value(chunk, field_kind, kind, name, depth)
        if repeated:
            fields.setdefault(name, []).append(value)
        else:
            fields[name] = value
    return Message(kind, fields)


def _value(chunk: memoryview, field_kind: str, kind: str, name: str, depth: int) -> Any:
    if field_kind == _RAW:
        return bytes(chunk)
    if field_kind == _STRING:
        try:
            return bytes(chunk).decode("utf-8")
        except UnicodeDecodeError:
            raise ModelProtoError(f"{kind}.{name} is not UTF-8 text") from None
    return _message(chunk, field_kind, depth + 1)


def _varint(data: memoryview, position: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if position >= len(data):
            raise ModelProtoError("a number runs past the end of its message")
        byte = data[position]
        position += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, position
        shift += 7
        if shift >= 64:
            raise ModelProtoError("a number longer than 64 bits")


def _skipped(data: memoryview, position: int, wire: int) -> int:
    """The position after a field this reader does not read."""
    if wire == _VARINT:
        return _varint(data, position)[1]
    size = {_FIXED64: 8, _FIXED32: 4}.get(wire)
    if size is None:
        size, position = _varint(data, position)
    if size > len(data) - position:
        raise ModelProtoError("a field runs past the end of its message")
    return position + size
