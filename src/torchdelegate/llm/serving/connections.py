"""The server's connections under clients that hold them open: uvicorn's h11 protocol with a deadline
for each request's header and a least rate for its body, and a cap on open connections below the
process's open-files limit.

uvicorn has neither of the first two: without them, a client that sends half a header keeps its
connection (a file descriptor) for ever, and enough such clients exhaust the process's files, so no
one else is even accepted. Here a header must be whole within :data:`HEADER_SECONDS` of its first
byte (of the connection, for its first request), a body must keep up :data:`BODY_BYTES_PER_SECOND`
after :data:`BODY_GRACE_SECONDS`, and past the cap the connection that has waited longest for its
header is closed to make room: a client whose request is whole is never the one closed, and a new
connection never waits for a slow one to time out.
"""

from __future__ import annotations

import asyncio
import json
import resource
import time
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from torchdelegate.llm.serving.openai_requests import RequestError

HEADER_SECONDS = 5.0
"""How long a request's header may take to arrive whole, from its first byte (from the connection,
for the first request; an idle kept-alive connection is uvicorn's to close, after 5 s)."""
BODY_GRACE_SECONDS = 5.0
BODY_BYTES_PER_SECOND = 16 << 10
"""A body must arrive at this rate on average, counted after its first :data:`BODY_GRACE_SECONDS`:
a 1 MiB body may take 69 s; one sent a byte at a time is dropped after 5."""
MOST_CONNECTIONS = 8192
"""Open connections at most, whatever the files allow (each holds some memory)."""
ACCEPT_BATCH = 50
"""Connections the event loop accepts at once when many wait (uvicorn's backlog). A connection is
counted against the cap two turns of the loop after it is accepted, and one closed to make room gives
its file back a turn later, so files are kept free for :data:`ACCEPTS_IN_FLIGHT` batches beyond the
cap: accepting never fails for want of one."""
ACCEPTS_IN_FLIGHT = 5
LISTEN_BACKLOG = 4096
"""Connections the kernel holds for the server to accept (no file each until accepted; the system's
``somaxconn`` may lower it): a burst waits there rather than being refused and retried a second later."""
FILES_BESIDE_CONNECTIONS = 64
"""Files the front holds besides connections and its workers' pipes: standard streams, the listening
socket, the event loop's, the program file, the tokenizer's."""
FILES_PER_WORKER = 4


