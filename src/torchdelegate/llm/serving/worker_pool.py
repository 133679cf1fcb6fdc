"""The server's worker processes, the requests waiting for one, and what happens when one dies.

Each worker (``worker_process.py``) runs one request at a time; requests beyond the workers wait
in a queue of bounded length, and one that finds it full is refused (429) rather than left to wait
without end. A request goes to the free worker whose cache already holds the longest start of its
prompt. A worker that dies fails its request with an error that says so, and is replaced; one
that cannot even load the program stops the pool from starting, and replacements that keep
failing to load are given up after a few tries: requests are then refused with 503.

Everything here runs on the server's event loop: workers' connections and process sentinels
are watched with ``add_reader``, so no thread waits on them.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import multiprocessing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torchdelegate.llm.language_model import HeldTokens
from torchdelegate.llm.serving.openai_requests import RequestError
from torchdelegate.llm.serving.worker_process import CANCELLED, FileLoad, prepare_program, serve_jobs

WORKER_STOP_SECONDS = 8
"""How long a worker asked to stop (the server stopping) may take before it is killed."""
_TRIES = 3  # replacements in a row that may fail to load before the pool gives up replacing


def prepared_in_child(file: FileLoad) -> list[str]:
    """The file prepared in a process of its own, so that workers map one packed copy of the weights
    and the server's front never holds one: the lines to print (why not, when it could not)."""
    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe(duplex=False)
    process = context.Process(target=prepare_program, args=(file, child), daemon=True)
    process.start()
    child.close()
    try:
        kind, said = parent.recv()
    except EOFError:
        process.join()
        kind, said = "failed", f"the process preparing it stopped (exit code {process.exitcode})"
    finally:
        process.join()
        parent.close()
    if kind == "prepared":
        return list(said) or ["nothing to prepare: each worker loads the file as it is"]
    return [f"not prepared ({said}): each worker packs its own copy of the weights"]


@dataclass
class JobEnd:
    """How a job ended: the worker's finish (``"stop token"``, ``"max new tokens"``, ``"cache full"``,
    ``"cancelled"``), the prompt tokens its cache already held, and its timings."""

    finish: str
    cached: int
    time_to_first_token: float
    decode_time: float


@dataclass
class Job:
    """One request's generation: its tokens arrive on ``events`` as ints, then a :class:`JobEnd`
    or a :class:`RequestError`."""

    number: int
    prompt: list[int]
    max_tokens: int
    sampling: dict[str, Any]
    events: asyncio.Queue[Any] = field(default_factory=asyncio.Queue)
    generated: list[int] = field(default_factory=list)
    worker: _Worker | None = None
    ended: bool = False


class _Worker:
    def __init__(self, process: Any, connection: Any) -> None:
        self.process, self.connection = process, connection
        self.ready = False
        self.job: Job | None = None
        self.held = HeldTokens()  # as the worker's own: the pool sends a prompt where most of it is held


def _shutting_down(message: str = "the server is shutting down: send the request again later") -> RequestError:
    return RequestError(503, message, kind="server_error", code="shutting_down", retry_after=1)


def _counted(number: int, thing: str) -> str:
    return f"{number} {thing}" if number == 1 else f"{number} {thing}s"


