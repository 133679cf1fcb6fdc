"""The HTTP side of ``llm serve``: OpenAI's routes on Starlette, run by uvicorn.

The front process reads and writes text only (the file's tokenizer and chat template): it never
makes a session, so the weights live in the workers alone. It turns a request into prompt tokens,
hands them to the :class:`~torchdelegate.llm.serving.worker_pool.WorkerPool`, and turns the tokens
that come back into text, whole or as server-sent events, cut at the first stop sequence.
"""

from __future__ import annotations

import asyncio
import hmac
import os
import signal
import socket
import sys
import threading
from concurrent.futures import Executor, ThreadPoolExecutor
from pathlib import Path
from typing import Any, TextIO

from torchdelegate.errors import CheckpointError
from torchdelegate.llm.language_model import LanguageModel
from torchdelegate.llm.serving.openai_requests import (
    GenerationRequest,
    RequestError,
    generation_request,
    model_not_found,
    parsed_body,
)
from torchdelegate.llm.serving.replies import Reply
from torchdelegate.llm.serving.worker_pool import WORKER_STOP_SECONDS, WorkerPool
from torchdelegate.llm.serving.worker_process import sampling_fields

COMPLETION_TOKENS = 16
"""``/v1/completions``' default ``max_tokens``, as OpenAI's; a chat's reply may fill the cache."""
GRACEFUL_SECONDS = 30
"""How long a stop (SIGTERM, Ctrl-C) takes at most: requests in flight get all but the workers' time to
stop (:data:`~torchdelegate.llm.serving.worker_pool.WORKER_STOP_SECONDS`) and 2 s to finish; a server
still running at the end (nothing known should keep it) says so and exits at once."""
DRAINED_BYTES = 256 << 20
"""A body past the limit is read and dropped up to this size before the 413; past it the
connection is cut (a client sending that much is not waiting for an answer)."""
BODY_BYTES_PER_POSITION = 128
"""The request body read per position of the cache (beyond a first MiB): more than any token's text
as JSON, so a body past it holds a prompt that cannot fit, refused before it is read or tokenized."""
TEMPLATE_THREADS = 2
"""Threads rendering chat templates, apart from those tokenizing completions' prompts."""


