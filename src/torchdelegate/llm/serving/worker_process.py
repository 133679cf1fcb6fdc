"""One serving worker: a process that loads the program once and generates for one request at a time.

Each worker owns its program's KV cache, so a request never sees another's state: a request
reads its prompt into the cache from the first position where the cache differs from it, and the
positions past that are rewritten before attention reads them. What the cache holds after a
request (its prompt and the tokens read back) is kept, so the next request that repeats it, a
conversation sending its history again, reads only what is new (prefix caching).

The worker speaks over one ``multiprocessing`` connection, in tuples:

- to the worker: ``("job", id, prompt, max_tokens, sampling)``, ``("cancel", id)``, ``None`` (stop);
- from the worker: ``("ready", pid)``, ``("failed", message)`` (could not load),
  ``("token", id, token)``, ``("done", id, finish, cached, seconds_to_first_token, decode_seconds)``,
  ``("error", id, message)``.

A worker imports the runtime and never torch itself: on a file whose delegates need none (ONNX
Runtime's), it holds the runtime alone. Unseeded sampling draws fresh entropy for each request, so
workers and restarts differ as separate servers would.
"""

from __future__ import annotations

import importlib
import os
import signal
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
from typing import Any

CANCELLED = "cancelled"
"""The finish of a job stopped by ``("cancel", id)``: a stop sequence was met or the client left."""


@dataclass(frozen=True)
class FileLoad:
    """How each process of a server loads the file, as the command line said: the data file's place
    (``--external-data``), the backends' load options (``--backend-option``) and the modules to import
    first (``--import``; the serving process put the directories they were found in on ``sys.path``,
    which spawned processes inherit). Trust travels in the environment."""

    path: str
    external_data: str | None = None
    backend_options: dict[str, dict[str, str]] = field(default_factory=dict)
    imports: tuple[str, ...] = ()

    def load(self) -> Any:
        """The file loaded in this process, after its imports."""
        from torchdelegate.runtime.program import load

        for module in self.imports:
            importlib.import_module(module)
        return load(self.path, external_data_path=self.external_data, backend_options=self.backend_options or None)


class _Cancelled(Exception):
    """The job is stopped; ``last``: the server is stopping too, so the worker ends after it."""

    def __init__(self, last: bool = False) -> None:
        super().__init__()
        self.last = last


def serve_jobs(file: FileLoad, connection: Connection) -> None:
    """The worker's life: load the file, say ready, then run each job sent until ``None`` or the
    connection closes. Started by :class:`~torchdelegate.llm.serving.worker_pool.WorkerPool`."""
    for number in (signal.SIGINT, signal.SIGTERM):  # sent to the whole group: the server stops its workers itself
        signal.signal(number, signal.SIG_IGN)
    from torchdelegate.llm.generation import Sampling
    from torchdelegate.llm.language_model import HeldTokens, LanguageModel

    try:
        program = file.load()
        generator = LanguageModel(program).generator()
    except Exception as e:
        connection.send(("failed", f"{type(e).__name__}: {e}"))
        return
    connection.send(("ready", os.getpid()))
    held = HeldTokens()
    while True:
        try:
            message = connection.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        if message[0] != "job":
            continue  # a cancel that came after its job ended
        _, job, prompt, max_tokens, sampling = message
        cached = held.reusable(prompt)
        held.keep(cached)
        tokens: list[int] = []

        def on_token(token: int, job: Any = job, tokens: list[int] = tokens) -> None:
            tokens.append(token)
            connection.send(("token", job, token))
            while connection.poll():
                note = connection.recv()
                if note is None or (note[0] == "cancel" and note[1] == job):
                    raise _Cancelled(last=note is None)

        try:
            generation = generator.generate(prompt, max_tokens, Sampling(**sampling), on_token=on_token, cached=cached)
        except _Cancelled as cancelled:
            connection.send(("done", job, CANCELLED, cached, 0.0, 0.0))
            if cancelled.last:
                return
        except Exception as e:
            held.keep(0)
            connection.send(("error", job, f"{type(e).__name__}: {e}"))
            continue
        else:
            stats = generation.stats
            connection.send(("done", job, generation.finish, cached, stats.time_to_first_token, stats.decode_time))
        held.after(prompt, tokens)


def prepare_program(file: FileLoad, connection: Connection) -> None:
    """``Program.prepare`` of the file in a process of its own: the lines it printed, or why it could
    not (the machine cache is off...), sent as ``("prepared", lines)`` or ``("failed", message)``."""
    try:
        with file.load() as program:
            connection.send(("prepared", program.prepare()))
    except Exception as e:
        connection.send(("failed", f"{type(e).__name__}: {e}"))


def sampling_fields(sampling: Any) -> dict[str, Any]:
    """A ``Sampling`` as the plain values a job carries to a worker."""
    return asdict(sampling)
