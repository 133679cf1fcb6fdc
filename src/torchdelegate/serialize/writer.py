"""Writing a lowered program: residual graphs, delegates, state and named data in one file.

Blobs and data are stored once per distinct content (SHA-256), across methods and
delegates. With an external data file, named data and tensors go there instead, so several
program files can share one weights file; an existing data file is extended, never shrunk.
The layout is specified in docs/FORMAT.md.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch.export import ExportedProgram

from torchdelegate.delegate.backend_details import get_backend
from torchdelegate.delegate.lowered_module import LoweredBackendModule
from torchdelegate.delegate.named_data import NamedDataStoreOutput, tensor_bytes
from torchdelegate.delegate.preprocess_checks import delegate_info_problem
from torchdelegate.errors import FormatError, SerializationError, first_line
from torchdelegate.exported.programs import TENSOR_STATE_KINDS, state_value
from torchdelegate.serialize.allow_list import check_graph_document
from torchdelegate.serialize.call_delegate import DelegateCall, serializable_program
from torchdelegate.serialize.container import (
    MAX_ALIGNMENT,
    SEGMENT_ALIGNMENT,
    ChangedDataError,
    Container,
    SegmentSource,
    canonical_json,
    layout_segments,
    write_container,
)
from torchdelegate.serialize.graph import program_to_json
from torchdelegate.serialize.manifest import (
    ASSET_NAME,
    DATA_MAGIC,
    PROGRAM_MAGIC,
    REPORT_COMPRESSION,
    AssetRecord,
    DelegateRecord,
    ExternalDataRecord,
    MethodRecord,
    NamedDataRecord,
    ProgramManifest,
    StateRecord,
    data_manifest,
    from_pairs,
)
from torchdelegate.serialize.tensors import dtype_name


class _Segments:
    """Segments keyed by content, in the order first added, each at the largest alignment asked."""

    def __init__(self) -> None:
        self.sources: dict[bytes, SegmentSource] = {}

    def add(self, data: bytes | memoryview, digest: bytes | None = None, alignment: int = SEGMENT_ALIGNMENT) -> str:
        """Add ``data``; a ``digest`` computed earlier is checked again when the bytes are written."""
        recheck = digest is not None
        digest = digest if digest is not None else hashlib.sha256(data).digest()
        current = self.sources.get(digest)
        if current is None:
            self.sources[digest] = SegmentSource(data, digest, alignment, recheck)
        elif alignment > current.alignment:
            self.sources[digest] = dataclasses.replace(current, alignment=alignment)
        return digest.hex()


def save_program(
    programs: Mapping[str, ExportedProgram],
    named_data: NamedDataStoreOutput,
    path: str | os.PathLike[str],
    external_data_path: str | os.PathLike[str] | None = None,
    *,
    debug_info: bool = False,
    report: Mapping[str, Any] | None = None,
    assets: Mapping[str, bytes] | None = None,
) -> None:
    """Write ``programs`` (one per method) and the named data of their delegates to ``path``.

    ``debug_info`` keeps each residual node's stack trace and module path in the file;
    ``report`` (JSON data) is kept in a segment of its own, compressed (``torchdelegate inspect`` and
    ``Program.report`` read it; loading and running never do);
    ``assets`` (name -> bytes: a tokenizer, a generation config) go in the program file as they
    are, for whoever uses the program (``Program.asset``); nothing reads or runs them.
    """
    checked_assets = _checked_assets(assets or {})
    path = Path(path)
    external = Path(external_data_path) if external_data_path is not None else None
    if external is not None and external.resolve() == path.resolve():
        raise SerializationError(f"external_data_path {str(external)!r} is the program file itself; choose another")
    local = _Segments()
    data = _Segments() if external is not None else local
    delegates: dict[LoweredBackendModule, int] = {}
    delegate_entries: list[DelegateRecord] = []
    methods = []
    for method, program in programs.items():
        serializable, calls = serializable_program(program, lambda module: delegates.setdefault(module, len(delegates)))
        for call in calls:
            if delegates[call.module] == len(delegate_entries):  # first met here
                delegate_entries.append(_delegate_entry(method, call, local))
        graph = program_to_json(serializable, f"method {method!r}", debug_info=debug_info)
        _check_loadable(graph, method)
        methods.append(MethodRecord(method, graph, sorted({delegates[c.module] for c in calls})))
    _check_named_data(delegates, named_data)
    state = _state_entries(programs, data)
    named = _named_data_entries(named_data, data)
    external_record = None
    if external is not None:
        external_record = ExternalDataRecord(external.name, [(d.hex(), len(s.data)) for d, s in data.sources.items()])
    manifest = ProgramManifest(
        {"torch": torch.__version__},
        methods,
        delegate_entries,
        state,
        named,
        external_record,
        None,
        [AssetRecord(name, local.add(data)) for name, data in checked_assets],
        None if report is None else local.add(zlib.compress(canonical_json(dict(report)), REPORT_COMPRESSION)),
    )
    try:
        if external is not None:
            _extend_data_file(external, data)
        _write(path, PROGRAM_MAGIC, manifest.to_json(), local)
    except ChangedDataError as e:
        changed = e.digest.hex()
        users = [f"named data {n.key!r}" for n in named if n.data == changed]
        users += [f"state {s.name!r}" for s in state if s.data == changed]
        written = str(path) if external is None else f"{path} or {external}"
        raise SerializationError(
            f"{', '.join(users) or 'a segment'} changed after it was lowered (a tensor written in place?); "
            f"lower the program again from the changed model. Nothing was written to {written}"
        ) from None


def _checked_assets(assets: Mapping[str, bytes]) -> list[tuple[str, bytes]]:
    """The assets sorted by name, each name a plain file name and each value bytes; a clear error else."""
    if not isinstance(assets, Mapping):
        raise TypeError(f"assets must be a mapping of names to bytes, got {type(assets).__name__}")
    checked = []
    for name, data in sorted(assets.items(), key=lambda item: str(item[0])):
        if not isinstance(name, str) or ASSET_NAME.fullmatch(name) is None:
            raise ValueError(
                f"asset name {name!r}: use a plain file name of letters, digits, '_', '.' and '-' "
                "(at most 128 characters, not starting with '.' or '-'), such as 'tokenizer.json'"
            )
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"asset {name!r} is a {type(data).__name__}; give its bytes (json.dumps(...).encode())")
        checked.append((name, bytes(data)))
    return checked


def _check_named_data(delegates: Mapping[LoweredBackendModule, int], named_data: NamedDataStoreOutput) -> None:
    """Every key a delegate's blob names is in the file: saving never drops data silently."""
    for delegate in delegates:
        backend = get_backend(delegate.backend_id)
        try:
            needed = backend.named_data_keys(memoryview(delegate.processed_bytes), list(delegate.compile_specs))
        except Exception as e:
            raise SerializationError(
                f"delegate {delegate.name!r} on {delegate.backend_id!r}: its blob cannot be read ({first_line(e)})"
            ) from e
        missing = [key for key in needed or () if key not in named_data.entries]
        if missing:
            raise SerializationError(
                f"delegate {delegate.name!r} on {delegate.backend_id!r} needs named data {missing[0]!r}"
                f"{f' (and {len(missing) - 1} more keys)' if len(missing) > 1 else ''}, which neither the program "
                "nor any delegate holds; lower through EdgeProgramManager.to_backend, or give the "
                "LoweredBackendModule the NamedDataStoreOutput its backend produced"
            )