def listening_socket(host: str, port: int) -> socket.socket:
    """A socket listening on ``host:port`` (0: a free port), made before anything slow so that an
    address that cannot be had is refused at once (``OSError``)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family)


def serve(model: LanguageModel, pool: WorkerPool, listening: socket.socket, api_key: str | None, out: TextIO) -> None:
    """Serve ``model``'s file on ``listening`` until SIGTERM or Ctrl-C; the line ``serving NAME at
    http://HOST:PORT/v1`` (and whether requests need a key) is printed once every worker is ready, after
    one saying how many connections the open-files limit allows if it holds them below the most. A
    worker that cannot load the program stops the server with a ``RuntimeError``; a stop asked for
    while the workers load stops it too, and is a clean exit like one asked for later. The socket is
    closed when it returns."""
    from torchdelegate.llm.serving.connections import cap_note, connection_cap

    host, bound = listening.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    needs = "; requests need the API key" if api_key else ""
    ready = (
        f"serving {model_name(model)} at http://{shown}:{bound}/v1 with {pool.size} worker(s){needs}; "
        "Ctrl-C or SIGTERM stops"
    )
    cap = connection_cap(pool.size)
    ready = "\n".join(filter(None, [cap_note(cap), ready]))
    # uvicorn stops gracefully on either signal, then passes it on to the handler it found: a quiet one,
    # so that a stop asked for is a clean exit, not a KeyboardInterrupt or a death by SIGTERM.
    before = {number: signal.signal(number, _stop_asked) for number in (signal.SIGINT, signal.SIGTERM)}
    try:
        with listening:
            asyncio.run(_served(model, pool, api_key, listening, cap, lambda: print(ready, file=out, flush=True)))
    finally:
        for number, handler in before.items():
            signal.signal(number, handler)
    print("stopped", file=out, flush=True)


async def _served(model: LanguageModel, pool: WorkerPool, api_key: str | None, listening: socket.socket,
                  cap: int, announce: Any) -> None:  # fmt: skip
    """Start the workers (a stop signal meanwhile ends it here), then serve until a stop signal, with
    at most ``cap`` connections open; the workers are stopped whatever happens."""
    import uvicorn

    from torchdelegate.llm.serving.connections import ACCEPT_BATCH, OpenConnections, guarded_protocol

    loop = asyncio.get_running_loop()
    starting = asyncio.ensure_future(pool.start())
    for number in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(number, starting.cancel)
    try:
        try:
            await starting
        except asyncio.CancelledError:
            return
        finally:
            for number in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(number)
                signal.signal(number, _stop_asked)
        announce()
        templates = ThreadPoolExecutor(TEMPLATE_THREADS, thread_name_prefix="chat template")
        config = uvicorn.Config(
            server_app(model, pool, api_key, templates),
            http=guarded_protocol(OpenConnections(cap)),
            ws="none",
            backlog=ACCEPT_BATCH,
            lifespan="off",
            log_level="warning",
            timeout_graceful_shutdown=GRACEFUL_SECONDS - WORKER_STOP_SECONDS - 2,
            access_log=False,
        )
        try:
            await _stop_bounded(uvicorn.Server, pool)(config).serve(sockets=[listening])
        finally:
            templates.shutdown(wait=False, cancel_futures=True)  # a render is bounded: it ends soon on its own
    finally:
        await pool.close()


def _stop_asked(number: int, frame: Any) -> None:
    """What a stop signal does once uvicorn has stopped: nothing more."""


def _stop_bounded(server_class: type, pool: WorkerPool) -> type:
    """uvicorn's ``Server``, whose first stop signal also starts the clock of :func:`_exit_if_still_running`,
    and whose sockets queue :data:`~torchdelegate.llm.serving.connections.LISTEN_BACKLOG` connections in
    the kernel (uvicorn's backlog, the event loop's batch of accepts, is kept small for the files)."""
    from torchdelegate.llm.serving.connections import LISTEN_BACKLOG

    class Server(server_class):  # type: ignore[misc, valid-type]
        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets)
            for listening in sockets or []:
                listening.listen(LISTEN_BACKLOG)

        def handle_exit(self, sig: int, frame: Any) -> None:
            if not self.should_exit:
                clock = threading.Timer(GRACEFUL_SECONDS, _exit_if_still_running, (pool,))
                clock.daemon = True
                clock.start()
            super().handle_exit(sig, frame)

    return Server


def _exit_if_still_running(pool: WorkerPool) -> None:
    """The stop took its whole :data:`GRACEFUL_SECONDS`: the workers are killed and the process ends now."""
    print(f"torchdelegate: error: the server did not stop within {GRACEFUL_SECONDS} s of the stop asked for; "
          "exiting now", file=sys.stderr, flush=True)  # fmt: skip
    pool.kill()
    os._exit(1)


def model_name(model: LanguageModel) -> str:
    """The name requests give in ``model``: the file's name without its suffix."""
    return Path(model.program.path).stem


