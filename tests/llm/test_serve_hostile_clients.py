"""`llm serve` under clients that attack it over loopback: connections holding half a header, far more of
them than the server's open-files limit (1,024, hard too); requests sent a byte at a time; chats whose
checkpoint's template loops without useful end. Others are still answered at once, the attackers are
dropped within the server's timeouts, and (served.py, at the end) SIGTERM stops it within its grace
period all the same."""

from __future__ import annotations

import json
import resource
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

pytest.importorskip("transformers")
pytest.importorskip("onnxruntime")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

from served import KEY, SERVER_FILES, SPIN_BODY, Server, enough_files, until_closed  # noqa: E402

from torchdelegate.llm.chat_template import TEMPLATE_STEPS  # noqa: E402
from torchdelegate.llm.serving.connections import BODY_GRACE_SECONDS, HEADER_SECONDS  # noqa: E402

pytestmark = pytest.mark.xdist_group("llm_serve")  # the server of test_serve.py, started once

HALF_OPEN = 1100


def _fresh_client(server: Server) -> openai.OpenAI:
    """A client with a connection pool of its own: none of its connections predates the attack."""
    return openai.OpenAI(base_url=server.url, api_key=KEY, max_retries=0, timeout=15)


def test_a_request_is_answered_within_2_s_while_1100_connections_hold_half_a_header(server: Server) -> None:
    """More half-sent requests than the server has files: those past its cap are closed (the one
    waiting longest first, with a 503 saying why; or by their header's deadline, a 408), and a request
    sent after them all is answered within 2 s."""
    enough_files(HALF_OPEN + 200)
    held: list[socket.socket] = []
    try:
        opening = time.monotonic()
        for _ in range(HALF_OPEN):
            connection = socket.create_connection(server.address, timeout=5)
            connection.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer ")
            held.append(connection)
        opened = time.monotonic() - opening
        started = time.monotonic()
        reply = _fresh_client(server).completions.create(model="tiny", prompt="hello", max_tokens=2, temperature=0)
        answered = time.monotonic() - started
        assert reply.choices[0].finish_reason in ("length", "stop")
        assert answered < 2, f"answered after {answered:.1f} s"
        closed = [said for said in map(_said_if_closed, held) if said is not None]
    finally:
        for connection in held:
            connection.close()
    evicted = [said for said in closed if b"still without a request, was closed for a newer one" in said]
    timed_out = [said for said in closed if b"header did not arrive whole within" in said]
    assert len(evicted) + len(timed_out) == len(closed) >= HALF_OPEN - SERVER_FILES, closed[:3]
    assert all(said.startswith(b"HTTP/1.1 503 ") for said in evicted)
    if opened < HEADER_SECONDS:  # none could have timed out before the last was opened: the cap closed them
        assert len(evicted) >= HALF_OPEN - SERVER_FILES, (len(evicted), len(timed_out))


class _Connection:
    """What OpenConnections asks of a connection: to be refused, with a status and why."""

    def __init__(self, connections: Any) -> None:
        self.connections = connections
        self.refused: tuple[int, str] | None = None

    def refuse(self, status: int, message: str) -> None:
        self.refused = (status, message)
        self.connections.closed(self)


def test_past_the_cap_a_body_sent_slowly_gives_way_to_a_new_connection() -> None:
    """Bodies sent just fast enough to pass the rate held every place, and each new connection was
    refused: past the cap, the one receiving its body longest is closed instead (from the review)."""
    from torchdelegate.llm.serving.connections import OpenConnections

    connections = OpenConnections(cap=2)
    first, second = _Connection(connections), _Connection(connections)
    for sending in (first, second):
        connections.opened(sending)  # type: ignore[arg-type]
        connections.waiting.pop(sending)  # its header read: now receiving its body
        connections.receiving[sending] = None  # type: ignore[index]
    newest = _Connection(connections)
    connections.opened(newest)  # type: ignore[arg-type]
    assert newest.refused is None and second.refused is None
    assert first.refused is not None and "still sending its body, was closed for a newer one" in first.refused[1]


def _said_if_closed(connection: socket.socket) -> bytes | None:
    """What the server sent on ``connection`` if it closed it by now (all of it is in our buffer)."""
    said = b""
    connection.setblocking(False)
    while True:
        try:
            data = connection.recv(65536)
        except BlockingIOError:
            return None  # still open
        except OSError:
            return said
        if not data:
            return said
        said += data


def test_a_half_sent_header_and_a_trickled_body_are_dropped_within_the_timeouts(server: Server) -> None:
    header = socket.create_connection(server.address, timeout=5)
    body = socket.create_connection(server.address, timeout=5)
    with header, body:
        started = time.monotonic()
        header.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-")
        body.sendall(
            f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{".encode()
        )
        deadline = started + HEADER_SECONDS + BODY_GRACE_SECONDS + 5
        with ThreadPoolExecutor(2) as both:
            header_closed = both.submit(until_closed, header, deadline)
            body_closed = both.submit(until_closed, body, deadline, True)
            (header_at, said), (body_at, _) = header_closed.result(), body_closed.result()
    header_open, body_open = header_at - started, body_at - started
    assert header_open < HEADER_SECONDS + 1.5, f"the half header was still open after {header_open:.1f} s"
    assert said.startswith(b"HTTP/1.1 408 ") and b"header did not arrive whole within" in said, said
    assert body_open < BODY_GRACE_SECONDS + 1.5, f"the trickled body was still open after {body_open:.1f} s"


def test_a_chat_template_that_loops_without_end_is_refused_fast_and_completions_go_on(server: Server) -> None:
    """Eight chats whose template would take 10^10 steps: each is refused (400, naming the template)
    in seconds, and a completion sent meanwhile is answered without waiting for them."""
    with ThreadPoolExecutor(8) as chats:
        spinning = [chats.submit(server.post, "/v1/chat/completions", SPIN_BODY, 30) for _ in range(8)]
        time.sleep(0.3)  # the chats reach the template
        started = time.monotonic()
        reply = _fresh_client(server).completions.create(model="tiny", prompt="hello", max_tokens=2, temperature=0)
        answered = time.monotonic() - started
        refused = [future.result() for future in spinning]
    assert reply.choices[0].text is not None and answered < 5, f"the completion took {answered:.1f} s"
    for status, text in refused:
        error = json.loads(text)["error"]
        assert status == 400 and error["param"] == "messages", text
        assert f"its chat template took more than {TEMPLATE_STEPS:,} steps rendering these messages" in error["message"]


def test_the_open_files_limit_is_raised_toward_the_hard_limit() -> None:
    """A server under a soft limit of 1,024 with a hard one of 4,096 caps connections below 4,096."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 4096:
        pytest.skip(f"this process's hard open-files limit is {hard}")
    code = (
        "import resource; resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 4096))\n"
        "from torchdelegate.llm.serving.connections import connection_cap\n"
        "cap = connection_cap(4); print(cap, resource.getrlimit(resource.RLIMIT_NOFILE)[0])"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    cap, raised = map(int, done.stdout.split())
    assert raised == 4096 and 3000 < cap < 4096, done.stdout
