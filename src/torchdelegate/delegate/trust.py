"""Which backends' native code a loaded file may run: the caller's decision, never the file's.

A backend whose blobs hold code the process executes (``BackendDetails.runs_native_code``:
AOTInductor's shared libraries) runs whatever a file's author compiled into it. Loading such a
delegate from a file needs the caller to name the backend as trusted: ``load(path,
trusted_backends=[...])``, the ``TORCHDELEGATE_TRUSTED_BACKENDS`` environment variable
(comma-separated ids), or the command's ``--trust``. Programs lowered in this process trust
their own delegates. A delegate nested in another's blob inherits the trust its outer one had.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator
from contextvars import ContextVar
from typing import TYPE_CHECKING

from torchdelegate.errors import UntrustedCodeError

if TYPE_CHECKING:
    from torchdelegate.delegate.backend_details import BackendDetails

TRUSTED_BACKENDS_VARIABLE = "TORCHDELEGATE_TRUSTED_BACKENDS"

Trust = frozenset[str] | None
"""The backend ids whose native code may run; ``None``: any (a program lowered in this process)."""

_trust: ContextVar[Trust] = ContextVar("torchdelegate_trust", default=None)


class Inherited:
    """The trust of the delegate being initialized: the default of a new ``DelegateInstance``."""


INHERITED = Inherited()


def trusted_backends(explicit: Iterable[str] | None = None) -> frozenset[str]:
    """The ids a loader trusts: ``explicit`` and those in ``TORCHDELEGATE_TRUSTED_BACKENDS``."""
    if isinstance(explicit, str):
        raise TypeError(f"trusted_backends must be a list of backend ids, got the string {explicit!r}")
    from_environment = os.environ.get(TRUSTED_BACKENDS_VARIABLE, "")
    ids = {i.strip() for i in from_environment.split(",") if i.strip()} | set(explicit or ())
    for backend_id in ids:
        if not isinstance(backend_id, str):
            raise TypeError(f"trusted_backends must hold backend ids (str), got {backend_id!r}")
    return frozenset(ids)


def current_trust() -> Trust:
    """The trust of the delegate whose ``init`` is running (for delegates it creates), else ``None``."""
    return _trust.get()


@contextlib.contextmanager
def trusting(trust: Trust) -> Iterator[None]:
    """Delegates created within (nested in a blob being initialized) get ``trust``."""
    token = _trust.set(trust)
    try:
        yield
    finally:
        _trust.reset(token)


def check_trusted(backend: type[BackendDetails], trust: Trust, where: str) -> None:
    """Refuse a delegate of a native-code backend its loader did not trust, naming the switch."""
    if trust is None or not getattr(backend, "runs_native_code", False) or backend.backend_id in trust:
        return
    backend_id = backend.backend_id
    raise UntrustedCodeError(
        f"{where}: backend {backend_id!r} runs native code from the file (its blob is a compiled library the "
        f"process would load); load only files you trust, and say so: torchdelegate.load(path, "
        f"trusted_backends=[{backend_id!r}]), {TRUSTED_BACKENDS_VARIABLE}={backend_id}, or the command's "
        f"--trust {backend_id}"
    )
