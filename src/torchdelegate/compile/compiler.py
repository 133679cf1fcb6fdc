"""The partition compiler with a compile cache and an executor: each unit is answered from the
cache, or compiled (on the executor when it has one, else here) and then kept in the cache.

Units equal to one another (the same structure key and state: an LLM's decode exported as its
prefill) are compiled once, for all, whether or not there is a cache.

Results come back in the units' order whatever order the executor finishes them in; progress
counts each unit as it completes. A unit whose worker dies (a process pool broken, a Dask
worker killed) is submitted once more; if its worker dies again, the error names the unit
and the worker.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Executor, Future, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, replace
from typing import Any

import torch

from torchdelegate.cache.compile_cache import ENTRIES, CompileCache
from torchdelegate.cache.compiled_entry import Entry, binding_of, decode, passed_through, refit, template
from torchdelegate.compile.unit_form import (
    UnitForm,
    document_key,
    state_tensors,
    structure_key,
    unit_document,
    unit_form,
)
from torchdelegate.compile.worker import compile_request, request
from torchdelegate.delegate.backend_details import BackendDetails, PreprocessResult
from torchdelegate.delegate.compile_units import CompiledUnit, CompileUnit, compile_in_process
from torchdelegate.delegate.named_data import NamedDataMap, NamedDataStore
from torchdelegate.delegate.progress import partition_compiled
from torchdelegate.delegate.trust import TRUSTED_BACKENDS_VARIABLE, trusted_backends, trusting
from torchdelegate.errors import PreprocessError, UntrustedCodeError


@dataclass(eq=False)
class _Unit:
    unit: CompileUnit
    form: UnitForm | None
    structure: str | None = None
    document: dict[str, Any] | None = None
    compiled: CompiledUnit | None = None
    attempts: int = 0
    executor: Executor | None = None
    refused: bool = False  # its cache entry failed the backend's load-time checks


class UnitCompiler:
    """Compiles units through ``cache`` (None: no cache) on ``executor`` (None: here, one by one).

    ``restart`` makes a fresh executor when the one given broke (a process pool this compiler owns).
    ``trusted_backends``: backends whose native code (``runs_native_code``) this compiler takes from
    the cache, besides those ``TORCHDELEGATE_TRUSTED_BACKENDS`` names: a shared cache is written by
    whoever can write to it, and such an entry is a library the lowered program would load.
    """

    def __init__(
        self,
        cache: CompileCache | None = None,
        executor: Executor | None = None,
        restart: Callable[[], Executor] | None = None,
        trusted_backends: Iterable[str] | None = None,
    ) -> None:
        self.cache = cache
        self.executor = executor
        self._restart = restart
        self._trusted = None if trusted_backends is None else list(trusted_backends)

    def compile(self, backend: type[BackendDetails], units: Sequence[CompileUnit]) -> list[CompiledUnit]:
        # No version: never cached, nor two units taken for one.
        identity = backend.compile_cache_identity() if backend.compile_cache_version is not None else None
        cached = self.cache is not None and identity is not None
        needs_form = cached or self.executor is not None
        work = []
        known: dict[torch.Tensor, str] = {}  # digests by tensor: a weight read by two methods is hashed once
        for unit in units:
            form = unit_form(unit, known) if needs_form else None
            work.append(_Unit(unit, form if isinstance(form, UnitForm) else None))
        keyed = cached or len(work) > 1  # a lone unit, uncached, needs no key
        for item in work:
            if identity is not None and keyed:
                item.structure = structure_key(backend, item.unit, identity)
        repeats = _repeats(work)  # looked up and compiled once, for all: one entry's pages read once
        for item in work:
            if cached and item not in repeats and item.form is not None and item.structure is not None:
                self._look_up(backend, item)
        to_compile = [item for item in work if item.compiled is None and item not in repeats]
        if self.executor is not None:  # what travels does so in torch.export's serialized form
            for item in to_compile:
                item.document = None if item.form is None else unit_document(item.unit)
        futures = {self._submit(backend, item): item for item in to_compile if item.document is not None}
        for item in to_compile:  # what cannot travel (or has nowhere to go) is compiled here meanwhile
            if item.document is None:
                with self._compiling(backend, item):
                    if item.compiled is None:
                        result = compile_in_process(backend, item.unit)
                        entry = self._entry_of(result, item)
                        self._done(backend, item, CompiledUnit(result, self._keep(backend, item, entry)))
        self._collect(backend, futures)
        for item, first in repeats.items():  # compiled once, for each
            assert first.compiled is not None
            self._done(backend, item, first.compiled, f", as {first.unit.where}")
        if self.cache is not None and any(item.compiled and item.compiled.cache == "miss" for item in work):
            self.cache.evict()
        compiled = [item.compiled for item in work if item.compiled is not None]
        assert len(compiled) == len(work)
        return compiled

    def _look_up(self, backend: type[BackendDetails], item: _Unit) -> None:
        assert self.cache is not None and item.form is not None and item.structure is not None
        if item.refused:
            return
        digests = item.form.digests
        for bound in self._bindings(backend, item):
            if not set(bound) <= set(digests):
                continue
            binding = binding_of(item.structure, bound, digests)
            entry = self.cache.get(document_key(binding), item.unit.where, binding, digests)
            if entry is None:
                continue
            if not self._may_take(backend, item.unit.where):
                return
            result = refit(entry, item.form.state, digests)
            if not self._passes_load_checks(backend, item, result):
                item.refused = True
                return
            self._done(backend, item, CompiledUnit(result, "hit"))
            return

    @contextlib.contextmanager
    def _compiling(self, backend: type[BackendDetails], item: _Unit) -> Iterator[None]:
        """Held while a unit the cache missed compiles here: another process that misses it too waits,
        then finds it (a local cache; workers of an executor compile units without it)."""
        if self.cache is None or item.structure is None or item.form is None or not self.cache.store.local:
            yield
            return
        with self.cache.store.lock(ENTRIES, item.structure):
            if self._trusts(backend):
                self._look_up(backend, item)  # made while this process waited?
            yield

    def _passes_load_checks(self, backend: type[BackendDetails], item: _Unit, result: PreprocessResult) -> bool:
        """Whether a cached result passes its backend's load-time checks (``check_blob``), under the trust
        this compiler gives the cache's native code (delegates nested in the blob included): an entry is
        what whoever can write the cache put there; one that fails is compiled here instead, with a warning."""
        assert self.cache is not None
        output = result.data_store_output or NamedDataStore().get_named_data_store_output()
        blob, specs = memoryview(result.processed_bytes), list(item.unit.compile_specs)
        try:
            with trusting(trusted_backends(self._trusted)):
                backend.check_blob(blob, specs, NamedDataMap(output))
        except UntrustedCodeError as e:
            warnings.warn(
                f"compile cache: the entry for {item.unit.where} in {self.cache.location} holds native code of a "
                f"backend not trusted here, which whoever can write the cache may have put there ({e}); it is "
                "compiled here instead",
                stacklevel=2,
            )
            return False
        except Exception as e:  # noqa: BLE001 - whatever the check raised, the entry is not used
            warnings.warn(
                f"compile cache: the entry for {item.unit.where} in {self.cache.location} fails the load-time "
                f"checks of backend {backend.backend_id!r} ({type(e).__name__}: {e}); it is compiled here instead",
                stacklevel=2,
            )
            return False
        return True

    def _trusts(self, backend: type[BackendDetails]) -> bool:
        """Whether entries of ``backend`` may come from the cache: its blobs are no native code, or it is trusted."""
        return not backend.runs_native_code or backend.backend_id in trusted_backends(self._trusted)

    def _may_take(self, backend: type[BackendDetails], where: str) -> bool:
        """Whether a cached entry of ``backend`` may stand for a compile here (if not, a warning says how)."""
        if self._trusts(backend):
            return True
        assert self.cache is not None
        backend_id = backend.backend_id
        warnings.warn(
            f"compile cache: the entry for {where} is native code of backend {backend_id!r}, which whoever can "
            f"write {self.cache.location} may have put there; it is compiled here instead. If you trust the "
            f"cache's writers: {TRUSTED_BACKENDS_VARIABLE}={backend_id}, or "
            f"preprocessing(trusted_backends=[{backend_id!r}])",
            stacklevel=2,
        )
        return False

    def _bindings(self, backend: type[BackendDetails], item: _Unit) -> list[list[str]]:
        assert self.cache is not None and item.form is not None and item.structure is not None
        if not backend.weights_by_reference:
            return [sorted(item.form.digests)]
        return self.cache.bindings(item.structure)

    def _entry_of(self, result: object, item: _Unit) -> Entry | None:
        """A result compiled here, as the cache would keep it; None when it will not be kept."""
        if self.cache is None or item.structure is None or item.form is None:
            return None
        if not isinstance(result, PreprocessResult):
            return None  # lowering reports what the backend returned
        entry = template(result, item.form.digests)
        return None if isinstance(entry, str) else entry

    def _keep(self, backend: type[BackendDetails], item: _Unit, entry: Entry | None) -> str | None:
        """Store the unit's entry in the cache; how the cache answered (None: no cache for it)."""
        if self.cache is None or item.structure is None or item.form is None or entry is None:
            return None
        digests = item.form.digests
        passed = passed_through(entry) if backend.weights_by_reference else set()
        bound = sorted(set(digests) - passed)
        binding = binding_of(item.structure, bound, digests)
        self.cache.put(item.structure, bound, document_key(binding), replace(entry, binding=binding))
        return "miss"

    @staticmethod
    def _done(backend: type[BackendDetails], item: _Unit, compiled: CompiledUnit, how: str | None = None) -> None:
        item.compiled = compiled
        if how is None:
            how = ", from the cache" if compiled.cache == "hit" else ""
        partition_compiled(backend.backend_id, item.unit.where + how)

    def _submit(self, backend: type[BackendDetails], item: _Unit) -> Future[bytes]:
        assert self.executor is not None and item.form is not None and item.document is not None
        item.attempts += 1
        item.executor = self.executor
        return self.executor.submit(compile_request, request(backend, item.unit, item.form, item.document))

    def _collect(self, backend: type[BackendDetails], futures: dict[Future[bytes], _Unit]) -> None:
        """Each unit's entry as its worker returns it, in the order they finish; a unit whose worker
        died is submitted once more."""
        pending = dict(futures)
        while pending:
            done, _ = wait(pending, return_when=FIRST_COMPLETED)
            for future in done:
                item = pending.pop(future)
                try:
                    entry = decode(future.result())
                except Exception as e:
                    self._check_retry(backend, item, e)
                    pending[self._submit(backend, item)] = item
                    continue
                assert item.form is not None
                result = refit(entry, item.form.state, item.form.digests)
                self._done(backend, item, CompiledUnit(result, self._keep(backend, item, entry)))

    def _check_retry(self, backend: type[BackendDetails], item: _Unit, error: Exception) -> None:
        """Raise the error that names the unit, unless its worker died for the first time (then a
        broken pool of ours is replaced, for the unit to be submitted again)."""
        where = f"backend {backend.backend_id!r}"
        if not _worker_lost(error):
            raise PreprocessError(f"{where} failed to preprocess {item.unit.where} on a worker: {error}") from error
        if item.attempts > 1:
            raise PreprocessError(
                f"{where}: {item.unit.where} was compiled twice and its worker died both times "
                f"({type(error).__name__}: {error}); compile it in this process (no --jobs or --cluster) to see "
                "the failure"
            ) from error
        if isinstance(error, BrokenProcessPool):
            if self._restart is None:
                raise PreprocessError(
                    f"{where}: the worker process compiling {item.unit.where} died and the process pool given "
                    f"is broken ({error})"
                ) from error
            if item.executor is self.executor:  # the first of its units to find it broken
                self.executor = self._restart()


def _repeats(items: list[_Unit]) -> dict[_Unit, _Unit]:
    """The units equal to an earlier one (an LLM's decode exported as its prefill), each with that one:
    the same structure key and the same state, by digest where the units were hashed, else the very
    same tensors. Each is looked up in the cache and compiled once, for all."""
    firsts: list[_Unit] = []
    repeats: dict[_Unit, _Unit] = {}
    for item in items:
        if item.structure is None:
            continue
        same = next((f for f in firsts if f.structure == item.structure and _same_state(f, item)), None)
        if same is None:
            firsts.append(item)
        else:
            repeats[item] = same
    return repeats


def _same_state(first: _Unit, other: _Unit) -> bool:
    if first.form is not None and other.form is not None:
        return first.form.digests == other.form.digests
    mine, theirs = state_tensors(first.unit), state_tensors(other.unit)
    return mine.keys() == theirs.keys() and all(mine[name] is theirs[name] for name in mine)


def _worker_lost(error: BaseException) -> bool:
    """A worker that died (not a backend that raised): a broken local pool, a killed Dask worker."""
    return isinstance(error, BrokenProcessPool) or type(error).__name__ in ("KilledWorker", "CommClosedError")
