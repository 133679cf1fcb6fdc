"""A blob read back: its header in the current version's terms, the model it holds or names, and the
named data its initializers name, each checked (a ``FormatError`` for a damaged or crafted blob).
"""

from __future__ import annotations

import lzma
from typing import Any, TypeGuard

from torchdelegate.backends.blob import pack, table_keys, unpack
from torchdelegate.backends.onnxruntime.settings import BLOB_VERSION, OLDER_BLOB_VERSIONS
from torchdelegate.delegate.named_data import NamedDataMap
from torchdelegate.errors import FormatError

_LARGEST_MODEL = 2**31  # bytes: protobuf's limit, so a model that inflates past it is not one
_INFLATER_MEMORY = 2**28  # bytes an inflater may take: the writer's window is at most 64 MiB


def model_blob(header: dict[str, Any], model: bytes) -> bytes:
    """A blob of ``header`` holding the ONNX ``model`` compressed (``"compression": "xz"``): once its
    weights are named data, a model's names and shapes are most of its bytes. For the models
    several delegates share (``linking.py``); a partition's own blob stays uncompressed, so that
    the compile cache finds the weights' keys in it."""
    window = max(4096, 1 << (len(model) - 1).bit_length())  # the model's size: no more memory than it needs
    filters = [{"id": lzma.FILTER_LZMA2, "preset": 6, "dict_size": min(window, 1 << 26)}]
    payload = lzma.compress(model, format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC64, filters=filters)
    return pack({**header, "version": BLOB_VERSION, "compression": "xz"}, payload)


def _model_bytes(header: dict[str, Any], payload: memoryview) -> memoryview:
    """The ONNX bytes of a model header's payload, inflated if its header says it is compressed."""
    compression = header.get("compression")
    if compression is None or not payload:
        return payload
    if compression != "xz":
        raise FormatError(f"onnxruntime blob: its model is compressed as {compression!r:.40}; this version reads xz")
    inflater = lzma.LZMADecompressor(format=lzma.FORMAT_XZ, memlimit=_INFLATER_MEMORY)
    try:
        model = inflater.decompress(payload, max_length=_LARGEST_MODEL)
    except lzma.LZMAError as e:
        raise FormatError(f"onnxruntime blob: its compressed model is damaged ({e})") from None
    if not inflater.eof:
        raise FormatError("onnxruntime blob: its compressed model is truncated or inflates past 2 GiB")
    return memoryview(model)


def unpacked(processed: memoryview) -> tuple[dict[str, Any], memoryview]:
    """A blob's header and its model's ONNX bytes (empty for a blob naming a stored model), an
    older blob's header in the current version's terms."""
    header, payload = unpack(processed, BLOB_VERSION, "onnxruntime", older=OLDER_BLOB_VERSIONS)
    payload = _model_bytes(header, payload)
    if header["version"] == 1:  # one partition's model: inputs and outputs in the header
        header = {
            "initializers": header.get("initializers"),
            "selector": None,
            "branch": 0,
            "branches": [{"inputs": header.get("inputs"), "outputs": header.get("outputs")}],
        }
    return header, payload


def blob_description(processed: memoryview) -> dict[str, Any] | None:
    """What a partition's header says of its model for people: the fused operators it got (count
    each), and the layers whose attention was left as exported, by reason. None if neither."""
    header = unpacked(processed)[0]
    described = {key: header[key] for key in ("fusions", "unfused") if header.get(key)}
    return described or None


def named_data_keys(processed: memoryview) -> list[str] | None:
    """Every named data a blob reads: its model's and that model's weights, or its own weights."""
    header = unpacked(processed)[0]
    if "model" in header:
        keys = header.get("keys")
        listed = [key for key in keys if isinstance(key, str)] if isinstance(keys, list) else []
        model = header["model"]
        return sorted({*listed, model}) if isinstance(model, str) else listed
    initializers = header.get("initializers")
    return table_keys(list(initializers.values()) if isinstance(initializers, dict) else None)


def model_key(key: Any, named_data: NamedDataMap) -> str:
    """The named data a blob names as its model, checked to be in the program."""
    if not isinstance(key, str):
        raise FormatError(f"onnxruntime blob: its model is named by {key!r:.80}, not a named-data key")
    if key not in named_data:
        raise FormatError(f"onnxruntime blob: its model, named data {key!r:.80}, is not in the program")
    return key


def model_of(processed: memoryview, named_data: NamedDataMap) -> tuple[dict[str, Any], memoryview]:
    """The model a blob runs, in the blob or in the named data it names: its header and its ONNX bytes."""
    header, payload = unpacked(processed)
    if header.get("model") is None:
        return header, payload
    return stored_model(model_key(header["model"], named_data), named_data)


def stored_model(key: str, named_data: NamedDataMap) -> tuple[dict[str, Any], memoryview]:
    """The model stored as named data ``key``: its header and its ONNX bytes."""
    header, payload = unpack(named_data.get_data(key), BLOB_VERSION, "onnxruntime model", older=OLDER_BLOB_VERSIONS)
    return header, _model_bytes(header, payload)


