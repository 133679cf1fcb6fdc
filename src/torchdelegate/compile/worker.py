"""What a worker process (of this machine's pool, or of a Dask cluster) does with a compile unit.

A request is a unit's form as bytes: a canonical JSON header (backend id and the module that
defines it, compile specs, the sub-program's torch.export JSON, each state tensor's dtype,
shape and place, their digests) and the tensors' bytes. The worker rebuilds the sub-program
over those bytes, compiles it with the backend's ``preprocess`` and answers with the
result as a compile cache entry (``cache/compiled_entry.py``), so weights the backend stored unchanged do not
travel back. Nothing in either direction is pickled but ``bytes``.
"""

from __future__ import annotations

import importlib
import os
import socket
from typing import Any

from torchdelegate.cache.compiled_entry import encoded_bytes, template
from torchdelegate.compile.unit_form import UnitForm
from torchdelegate.delegate.backend_details import BackendDetails, PreprocessResult, get_backend, registered_backend_ids
from torchdelegate.delegate.compile_units import CompileUnit, preprocess_unit
from torchdelegate.delegate.named_data import tensor_bytes
from torchdelegate.delegate.specs import CompileSpec
from torchdelegate.errors import TorchDelegateError
from torchdelegate.exported.debug_handles import handle_table, restore_handles
from torchdelegate.exported.operator_libraries import import_libraries, library_namespaces
from torchdelegate.exported.torch_warnings import torch_internal_warnings_silenced
from torchdelegate.serialize.container import FramePayload, framed, span_of, unframed
from torchdelegate.serialize.graph import program_from_json
from torchdelegate.serialize.tensors import dtype_name, tensor_from_bytes


class WorkerError(TorchDelegateError, RuntimeError):
    """The backend failed in the worker: its message, and where it ran."""


def request(backend: type[BackendDetails], unit: CompileUnit, form: UnitForm, document: dict[str, Any]) -> bytes:
    """The unit's form and its sub-program's serialized ``document``, as the bytes a worker reads."""
    payload = FramePayload()
    tensors = [
        {
            "name": name,
            "dtype": dtype_name(tensor, unit.where),
            "shape": list(tensor.shape),
            "span": payload.place(tensor_bytes(tensor)),
        }
        for name, tensor in form.state.items()
    ]
    header = {
        "backend": backend.backend_id,
        "module": backend.__module__,
        "compile_specs": [[spec.key, spec.value.hex()] for spec in unit.compile_specs],
        "where": unit.where,
        "document": document,
        "debug_handles": handle_table(unit.program),
        "libraries": library_namespaces(unit.program.graph_module),
        "tensors": tensors,
        "digests": form.digests,
    }
    return framed(header, *payload.parts)


def compile_request(data: bytes) -> bytes:
    """Run in the worker: the request compiled, as an entry's bytes; a ``WorkerError`` if the backend fails.
    The operator libraries the graph calls are imported first, as the process that made it had them."""
    with torch_internal_warnings_silenced():
        return _compiled(data)


def _compiled(data: bytes) -> bytes:
    header, payload = unframed(memoryview(data))
    try:
        import_libraries(header.get("libraries", []))
    except ImportError as e:
        raise WorkerError(f"{e} (on {worker_name()})") from None
    where = header["where"]
    backend = _backend(header["backend"], header["module"])
    tensors = {
        t["name"]: tensor_from_bytes(span_of(payload, t["span"]), t["dtype"], t["shape"], where)
        for t in header["tensors"]
    }
    program = program_from_json(header["document"], tensors, where)
    restore_handles(program, header.get("debug_handles", []))
    specs = [CompileSpec(key, bytes.fromhex(value)) for key, value in header["compile_specs"]]
    try:
        result = preprocess_unit(backend, program, specs, where)
    except Exception as e:
        raise WorkerError(f"{type(e).__name__}: {e} (on {worker_name()})") from None
    if not isinstance(result, PreprocessResult):
        raise WorkerError(f"preprocess returned {type(result).__name__}; expected a PreprocessResult")
    entry = template(result, header["digests"])
    if isinstance(entry, str):
        raise WorkerError(f"its result cannot travel back: {entry}")
    return encoded_bytes(entry)


def _backend(backend_id: str, module: str) -> type[BackendDetails]:
    if module != "__main__":  # a script's backends are defined again as it is imported in the worker
        importlib.import_module(module)
    return get_backend(backend_id)


def worker_name() -> str:
    return f"process {os.getpid()} on {socket.gethostname()}"


def warm_up() -> str:
    """Run once in each new worker, before its first unit: every installed backend's ``warm_up``."""
    with torch_internal_warnings_silenced():
        _warm_backends()
    return worker_name()


def _warm_backends() -> None:
    for backend_id in registered_backend_ids():
        try:
            get_backend(backend_id).warm_up()
        except Exception:  # noqa: BLE001 - its extra is missing, or a unit that needs what failed reports it itself
            pass