def _write(path: Path, magic: bytes, manifest: dict[str, Any], segments: _Segments) -> None:
    """One container file; a ``ChangedDataError`` if a segment's bytes changed since they were added."""
    sources = list(segments.sources.values())
    table, data_length, largest = layout_segments(sources)
    write_container(path, magic, {**manifest, "segments": table, "data_length": data_length}, sources, largest)


def _delegate_entry(method: str, call: DelegateCall, segments: _Segments) -> DelegateRecord:
    module = call.module
    return DelegateRecord(
        name=module.name,
        method=method,
        backend_id=module.backend_id,
        blob=segments.add(memoryview(module.processed_bytes)),
        compile_specs=list(module.compile_specs),
        input_kinds=call.input_kinds,
        output_count=call.output_count,
        debug_handle_map=_debug_handle_map(module),
        delegate_info=_delegate_info(module),
    )


def _delegate_info(module: LoweredBackendModule) -> Any:
    """The backend's description of the delegate (``meta["delegate_info"]``), checked to be JSON data.

    Left out of the entry when there is none, so files of backends without it are as before.
    """
    info = module.meta.get("delegate_info")
    if info is None:
        return None
    problem = delegate_info_problem(info)
    if problem:
        raise SerializationError(
            f"delegate {module.name!r} on {module.backend_id!r}: meta['delegate_info'] is not JSON data: {problem}; "
            "keep str, int, float, bool, None, lists of them, or dicts with str keys of them"
        )
    return info


def _check_loadable(graph: dict[str, Any], method: str) -> None:
    """Refuse now what ``load`` would refuse: a graph calling an operator off the list, so that no file
    is written that no reader will run."""
    try:
        check_graph_document(graph, f"method {method!r}")
    except FormatError as e:
        raise SerializationError(
            f"{e}. load would refuse the file, so it is not written: lower the nodes concerned to a backend "
            "(or, if to_edge made this graph, report it)"
        ) from None