def model_branches(header: dict[str, Any]) -> tuple[list[tuple[list[str], list[str]]], str | None]:
    """A model header's branches and the input that selects one (None for a single branch), checked."""
    branches, selector = branch_names(header.get("branches")), header.get("selector")
    if not (selector is None and len(branches) == 1 or isinstance(selector, str)):
        raise FormatError(f"onnxruntime blob: {len(branches)} branches and the selector {selector!r:.80}")
    return branches, selector


def checked_branch(branch: Any, count: int) -> int:
    """A blob's branch number, checked to name one of its model's ``count`` branches."""
    if type(branch) is not int or not 0 <= branch < count:
        raise FormatError(f"onnxruntime blob: branch {branch!r:.80} of a model with {count} branches")
    return branch


def branch_names(table: Any) -> list[tuple[list[str], list[str]]]:
    """Each branch's input and output names, checked to be lists of names."""
    branches = []
    for entry in table if isinstance(table, list) and table else [None]:
        inputs, outputs = (entry.get(field) if isinstance(entry, dict) else None for field in ("inputs", "outputs"))
        if not (_names(inputs) and _names(outputs)):
            raise FormatError(f"onnxruntime blob: a branch is not lists of input and output names: {entry!r:.200}")
        branches.append((inputs, outputs))
    return branches


def _names(value: Any) -> TypeGuard[list[str]]:
    return isinstance(value, list) and all(isinstance(name, str) for name in value)


def initializer_table(header: dict[str, Any]) -> dict[str, Any]:
    """A model's header's initializers: name -> entry naming its named data."""
    initializers = header.get("initializers")
    if not isinstance(initializers, dict):
        raise FormatError("onnxruntime blob: its initializers are not a table")
    return initializers


def external_keys(initializers: dict[str, Any]) -> list[str]:
    """The named data the model's external tensors name as their files, sorted."""
    keys = set()
    for name, entry in initializers.items():
        key = entry.get("key") if isinstance(entry, dict) else None
        if not isinstance(key, str):
            raise FormatError(f"onnxruntime blob: initializer {name!r} names no named-data key")
        keys.add(key)
    return sorted(keys)


def initializer_location(entry: dict[str, Any]) -> str:
    """The in-memory file an initializer's entry names: its named data's key, or ``key@offset`` for an
    entry that reads a range of it (``"offset"``: a block of a weight's rows, ``row_blocks.py``)."""
    offset = entry.get("offset")
    return entry["key"] if offset is None else f"{entry['key']}@{offset}"


def initializer_files(
    initializers: dict[str, Any], data: dict[str, memoryview]
) -> tuple[dict[str, memoryview], dict[str, tuple[str, int]]]:
    """The in-memory files a session reads (location -> view, each a whole named data or the range an
    entry reads, all of ``data``: key -> view), and each initializer's (location, length), for confinement.
    A ``FormatError`` for an entry whose range is not a 2-D float block aligned within its named data, a
    key that could pass for a range's location (with no ``@`` in keys, a location names one key and
    offset), or one location read as two lengths."""
    files: dict[str, memoryview] = {}
    supplied: dict[str, tuple[str, int]] = {}
    for name, entry in initializers.items():
        key, offset = entry["key"], entry.get("offset")
        if "@" in key:
            raise FormatError(f"onnxruntime blob: initializer {name!r:.80} names named data {key!r:.80} (with '@')")
        view = data[key]
        if offset is not None:
            view = view[_checked_range(name, entry, offset, len(view))]
        location = initializer_location(entry)
        if location in files and len(files[location]) != len(view):
            raise FormatError(f"onnxruntime blob: initializers read {location!r:.80} as two lengths")
        files[location] = view
        supplied[name] = (location, len(view))
    return files, supplied


def _checked_range(name: str, entry: dict[str, Any], offset: Any, size: int) -> slice:
    """The bytes an entry with an ``"offset"`` reads: a 2-D float block its dtype and shape fill, at a
    64-byte aligned offset, within its named data's ``size`` bytes."""
    shape, dtype = entry.get("shape"), entry.get("dtype")
    width = _WIDTHS.get(dtype) if isinstance(dtype, str) else None
    if width is None or not isinstance(shape, list) or not _two_sizes(shape):
        raise FormatError(
            f"onnxruntime blob: initializer {name!r:.80} reads a range as dtype {dtype!r:.40} and shape {shape!r:.80}"
        )
    rows, columns = shape
    if type(offset) is not int or offset < 0 or offset % _ALIGNMENT:
        raise FormatError(f"onnxruntime blob: initializer {name!r:.80} reads from offset {offset!r:.40}")
    length = rows * columns * width
    if offset + length > size:
        raise FormatError(
            f"onnxruntime blob: initializer {name!r:.80} reads past the end of named data {entry['key']!r:.80} "
            f"({size} bytes) from offset {offset}"
        )
    return slice(offset, offset + length)


def _two_sizes(shape: list[Any]) -> bool:
    return len(shape) == 2 and all(type(d) is int and d >= 0 for d in shape)


_WIDTHS = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}
"""Bytes per element of the dtypes a block of rows may have (float weights)."""
_ALIGNMENT = 64  # bytes: a block's offset, as the writer makes it (rows in multiples of 16 of 4-byte floats)