class WorkerPool:
    """``workers`` processes serving the program ``file`` loads; at most ``queue`` requests waiting.
    ``report`` is given a line for each worker lost and replaced (the operator's log)."""

    def __init__(
        self,
        file: FileLoad,
        workers: int,
        queue: int,
        report: Callable[[str], None] = lambda line: None,
    ) -> None:
        self.file, self.size, self.queue_limit = file, workers, queue
        self.report = report
        self.context = multiprocessing.get_context("spawn")
        self.workers: list[_Worker] = []
        self.waiting: collections.deque[Job] = collections.deque()
        self.numbers = itertools.count(1)
        self.closing = False
        self.replaced = 0
        self.failed_loads = 0  # replacements in a row that could not load the program
        self.broken: str | None = None  # why no worker will come back, once replacing is given up
        self.loop: asyncio.AbstractEventLoop | None = None
        self._started: asyncio.Future[None] | None = None

    async def start(self) -> None:
        """Start every worker and wait until all are ready; a ``RuntimeError`` with the worker's
        own message if one cannot load the program."""
        self.loop = asyncio.get_running_loop()
        self._started = self.loop.create_future()
        for _ in range(self.size):
            self._spawn()
        await self._started

    def status(self) -> dict[str, int]:
        ready = [w for w in self.workers if w.ready]
        return {
            "workers": len(ready),
            "busy": sum(1 for w in ready if w.job is not None),
            "waiting": len(self.waiting),
            "replaced": self.replaced,
        }

    def submit(self, prompt: list[int], max_tokens: int, sampling: dict[str, Any]) -> Job:
        """A job for ``prompt``, sent to a free worker or queued; a 503 while the server stops or
        when no worker can load the program, a 429 when the queue is full."""
        if self.closing:
            raise _shutting_down()
        if self.broken is not None and not self.workers:
            raise RequestError(503, self.broken, kind="server_error", code="no_workers")
        job = Job(next(self.numbers), prompt, max_tokens, sampling)
        if len(self.waiting) >= self.queue_limit and self._free_worker(prompt) is None:
            raise RequestError(
                429,
                f"the server is busy: {_counted(self.size, 'worker')} generating and "
                f"{_counted(len(self.waiting), 'request')} waiting; send the request again later (or start the "
                "server with more --workers or --queue)",
                kind="rate_limit_error",
                code="queue_full",
                retry_after=1,
            )
        self.waiting.append(job)
        self._dispatch()
        return job

    def cancel(self, job: Job) -> None:
        """Stop ``job`` (its client left, or a stop sequence was met); its worker ends it with ``"cancelled"``."""
        if job.ended:
            return
        if job.worker is None:
            self.waiting.remove(job)
            self._end(job, JobEnd(CANCELLED, 0, 0.0, 0.0))
            return
        try:
            job.worker.connection.send(("cancel", job.number))
        except OSError:
            pass  # the worker is gone: its sentinel fails the job

    async def close(self) -> None:
        """Fail what waits, let the jobs running end (their workers finish the token they are on),
        stop every worker, killing one that does not stop."""
        self.closing = True
        while self.waiting:
            self._end(self.waiting.popleft(), _shutting_down())
        for worker in list(self.workers):
            try:
                worker.connection.send(None)
            except OSError:
                pass
        loop = asyncio.get_running_loop()
        deadline = loop.time() + WORKER_STOP_SECONDS
        while any(w.process.is_alive() for w in self.workers) and loop.time() < deadline:
            await asyncio.sleep(0.05)  # meanwhile their last messages are read
        for worker in list(self.workers):
            self._unwatch(worker)
            if worker.process.is_alive():
                worker.process.kill()
            worker.process.join(timeout=WORKER_STOP_SECONDS)
            if worker.job is not None:
                self._end(worker.job, _shutting_down("the server shut down before this request ended"))
            worker.connection.close()
        self.workers.clear()

    def kill(self) -> None:
        """Kills every worker at once (from any thread: the process is about to end)."""
        for worker in list(self.workers):
            if worker.process.is_alive():
                worker.process.kill()

    def _spawn(self) -> None:
        parent, child = self.context.Pipe(duplex=True)
        process = self.context.Process(
            target=serve_jobs,
            args=(self.file, child),
            name="torchdelegate-serve-worker",
            daemon=True,
        )
        process.start()
        child.close()
        worker = _Worker(process, parent)
        self.workers.append(worker)
        assert self.loop is not None
        self.loop.add_reader(parent.fileno(), self._readable, worker)
        self.loop.add_reader(process.sentinel, self._died, worker)

    def _unwatch(self, worker: _Worker) -> None:
        assert self.loop is not None
        self.loop.remove_reader(worker.connection.fileno())
        self.loop.remove_reader(worker.process.sentinel)

    def _free_worker(self, prompt: list[int]) -> _Worker | None:
        free = [w for w in self.workers if w.ready and w.job is None]
        return max(free, key=lambda w: w.held.reusable(prompt), default=None)

    def _dispatch(self) -> None:
        """Each waiting job, first come first served, to the free worker whose cache holds the
        longest start of its prompt; a worker found dead on the way is dropped, its job kept."""
        while self.waiting:
            worker = self._free_worker(self.waiting[0].prompt)
            if worker is None:
                return
            job = self.waiting.popleft()
            try:
                worker.connection.send(("job", job.number, job.prompt, job.max_tokens, job.sampling))
            except OSError:
                self.waiting.appendleft(job)
                self._died(worker)
                continue
            job.worker, worker.job = worker, job

    def _readable(self, worker: _Worker) -> None:
        while worker in self.workers:
            try:
                if not worker.connection.poll():
                    return
                message = worker.connection.recv()
            except (EOFError, OSError):
                self._died(worker)
                return
            self._received(worker, message)

    def _received(self, worker: _Worker, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "ready":
            worker.ready = True
            self.failed_loads = 0
            if self._started is not None and not self._started.done() and all(w.ready for w in self.workers):
                self._started.set_result(None)
            self._dispatch()
        elif kind == "failed":
            self._lost(worker, f"a worker could not load {self.file.path}: {message[1]}")
        elif worker.job is not None and message[1] == worker.job.number:
            job = worker.job
            if kind == "token":
                job.generated.append(message[2])
                job.events.put_nowait(message[2])
                return
            worker.job = None
            if kind == "done":
                worker.held.after(job.prompt, job.generated)
                self._end(job, JobEnd(message[2], message[3], message[4], message[5]))
            else:
                worker.held.keep(0)
                self._end(job, RequestError(500, f"generation failed: {message[2]}", kind="server_error"))
            self._dispatch()

    def _died(self, worker: _Worker) -> None:
        if worker not in self.workers:
            return
        worker.process.join(timeout=1)
        self._lost(worker, f"a worker stopped while loading {self.file.path} (exit code {worker.process.exitcode})")

    def _lost(self, worker: _Worker, why: str) -> None:
        """``worker`` is gone (``why``, if it never got ready): its job failed, a replacement started
        unless the server stops or replacements keep failing to load."""
        self._unwatch(worker)
        self.workers.remove(worker)
        worker.connection.close()
        if worker.job is not None:
            code = worker.process.exitcode
            self._end(
                worker.job,
                RequestError(
                    500,
                    f"the worker generating this request stopped (exit code {code}); it is being replaced: "
                    "send the request again",
                    kind="server_error",
                    code="worker_died",
                ),
            )
        if self._started is not None and not self._started.done():
            if not worker.ready:
                self._started.set_exception(RuntimeError(why))
                return
        if self.closing:
            return
        generating = f" generating request {worker.job.number}" if worker.job is not None else ""
        self.report(f"worker {worker.process.pid} stopped{generating} (exit code {worker.process.exitcode})")
        if not worker.ready:
            self.failed_loads += 1
        if self.failed_loads >= _TRIES:
            self.broken = f"no worker can serve requests: {why} ({_TRIES} tries in a row); restart the server"
            self.report(self.broken)
            if not self.workers:
                while self.waiting:
                    self._end(self.waiting.popleft(), RequestError(503, self.broken, kind="server_error",
                                                                   code="no_workers"))  # fmt: skip
            return
        self.replaced += 1
        self._spawn()

    def _end(self, job: Job, end: JobEnd | RequestError) -> None:
        if not job.ended:
            job.ended = True
            job.events.put_nowait(end)
