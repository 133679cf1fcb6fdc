"""What the shipped backends' blobs share: a JSON header before a payload, and weights kept
as named data keyed by content.

A blob is an 8-byte little-endian header length, the header (canonical JSON with a
``version``), then the backend's payload. A *weight table* lists a sub-program's
parameters, buffers and constants as ``{"name", "key", "dtype", "shape"}``: the bytes are
the named data under ``key`` (their SHA-256), so partitions and methods share them, and at
run time the tensors are views of the program file.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torchdelegate.delegate.named_data import NamedDataMap, NamedDataStore
from torchdelegate.errors import FormatError
from torchdelegate.serialize.container import framed, unframed

if TYPE_CHECKING:
    import torch
    from torch.export import ExportedProgram

WEIGHT_ALIGNMENT = 64


def pack(header: dict[str, Any], payload: bytes) -> bytes:
    """A blob: the header's length, the header, the payload."""
    return framed(header, payload)


def unpack(
    processed: memoryview, version: int, backend: str, older: tuple[int, ...] = ()
) -> tuple[dict[str, Any], memoryview]:
    """The header and payload of a blob :func:`pack` wrote; a ``FormatError`` if it is not one, or
    if its ``version`` is neither ``version`` nor one of the ``older`` ones the backend still reads."""
    try:
        header, payload = unframed(processed)
        found = header["version"]
    except (ValueError, KeyError, TypeError, RecursionError) as e:
        raise FormatError(f"{backend} blob: not a blob of this backend ({e})") from None
    if found != version and found not in older:
        raise FormatError(f"{backend} blob: version {found!r}; this torchdelegate reads {version}")
    return header, payload


def weight_table(program: ExportedProgram, store: NamedDataStore, where: str) -> list[dict[str, Any]]:
    """Every parameter, buffer and constant of ``program`` added to ``store`` by content (as views)."""
    from torchdelegate.exported.programs import TENSOR_STATE_KINDS, state_value
    from torchdelegate.serialize.tensors import dtype_name

    table = []
    for spec in program.graph_signature.input_specs:
        if spec.kind not in TENSOR_STATE_KINDS or spec.target is None:
            continue
        tensor = state_value(program, spec.target)
        table.append(
            {
                "name": spec.target,
                "key": store.add_by_content(tensor, alignment=WEIGHT_ALIGNMENT),
                "dtype": dtype_name(tensor, f"{where}: {spec.target!r}"),
                "shape": list(tensor.shape),
            }
        )
    return table


def table_keys(table: Any) -> list[str]:
    """The named data keys a weight table names (malformed entries are left to :func:`weights`)."""
    entries = table if isinstance(table, list) else []
    return [e["key"] for e in entries if isinstance(e, dict) and isinstance(e.get("key"), str)]


def weights(table: Any, named_data: NamedDataMap, backend: str) -> dict[str, torch.Tensor]:
    """The tensors a weight table names, as views of the named data; a ``FormatError`` if malformed."""
    from torchdelegate.serialize.tensors import tensor_from_bytes

    tensors: dict[str, torch.Tensor] = {}
    for entry in table if isinstance(table, list) else [None]:
        try:
            name, key, dtype, shape = (entry[f] for f in ("name", "key", "dtype", "shape"))  # type: ignore[index]
        except (KeyError, TypeError):
            raise FormatError(f"{backend} blob: a weight entry is malformed: {entry!r:.200}") from None
        if not isinstance(name, str):
            raise FormatError(f"{backend} blob: a weight's name is {name!r:.80}, not a string")
        if not isinstance(key, str) or key not in named_data:
            raise FormatError(f"{backend} blob: weight {name!r:.80} names missing named data {key!r:.80}")
        tensors[name] = tensor_from_bytes(named_data.get_data(key), dtype, shape, f"{backend} blob: {name!r}")
    return tensors
