"""The partition compiler with a compile cache and an executor: each unit is answered from the
cache, or compiled (on the executor when it has one, else here) and then kept in the cache.

Results come back in the units' order whatever order the executor finishes them in; progress
counts each unit as it completes. A unit whose worker dies (a process pool broken, a Dask
worker killed) is submitted once more; if its worker dies again, the error names the unit
and the worker.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Executor, Future, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass

from torchdelegate.backend import BackendDetails, PreprocessResult
from torchdelegate.compile.cache import CompileCache
from torchdelegate.compile.entry import Entry, decode, passed_through, refit, template
from torchdelegate.compile.unit_form import UnitForm, structure_key, unit_form
from torchdelegate.compile.worker import compile_request, request
from torchdelegate.errors import PreprocessError
from torchdelegate.lowering.compile_units import CompiledUnit, CompileUnit, compile_in_process
from torchdelegate.progress import partition_compiled
from torchdelegate.serialize.container import canonical_json


@dataclass
class _Unit:
    unit: CompileUnit
    form: UnitForm | None
    structure: str | None = None
    compiled: CompiledUnit | None = None
    attempts: int = 0
    executor: Executor | None = None


class UnitCompiler:
    """Compiles units through ``cache`` (None: no cache) on ``executor`` (None: here, one by one).

    ``restart`` makes a fresh executor when the one given broke (a process pool this compiler owns).
    """

    def __init__(
        self,
        cache: CompileCache | None = None,
        executor: Executor | None = None,
        restart: Callable[[], Executor] | None = None,
    ) -> None:
        self.cache = cache
        self.executor = executor
        self._restart = restart

    def compile(self, backend: type[BackendDetails], units: Sequence[CompileUnit]) -> list[CompiledUnit]:
        identity = backend.compile_cache_identity() if self.cache is not None else None
        needs_form = identity is not None or self.executor is not None
        work = []
        for unit in units:
            form = unit_form(unit) if needs_form else None
            work.append(_Unit(unit, form if isinstance(form, UnitForm) else None))
        if identity is not None:
            for item in work:
                if item.form is not None:
                    item.structure = structure_key(backend, item.unit, item.form, identity)
                    self._look_up(backend, item)
        remote = [i for i in work if i.compiled is None and i.form is not None and self.executor is not None]
        futures = {self._submit(backend, item): item for item in remote}
        for item in work:
            if item.compiled is None and item not in remote:
                result = compile_in_process(backend, item.unit)
                item.compiled = CompiledUnit(result, self._keep(backend, item, result))
                partition_compiled(backend.backend_id, item.unit.where)
        self._collect(backend, futures)
        if (
            self.cache is not None
            and identity is not None
            and any(i.compiled and i.compiled.cache == "miss" for i in work)
        ):
            self.cache.evict()
        return [item.compiled for item in work if item.compiled is not None]

    def _look_up(self, backend: type[BackendDetails], item: _Unit) -> None:
        assert self.cache is not None and item.form is not None and item.structure is not None
        digests = item.form.digests
        for bound in self._bindings(backend, item):
            if not set(bound) <= set(digests):
                continue
            entry = self.cache.get(_entry_key(item.structure, bound, digests), item.unit.where)
            if entry is None or not passed_through(entry) <= set(digests):
                continue
            item.compiled = CompiledUnit(refit(entry, item.form.state, digests), "hit")
            partition_compiled(backend.backend_id, item.unit.where)
            return

    def _bindings(self, backend: type[BackendDetails], item: _Unit) -> list[list[str]]:
        assert self.cache is not None and item.form is not None and item.structure is not None
        if not backend.weights_by_reference:
            return [sorted(item.form.digests)]
        return self.cache.bindings(item.structure)

    def _keep(
        self, backend: type[BackendDetails], item: _Unit, result: object, entry: Entry | None = None
    ) -> str | None:
        """Store the unit's result in the cache; how the cache answered (None: no cache for it)."""
        if self.cache is None or item.structure is None or item.form is None:
            return None
        if entry is None:
            if not isinstance(result, PreprocessResult):
                return None  # lowering reports what the backend returned
            made = template(result, item.form.digests)
            if isinstance(made, str):
                return None
            entry = made
        digests = item.form.digests
        passed = passed_through(entry) if backend.weights_by_reference else set()
        bound = sorted(set(digests) - passed)
        self.cache.put(item.structure, bound, _entry_key(item.structure, bound, digests), entry)
        return "miss"

    def _submit(self, backend: type[BackendDetails], item: _Unit) -> Future[bytes]:
        assert self.executor is not None and item.form is not None
        item.attempts += 1
        item.executor = self.executor
        return self.executor.submit(compile_request, request(backend, item.unit, item.form))

    def _collect(self, backend: type[BackendDetails], futures: dict[Future[bytes], _Unit]) -> None:
        pending = dict(futures)
        while pending:
            done, _ = wait(pending, return_when=FIRST_COMPLETED)
            for future in done:
                item = pending.pop(future)
                try:
                    data = future.result()
                except Exception as e:
                    if not _worker_lost(e):
                        raise PreprocessError(
                            f"backend {backend.backend_id!r} failed to preprocess {item.unit.where} on a worker: {e}"
                        ) from e
                    if item.attempts > 1:
                        raise PreprocessError(
                            f"backend {backend.backend_id!r}: {item.unit.where} was compiled twice and its worker "
                            f"died both times ({type(e).__name__}: {e}); compile it in this process (no --jobs or "
                            "--cluster) to see the failure"
                        ) from e
                    if isinstance(e, BrokenProcessPool) and self._restart is not None:
                        if item.executor is self.executor:  # the first of its units to find it broken
                            self.executor = self._restart()
                    elif isinstance(e, BrokenProcessPool):
                        raise PreprocessError(
                            f"backend {backend.backend_id!r}: the worker process compiling {item.unit.where} died "
                            f"and the process pool given is broken ({e})"
                        ) from e
                    pending[self._submit(backend, item)] = item
                    continue
                assert item.form is not None
                entry = decode(data)
                result = refit(entry, item.form.state, item.form.digests)
                item.compiled = CompiledUnit(result, self._keep(backend, item, result, entry))
                partition_compiled(backend.backend_id, item.unit.where)


def _worker_lost(error: BaseException) -> bool:
    """A worker that died (not a backend that raised): a broken local pool, a killed Dask worker."""
    return isinstance(error, BrokenProcessPool) or type(error).__name__ in ("KilledWorker", "CommClosedError")


def _entry_key(structure: str, bound: list[str], digests: dict[str, str]) -> str:
    """The key of a structure's entry: the bytes of the ``bound`` tensors, and which of the others are equal."""
    others: dict[str, list[str]] = {}
    for name in sorted(set(digests) - set(bound)):
        others.setdefault(digests[name], []).append(name)
    equal = sorted(names for names in others.values() if len(names) > 1)
    described = {"structure": structure, "bound": {name: digests[name] for name in sorted(bound)}, "equal": equal}
    return hashlib.sha256(canonical_json(described)).hexdigest()
