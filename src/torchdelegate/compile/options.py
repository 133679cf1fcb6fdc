"""``torchdelegate.preprocessing``: how the lowerings inside a block compile their partitions.

    with torchdelegate.preprocessing(cache="~/.cache/torchdelegate", jobs=2):
        lowered = torchdelegate.to_edge_transform_and_lower(programs, partitioner=[...])

``cache``: a :class:`CompileCache`, a directory or an fsspec URL; ``False`` turns the cache
off; left out, ``TORCHDELEGATE_CACHE`` decides (``off``: no cache; unset: the user's cache
directory, ``~/.cache/torchdelegate``, which the machine cache shares). Partitions are
compiled on ``executor`` (any ``concurrent.futures.Executor``: a Dask ``Client.get_executor()``),
or on ``jobs`` worker processes of this machine started for the block, or on the Dask cluster
whose scheduler is at ``cluster`` (``tcp://HOST:PORT``; needs ``torchdelegate[distributed]``).
Outside any block, the environment's cache (if any) is used and partitions compile here, one by
one. Whatever the path, the saved file is the same, byte for byte.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import socket
from collections.abc import Iterable, Iterator
from concurrent.futures import Executor, ProcessPoolExecutor
from typing import Any

import torch

from torchdelegate.cache.compile_cache import CompileCache
from torchdelegate.cache.store_settings import cache_location
from torchdelegate.compile.compiler import UnitCompiler
from torchdelegate.compile.worker import warm_up
from torchdelegate.delegate.compile_units import compiling_with


def environment_cache() -> CompileCache | None:
    """The cache ``TORCHDELEGATE_CACHE`` puts in the store (a directory or URL; unset: the user's cache
    directory), or None when it turns the caches off."""
    location = cache_location()
    return CompileCache(location) if location is not None else None


def _chosen_cache(cache: CompileCache | str | os.PathLike[str] | bool | None) -> CompileCache | None:
    if cache is None or cache is True:
        return environment_cache()
    if cache is False:
        return None
    if isinstance(cache, CompileCache):
        return cache
    if isinstance(cache, (str, os.PathLike)):
        return CompileCache(cache)
    raise TypeError(f"cache must be a CompileCache, a directory, a URL or False, got {type(cache).__name__}")


class LocalPool:
    """``jobs`` worker processes of this machine, forked from a server that imported the backends
    once and warming up from the start; replaced whole when one of them dies (a broken pool)."""

    def __init__(self, jobs: int) -> None:
        if not isinstance(jobs, int) or isinstance(jobs, bool) or jobs < 1:
            raise ValueError(f"jobs must be a number of worker processes >= 1, got {jobs!r}")
        self.jobs = jobs
        self.executor = self._started()

    def _started(self) -> ProcessPoolExecutor:
        context: Any = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(["torchdelegate.compile.worker"])
        threads = max(1, (os.cpu_count() or 1) // self.jobs)  # the workers share this machine's cores
        pool = ProcessPoolExecutor(
            self.jobs, mp_context=context, initializer=torch.set_num_threads, initargs=(threads,)
        )
        for _ in range(self.jobs):
            pool.submit(warm_up)
        return pool

    def restart(self) -> Executor:
        self.executor.shutdown(wait=False, cancel_futures=True)
        self.executor = self._started()
        return self.executor

    def close(self) -> None:
        self.executor.shutdown(wait=True, cancel_futures=True)


def cluster_executor(address: str, stack: contextlib.ExitStack) -> Executor:
    """An executor over the Dask cluster whose scheduler is at ``address``, closed with ``stack``."""
    try:
        import distributed
    except ImportError as e:
        raise ImportError(f"compiling on a cluster needs Dask: pip install 'torchdelegate[distributed]' ({e})") from e
    _check_scheduler_address(address)
    try:
        client = stack.enter_context(distributed.Client(address, timeout=10))
    except OSError as e:
        raise OSError(f"no Dask scheduler answers at {address} ({e}); start one with `dask scheduler`") from e
    for worker in sorted(client.scheduler_info()["workers"]):  # warmed up while this process partitions
        distributed.fire_and_forget(client.submit(warm_up, workers=[worker], pure=False, key=f"warm-up-{worker}"))
    return client.get_executor(pure=False)


def _check_scheduler_address(address: str) -> None:
    """A ``ValueError`` if ``address`` is not one Dask can reach, an ``OSError`` at once if nothing
    listens at a TCP one (rather than after Dask's time-out)."""
    from distributed.comm.addressing import parse_address, parse_host_port
    from distributed.comm.registry import backends

    try:
        scheme, location = parse_address(address)
        if scheme not in backends:
            raise ValueError(f"Dask has no {scheme!r} addresses; it has {', '.join(sorted(backends))}")
        host, port = parse_host_port(location) if scheme == "tcp" else (None, None)
    except ValueError as e:
        raise ValueError(f"{address} is not a Dask scheduler's address ({e}); give tcp://HOST:PORT") from e
    if host is not None:
        try:
            socket.create_connection((host, port), timeout=10).close()
        except OSError as e:
            raise OSError(
                f"no Dask scheduler answers at {address} ({e.strerror or e}); start one with `dask scheduler`"
            ) from e


@contextlib.contextmanager
def preprocessing(
    *,
    cache: CompileCache | str | os.PathLike[str] | bool | None = None,
    executor: Executor | None = None,
    jobs: int | None = None,
    cluster: str | None = None,
    trusted_backends: Iterable[str] | None = None,
) -> Iterator[UnitCompiler]:
    """Lowerings inside the block compile partitions through ``cache`` on ``executor``, ``jobs``
    local worker processes or the Dask ``cluster`` (at most one of the three). An entry of a backend
    that runs native code is taken from the cache only for ``trusted_backends`` (and those
    ``TORCHDELEGATE_TRUSTED_BACKENDS`` names); otherwise it is compiled here, with a warning."""
    given = [
        name for name, value in (("executor", executor), ("jobs", jobs), ("cluster", cluster)) if value is not None
    ]
    if len(given) > 1:
        raise ValueError(f"give one of executor, jobs and cluster, not {' and '.join(given)}")
    chosen = _chosen_cache(cache)
    with contextlib.ExitStack() as stack:
        restart = None
        if jobs is not None:
            pool = LocalPool(jobs)
            stack.callback(pool.close)
            executor, restart = pool.executor, pool.restart
        elif cluster is not None:
            executor = cluster_executor(cluster, stack)
        compiler = UnitCompiler(chosen, executor, restart, trusted_backends)
        with compiling_with(compiler):
            yield compiler


def environment_compiler() -> UnitCompiler | None:
    """What compiles units outside any ``preprocessing`` block: here, through the environment's cache."""
    cache = environment_cache()
    return None if cache is None else UnitCompiler(cache)