def raised_file_limit(wanted: int) -> int:
    """The process's open-files limit after raising its soft limit toward ``wanted`` (no further than
    the hard limit allows): the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass  # a limit the system will not raise: the cap below follows the one there is
    return MOST_CONNECTIONS + 10**6 if soft == resource.RLIM_INFINITY else soft


def connection_cap(workers: int) -> int:
    """How many connections the server keeps open at once: :data:`MOST_CONNECTIONS`, or fewer when
    the open-files limit (raised as far as it may be first) leaves room for fewer beside the files
    the front and its ``workers`` need and a batch of connections being accepted."""
    beside = FILES_BESIDE_CONNECTIONS + FILES_PER_WORKER * workers + ACCEPTS_IN_FLIGHT * ACCEPT_BATCH
    files = raised_file_limit(MOST_CONNECTIONS + beside)
    return max(files // 2, min(MOST_CONNECTIONS, files - beside))


def cap_note(cap: int) -> str | None:
    """What to tell the operator when the open-files limit holds connections below :data:`MOST_CONNECTIONS`."""
    if cap >= MOST_CONNECTIONS:
        return None
    files = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return f"at most {cap} connections at once: the open-files limit ({files}) allows no more; raise ulimit -Hn"


class OpenConnections:
    """The connections of one server: how many are open, those waiting for a request's header and those
    still receiving a body, oldest first (the ones closed to make room past :attr:`cap`)."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.count = 0
        self.waiting: dict[GuardedH11Protocol, None] = {}  # insertion order: oldest first
        self.receiving: dict[GuardedH11Protocol, None] = {}

    def opened(self, connection: GuardedH11Protocol) -> None:
        """Counts ``connection`` in; past the cap, closes the one that has waited longest for its
        header, else the one that has been receiving its body longest (a body sent just fast enough
        must not hold a place for ever), or ``connection`` itself (a 503) when every other one has
        sent its request whole."""
        self.count += 1
        self.waiting[connection] = None
        if self.count <= self.cap:
            return
        oldest = next(iter(self.waiting))
        if oldest is not connection:
            oldest.refuse(503, f"the server holds {self.cap} connections: this one, still without a request, "
                               "was closed for a newer one; send the request whole as soon as connected")  # fmt: skip
        elif self.receiving:
            next(iter(self.receiving)).refuse(
                503,
                f"the server holds {self.cap} connections: this one, still sending its body, was closed for "
                "a newer one; send the request whole as soon as connected",
            )
        else:
            connection.refuse(503, f"the server holds {self.cap} connections, each with a request: try again")

    def closed(self, connection: GuardedH11Protocol) -> None:
        self.count -= 1
        self.waiting.pop(connection, None)
        self.receiving.pop(connection, None)


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the header deadline, the body rate and the cap of the server's
    :class:`OpenConnections` (:func:`guarded_protocol` binds one)."""

    open_connections: OpenConnections

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._timer: asyncio.TimerHandle | None = None
        self._phase = "header"  # then "body", then "answer"; "header" again for a kept-alive connection's next
        self._counted = False
        self._body_start = 0.0
        self._body_bytes = 0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._counted = True
        self._timer = self.loop.call_later(HEADER_SECONDS, self._header_late)
        self.open_connections.opened(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self._uncount()
        self._set_timer(None)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._phase == "header" and self._timer is None:
            self._timer = self.loop.call_later(HEADER_SECONDS, self._header_late)
        elif self._phase == "body":
            self._body_bytes += len(data)
        super().data_received(data)
        self._advance()

    def on_response_complete(self) -> None:
        if not self.transport.is_closing():
            self._phase = "header"
            if self._counted:
                self.open_connections.waiting[self] = None
        super().on_response_complete()  # a pipelined request may begin (and end its header) here
        self._advance()

    def refuse(self, status: int, message: str) -> None:
        """Answers ``status`` with ``message`` (OpenAI's error shape, as the application's) and closes,
        uncounted at once so that the cap counts only connections that stay."""
        self._uncount()
        self._set_timer(None)
        if self.transport.is_closing():
            return
        body = json.dumps(RequestError(status, message, code="connection_refused").body()).encode()
        reason = {408: b"Request Timeout", 503: b"Service Unavailable"}[status]
        head = b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\nconnection: close\r\ncontent-length: %d\r\n\r\n"
        self.transport.write(head % (status, reason, len(body)) + body)
        self.transport.close()

    def _advance(self) -> None:
        """Moves past the header once h11 has read it, and past the body once it is whole."""
        state = self.conn.their_state
        if self._phase == "header" and state is not h11.IDLE:
            self._phase, self._body_start, self._body_bytes = "body", time.monotonic(), 0
            self.open_connections.waiting.pop(self, None)
            if self._counted:
                self.open_connections.receiving[self] = None
            self._set_timer(self.loop.call_later(BODY_GRACE_SECONDS, self._body_slow))
        if self._phase == "body" and state is not h11.SEND_BODY:
            self._phase = "answer"
            self.open_connections.receiving.pop(self, None)
            self._set_timer(None)

    def _header_late(self) -> None:
        self._timer = None
        if self._phase == "header":
            self.refuse(408, f"the request's header did not arrive whole within {HEADER_SECONDS:g} s: send it at once")

    def _body_slow(self) -> None:
        """Drops the connection if its body is behind the least rate; else looks again when it would be."""
        self._timer = None
        if self._phase != "body":
            return
        due = self._body_start + BODY_GRACE_SECONDS + self._body_bytes / BODY_BYTES_PER_SECOND
        if time.monotonic() >= due:
            self.refuse(408, f"the request's body arrived slower than {BODY_BYTES_PER_SECOND} bytes a second: "
                             "send it at once")  # fmt: skip
        else:
            self._set_timer(self.loop.call_at(self.loop.time() + due - time.monotonic(), self._body_slow))

    def _set_timer(self, timer: asyncio.TimerHandle | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = timer

    def _uncount(self) -> None:
        if self._counted:
            self._counted = False
            self.open_connections.closed(self)


def guarded_protocol(connections: OpenConnections) -> type[GuardedH11Protocol]:
    """The protocol class uvicorn makes each connection of one server with (``Config(http=...)``)."""
    return type("ServerConnection", (GuardedH11Protocol,), {"open_connections": connections})