def _debug_handle_map(module: LoweredBackendModule) -> dict[Any, Any] | None:
    handles = module.meta.get("debug_handle_map")
    if handles is None:
        return None
    if not isinstance(handles, Mapping):
        raise SerializationError(
            f"delegate {module.name!r} on {module.backend_id!r}: debug_handle_map is a {type(handles).__name__}; "
            "return a dict"
        )
    pairs = [[_json_value(k, module), _json_value(v, module)] for k, v in handles.items()]
    return from_pairs(sorted(pairs, key=repr))


def _json_value(value: Any, module: LoweredBackendModule) -> Any:
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, (list, tuple)):
        return [_json_value(v, module) for v in value]
    raise SerializationError(
        f"delegate {module.name!r} on {module.backend_id!r}: debug_handle_map holds {value!r}; "
        "keys and values must be str, int, float, bool, None or lists of them"
    )


def _state_entries(programs: Mapping[str, ExportedProgram], segments: _Segments) -> list[StateRecord]:
    """Every parameter, buffer and constant the residual graphs read, once per name."""
    mutable = set().union(*(p.graph_signature.buffers_to_mutate.values() for p in programs.values()))
    found: dict[str, tuple[str, torch.Tensor]] = {}
    for method, program in programs.items():
        for spec in program.graph_signature.input_specs:
            if spec.kind not in TENSOR_STATE_KINDS or spec.target is None:
                continue
            fqn = spec.target
            value = state_value(program, fqn)
            if not isinstance(value, torch.Tensor):
                raise SerializationError(f"method {method!r}: {fqn!r} is a {type(value).__name__}, not a tensor")
            if fqn in found:
                _check_same(fqn, found[fqn], (method, value))
            else:
                found[fqn] = (method, value)
    entries = []
    for fqn in sorted(found):
        method, tensor = found[fqn]
        where = f"method {method!r}, {fqn!r}"
        # All-zero state (a fresh KV cache) is stored as its shape alone.
        data = None if _all_zero_bytes(tensor) else segments.add(tensor_bytes(tensor))
        entries.append(StateRecord(fqn, dtype_name(tensor, where), list(tensor.shape), data, fqn in mutable))
    return entries


def _all_zero_bytes(tensor: torch.Tensor) -> bool:
    """Whether every byte is zero (so -0.0, whose sign bit is set, is not)."""
    flat = tensor.detach().contiguous().reshape(-1)
    return flat.numel() > 0 and not bool(flat.view(torch.uint8).any())


def _check_same(fqn: str, first: tuple[str, torch.Tensor], second: tuple[str, torch.Tensor]) -> None:
    (m1, a), (m2, b) = first, second
    if a is b:
        return
    same = a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a.detach(), b.detach()))
    if not same:
        raise SerializationError(
            f"methods {m1!r} and {m2!r} hold different values for {fqn!r}; methods of one program share "
            "state by name, so give the tensors distinct names or equal values"
        )


def _named_data_entries(named_data: NamedDataStoreOutput, segments: _Segments) -> list[NamedDataRecord]:
    entries = []
    for key, entry in named_data.entries.items():
        index = entry.buffer_index
        if entry.alignment > MAX_ALIGNMENT:
            raise SerializationError(
                f"named data {key!r} asks for alignment {entry.alignment}; files support at most {MAX_ALIGNMENT}"
            )
        digest = segments.add(named_data.buffers[index], named_data.digests[index], max(entry.alignment, 1))
        entries.append(NamedDataRecord(key, digest, entry.alignment))
    return entries


def _extend_data_file(path: Path, segments: _Segments) -> None:
    """Write the data file: its current segments (if it exists), then those it lacks or holds
    at too small an alignment. A file that already has everything is left untouched."""
    merged = _Segments()
    existing = None
    if path.exists():
        try:
            existing = Container(path, DATA_MAGIC, "external data")
        except Exception as e:
            raise SerializationError(
                f"{path} exists and is not a torchdelegate data file ({e}); remove it or choose another path"
            ) from e
        for number, segment in enumerate(existing.segments):
            data = existing.segment(number, f"existing segment {number}")  # its checksum checked here
            merged.sources[segment.digest] = SegmentSource(data, segment.digest, segment.alignment, recheck=False)
    before = {digest: source.alignment for digest, source in merged.sources.items()}
    for digest, source in segments.sources.items():
        merged.add(source.data, digest, source.alignment)
    unchanged = all(before.get(d) == s.alignment for d, s in merged.sources.items())
    try:
        if existing is None or not unchanged:
            _write(path, DATA_MAGIC, data_manifest(), merged)
    finally:
        if existing is not None:
            existing.close()