def server_app(model: LanguageModel, pool: WorkerPool, api_key: str | None, templates: Executor) -> Any:
    """The Starlette application: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``,
    ``/health``; with ``api_key``, every request without ``Authorization: Bearer <key>`` is a 401.
    Chat templates are rendered on ``templates``, so that a costly one (bounded in time, but slow)
    never delays a completion's prompt."""
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.middleware import Middleware
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    name = model_name(model)
    created = int(Path(model.program.path).stat().st_mtime)
    card = {"id": name, "object": "model", "created": created, "owned_by": "torchdelegate",
            "max_model_len": model.max_cache}  # fmt: skip
    body_limit = (1 << 20) + BODY_BYTES_PER_POSITION * model.max_cache

    async def health(request: Request) -> Response:
        status = pool.status()
        healthy = status["workers"] > 0 and not pool.closing
        return JSONResponse({"status": "ok" if healthy else "unavailable", **status}, 200 if healthy else 503)

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [card]})

    async def one_model(request: Request) -> Response:
        if request.path_params["model"] != name:
            raise model_not_found(request.path_params["model"], name)
        return JSONResponse(card)

    async def chat(request: Request) -> Response:
        return await _generate(request, True)

    async def completions(request: Request) -> Response:
        return await _generate(request, False)

    async def _generate(request: Request, chat: bool) -> Response:
        wanted = generation_request(parsed_body(await _body(request, body_limit, model.max_cache)), chat, name)
        threads = templates if wanted.messages is not None else None  # None: the loop's, for completions
        prompt = await asyncio.get_running_loop().run_in_executor(threads, _prompt_tokens, model, wanted)
        room = model.max_cache - len(prompt)
        asked = wanted.max_tokens or (room if chat else COMPLETION_TOKENS)
        job = pool.submit(prompt, min(asked, room), sampling_fields(wanted.sampling))
        reply = Reply(model, pool, job, wanted)
        if wanted.stream:
            return StreamingResponse(reply.events(), media_type="text/event-stream")
        whole = asyncio.ensure_future(reply.whole())
        left = asyncio.ensure_future(_client_left(request))
        try:
            await asyncio.wait([whole, left], return_when=asyncio.FIRST_COMPLETED)
        finally:
            left.cancel()
            pool.cancel(job)  # the client left: its worker is freed
        if not whole.done():
            whole.cancel()
            return Response(status_code=499)  # no one reads it
        return JSONResponse(whole.result())

    async def refused(request: Request, error: Exception) -> Response:
        assert isinstance(error, RequestError)
        return JSONResponse(error.body(), error.status, headers=error.headers())

    async def http_error(request: Request, error: Exception) -> Response:
        assert isinstance(error, HTTPException)
        message = f"{request.method} {request.url.path}: {error.detail}"
        return JSONResponse(RequestError(error.status_code, message).body(), error.status_code)

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model:path}", one_model, methods=["GET"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
    ]
    middleware = [Middleware(_KeyCheck, key=api_key)] if api_key else []
    return Starlette(
        routes=routes,
        middleware=middleware,
        exception_handlers={RequestError: refused, HTTPException: http_error},
    )


async def _body(request: Any, limit: int, positions: int) -> bytes:
    """The request's body; a 413 once it passes ``limit`` bytes (no prompt that long fits the
    cache's ``positions``), so a huge body is neither held nor tokenized. The rest is read and
    dropped, up to :data:`DRAINED_BYTES`, so that a client still sending it reads the 413 rather
    than a connection reset."""
    from starlette.requests import ClientDisconnect

    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > DRAINED_BYTES:
                break
            if size <= limit:
                chunks.append(chunk)
    except ClientDisconnect:  # gone, or dropped for sending too slowly: no one reads the answer
        raise RequestError(400, "the client left before sending the whole request body") from None
    if size > limit:
        raise RequestError(
            413,
            f"the request body is more than {limit} bytes: no prompt that long fits the model's {positions} "
            "positions; shorten it",
            code="request_too_large",
        )
    return b"".join(chunks)


async def _client_left(request: Any) -> None:
    """Returns when the client of ``request`` (its body read) disconnects."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _KeyCheck:
    """Refuses (401, OpenAI's error shape) every request whose ``Authorization`` is not ``Bearer <key>``."""

    def __init__(self, app: Any, key: str) -> None:
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                from starlette.responses import JSONResponse

                error = RequestError(
                    401,
                    "no valid API key: send the header 'Authorization: Bearer <key>' with the server's key",
                    code="invalid_api_key",
                )
                await JSONResponse(error.body(), error.status)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _prompt_tokens(model: LanguageModel, wanted: GenerationRequest) -> list[int]:
    """The request's prompt as token ids; a 400 when it leaves the cache no room for a token."""
    where = "messages" if wanted.chat else "prompt"
    try:
        if wanted.messages is not None:
            prompt = model.chat_prompt(wanted.messages, "send a prompt to /v1/completions instead")
        elif isinstance(wanted.prompt, str):
            prompt = model.encode(wanted.prompt)
        else:
            prompt = list(wanted.prompt or [])
            vocabulary = model.tokenizer.get_vocab_size(with_added_tokens=True)
            if max(prompt) >= vocabulary:
                raise RequestError(400, f"prompt: token id {max(prompt)} is past the vocabulary's {vocabulary}", where)
    except CheckpointError as e:
        raise RequestError(400, str(e), where) from None
    if not prompt:
        raise RequestError(400, f"the {where} comes to no tokens: give some text", where)
    try:
        model.refuse_unfitting(prompt)
    except ValueError as e:
        raise RequestError(400, str(e), where, code="context_length_exceeded") from None
    return prompt
