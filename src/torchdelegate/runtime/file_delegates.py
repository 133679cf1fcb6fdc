"""A file's delegate record made a :class:`~torchdelegate.delegate.instance.DelegateInstance` on its backend.

The backend is the one its id names: its array runtime when the program runs on arrays (no torch),
else its ``BackendDetails`` (importing torch only then). It must be found (``BackendNotFoundError``)
and say it can run here (``BackendUnavailableError``), both naming the delegate. The instance reads
its blob from the file on first use, gets the load-time backend options in place of the file's
compile specs of the same keys, and the program's named data; a backend whose native code the
program's trust does not cover is refused as the instance is made, before its blob is read.
"""

from __future__ import annotations

from typing import Any

from torchdelegate.delegate.instance import DelegateInstance
from torchdelegate.delegate.named_data import NamedDataMap
from torchdelegate.errors import BackendNotFoundError, BackendUnavailableError
from torchdelegate.runtime.backend_options import BackendOptions, with_load_options
from torchdelegate.serialize.manifest import DelegateRecord
from torchdelegate.serialize.reader import ProgramFile


def file_delegate(
    file: ProgramFile,
    record: DelegateRecord,
    named: NamedDataMap,
    trust: frozenset[str],
    backend_options: BackendOptions,
    *,
    arrays: bool,
) -> DelegateInstance:
    """The delegate ``record`` of ``file`` on its backend (its array runtime with ``arrays``)."""
    where = f"{file.path}: delegate {record.name!r} of method {record.method!r}"
    try:
        backend = delegate_backend(record.backend_id, arrays=arrays)
    except BackendNotFoundError as e:
        raise BackendNotFoundError(f"{where} needs backend {record.backend_id!r}: {e}") from e
    try:
        available = backend.is_available()
    except Exception as e:
        raise BackendUnavailableError(f"{where}: backend {record.backend_id!r} is_available() failed: {e}") from e
    if not available:
        raise BackendUnavailableError(
            f"{where}: backend {record.backend_id!r} is not available on this machine "
            "(its is_available() returned False); install what it needs, or lower for another backend"
        )
    digest, label = record.blob, f"the blob of delegate {record.name!r}"
    return DelegateInstance(
        backend,
        lambda: file.data(digest, label),
        with_load_options(record.compile_specs, backend_options.get(record.backend_id, {})),
        lambda: named,
        name=record.name,
        output_count=record.output_count,
        trust=trust,
    )


def delegate_backend(backend_id: str, *, arrays: bool) -> Any:
    """The class that runs ``backend_id``'s delegates: its array runtime, or its ``BackendDetails``."""
    if arrays:
        from torchdelegate.delegate.array_runtime import array_runtime

        return array_runtime(backend_id)
    from torchdelegate.delegate.backend_details import get_backend

    return get_backend(backend_id)
