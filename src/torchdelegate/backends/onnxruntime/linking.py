"""Partitions joined after every partition is exported: those with equal session settings that read
weights in common become the branches of one model (``branches``), stored once as named data that
their blobs name, so one session packs each weight once for every method.
"""

from __future__ import annotations

import warnings
from typing import Any

from torchdelegate.backends.blob import pack
from torchdelegate.backends.onnxruntime.blob_header import initializer_location, model_blob, unpacked
from torchdelegate.backends.onnxruntime.branches import SELECTOR, CombineError, combined_model
from torchdelegate.backends.onnxruntime.onnx_export import Refused
from torchdelegate.backends.onnxruntime.session import Model
from torchdelegate.backends.onnxruntime.settings import BLOB_VERSION, Options, require
from torchdelegate.delegate.named_data import NamedDataStore
from torchdelegate.delegate.specs import CompileSpec
from torchdelegate.errors import first_line
from torchdelegate.partition.components import components


def link_partitions(blobs: list[bytes], compile_specs: list[list[CompileSpec]], store: NamedDataStore) -> list[bytes]:
    """Partitions that run with the same session settings and read weights in common become
    branches of one model, run by one session; the others keep their blobs."""
    parts = [unpacked(memoryview(blob)) for blob in blobs]
    linked = list(blobs)
    for members in _sharing_groups([header for header, _ in parts], compile_specs):
        if len(members) < 2:
            continue
        try:
            blobs_of_model = _linked([parts[i] for i in members], compile_specs[members[0]], store)
        except Refused as e:
            warnings.warn(f"onnxruntime: {len(members)} partitions keep one session each: {e}", stacklevel=4)
            continue
        for index, blob in zip(members, blobs_of_model, strict=True):
            linked[index] = blob
    return linked


def _sharing_groups(headers: list[dict[str, Any]], compile_specs: list[list[CompileSpec]]) -> list[list[int]]:
    """The partitions that may share a session, as lists of indices: equal session settings, and
    connected by the weights they read. Every call of a model runs each branch's selection, so
    partitions that share nothing are not made to pay for one another."""
    first_reader: dict[tuple[Any, str], int] = {}
    pairs = []
    for index, (header, specs) in enumerate(zip(headers, compile_specs, strict=True)):
        settings = Options(specs).session_settings()
        for entry in header["initializers"].values():
            pairs.append((index, first_reader.setdefault((settings, entry["key"]), index)))
    return components(range(len(headers)), pairs)


def _linked(
    parts: list[tuple[dict[str, Any], memoryview]], compile_specs: list[CompileSpec], store: NamedDataStore
) -> list[bytes]:
    """The partitions' blobs (each unpacked) as branches of one model, stored as named data that each blob names.

    The combined model is loaded into ONNX Runtime (packing nothing) before it is accepted; a
    ``Refused`` if it cannot be made or loaded.
    """
    onnx = require("onnx")
    table: dict[str, dict[str, Any]] = {}
    external = []
    for header, _ in parts:
        names = {}
        for name, entry in header["initializers"].items():
            shared = f"{initializer_location(entry)}.{entry['dtype']}.{'x'.join(map(str, entry['shape']))}"
            names[name], table[shared] = shared, entry
        external.append(names)
    branch_of, unique = _same_models(parts, external)
    try:
        model, branches = combined_model(onnx, [bytes(parts[i][1]) for i in unique], [external[i] for i in unique])
    except CombineError as e:
        raise Refused(str(e)) from e
    except Exception as e:  # a model this combination does not foresee: the partitions stay apart
        raise Refused(f"they cannot be combined ({type(e).__name__}: {first_line(e)})") from e
    header = {
        "version": BLOB_VERSION,
        "initializers": dict(sorted(table.items())),
        "selector": SELECTOR if len(unique) > 1 else None,
        "branches": [{"inputs": branch.inputs, "outputs": branch.outputs} for branch in branches],
    }
    onnx_bytes = model.SerializeToString()
    try:
        Model(header, memoryview(onnx_bytes), compile_specs, store.data_map(), pack_weights=False)
    except Exception as e:
        raise Refused(f"ONNX Runtime refused the combined model ({first_line(e)})") from e
    key = store.add_by_content(model_blob(header, onnx_bytes))
    keys = sorted({key, *(entry["key"] for entry in table.values())})
    linked = {"version": BLOB_VERSION, "model": key, "keys": keys}
    return [
        pack(linked | {"branch": branch, "fusions": part.get("fusions", {})}, b"")
        for branch, (part, _) in zip(branch_of, parts, strict=True)
    ]


def _same_models(
    parts: list[tuple[dict[str, Any], memoryview]], external: list[dict[str, str]]
) -> tuple[list[int], list[int]]:
    """Each partition's branch, and the partition each branch is made from: partitions whose models
    are equal byte for byte (their inputs and outputs too) and read the same weights under the same
    names are one branch (an LLM's ``decode`` exported as its ``prefill``, run at one token), so the
    session builds and packs it once."""
    first: dict[tuple[bytes, tuple[tuple[str, str], ...]], int] = {}
    branch_of: list[int] = []
    unique: list[int] = []
    for index, ((_, payload), names) in enumerate(zip(parts, external, strict=True)):
        identity = (bytes(payload), tuple(sorted(names.items())))
        if identity not in first:
            first[identity] = len(unique)
            unique.append(index)
        branch_of.append(first[identity])
    return branch_of, unique
