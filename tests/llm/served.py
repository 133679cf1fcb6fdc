"""The `llm serve` the serve tests share (tests/llm/conftest.py's session fixture): a tiny Llama exported
and served on loopback with 2 workers, a queue of 2 and an API key, under the common open-files limit
of 1,024 (hard too, so the server cannot raise it), stopped at the end by SIGTERM under hostile
clients. Its chat template loops without useful end (10^10 steps) when the first message is
:data:`SPIN`, as a hostile checkpoint's could; other messages render as transformers renders them."""

from __future__ import annotations

import http.client
import os
import re
import resource
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
from language_models import tiny_llama, transformers_greedy
from test_llm_command import TEXT, _checkpoint, _command, _prefix, _tokenizer

from torchdelegate.llm.serving.http_app import GRACEFUL_SECONDS

KEY = "test-key"
CACHE = 400  # long enough that a reply of CACHE - 20 tokens is still running when its worker is killed
SPIN = "spin"
CHAT = (
    "{% if messages[0]['content'] == '" + SPIN + "' %}"
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}{% endif %}"
    "{% for m in messages %}{{ bos_token }}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}{{ bos_token }}assistant:{% endif %}"
)
STARTUP_SECONDS = 120
SERVER_FILES = 1024  # the open-files limit the server runs under, soft and hard


class Server:
    def __init__(
        self, process: subprocess.Popen[str], url: str, model: torch.nn.Module, tokenizer: Any, stderr: Path
    ) -> None:
        self.process, self.url, self.model, self.tokenizer, self.stderr = process, url, model, tokenizer, stderr
        self.client = openai.OpenAI(base_url=url, api_key=KEY, max_retries=0, timeout=60)
        host, port = url.removeprefix("http://").removesuffix("/v1").rsplit(":", 1)
        self.address = (host, int(port))

    def greedy_text(self, prompt_ids: list[int], new: int) -> str:
        return str(self.tokenizer.decode(transformers_greedy(self.model, prompt_ids, new), skip_special_tokens=True))

    def workers(self) -> list[int]:
        """The pids of the server's worker processes: its children multiprocessing spawned (the
        prepare step has ended; the resource tracker is not spawned so)."""
        children = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                    command = (entry / "cmdline").read_bytes()
                except OSError:
                    continue
                if int(fields[1]) == self.process.pid and b"spawn_main" in command:
                    children.append(int(entry.name))
        return children

    def post(self, path: str, body: str, timeout: float = 30) -> tuple[int, str]:
        """``body`` POSTed to ``path`` on a connection of its own: the status and the text."""
        connection = http.client.HTTPConnection(*self.address, timeout=timeout)
        try:
            headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
            connection.request("POST", path, body, headers)
            response = connection.getresponse()
            return response.status, response.read().decode()
        finally:
            connection.close()


def _server_files() -> None:
    """In the server's process before it runs: the open-files limit most machines give (1,024), made
    the hard limit too, so the server's cap on connections, not a raised limit, keeps it answering."""
    resource.setrlimit(resource.RLIMIT_NOFILE, (SERVER_FILES, SERVER_FILES))


def running_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    place = tmp_path_factory.mktemp("serve")
    model = tiny_llama(vocab_size=512)
    model.config.max_position_embeddings = CACHE  # rotary positions are computed, not stored: any length
    checkpoint = _checkpoint(place / "checkpoint", model)
    tokenizer = _tokenizer()
    tokenizer.chat_template = CHAT  # type: ignore[attr-defined]
    tokenizer.save_pretrained(checkpoint)  # type: ignore[attr-defined]
    exported = _command("llm", "export", checkpoint, "-o", "tiny.tdp", "--max-cache", str(CACHE), cwd=place)
    assert exported.returncode == 0, exported.stderr
    environment = {**os.environ, "TORCHDELEGATE_CACHE": str(place / "cache")}
    process = subprocess.Popen(
        [*_prefix(), "llm", "serve", "tiny.tdp", "--port", "0", "--workers", "2", "--queue", "2", "--api-key", KEY],
        cwd=place,
        env=environment,
        stdout=subprocess.PIPE,
        stderr=(place / "stderr.txt").open("w"),  # a file: a pipe no one reads could fill and block the server
        text=True,
        preexec_fn=_server_files,
    )
    assert process.stdout is not None
    lines = []
    deadline = time.monotonic() + STARTUP_SECONDS
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            break
        lines.append(line)
        if line.startswith("serving "):
            break
    found = re.search(r"at (http://127\.0\.0\.1:\d+/v1)", lines[-1] if lines else "")
    if found is None:
        process.kill()
        process.wait(timeout=30)
        pytest.fail(f"the server did not start: {''.join(lines)}{(place / 'stderr.txt').read_text()}")
    assert any("packed for this machine" in line for line in lines), lines  # the workers share one copy
    assert any(f"connections at once: the open-files limit ({SERVER_FILES}) allows no more" in line for line in lines)
    served = Server(process, found.group(1), model, tokenizer, place / "stderr.txt")
    served.generate_text = _command(  # type: ignore[attr-defined]
        "llm", "generate", "tiny.tdp", "-p", TEXT[0][:30], "--max-new-tokens", "12", cwd=place
    )
    try:
        yield served
        _sigterm_finishes_the_request_in_flight_then_stops_within_its_grace_period(served)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def _sigterm_finishes_the_request_in_flight_then_stops_within_its_grace_period(server: Server) -> None:
    """SIGTERM: the server takes no new request, lets the one generating finish, then exits 0, within
    its grace period though clients hold half-sent requests and chats spin in the chat template."""
    stream = server.client.completions.create(
        model="tiny", prompt=TEXT[0][:20], max_tokens=CACHE - 30, temperature=0, stream=True
    )
    chunks = iter(stream)
    next(chunks)
    held = [socket.create_connection(server.address, timeout=5) for _ in range(20)]
    for connection in held:
        connection.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-")
    spinning = ThreadPoolExecutor(4)
    for _ in range(4):
        spinning.submit(server.post, "/v1/chat/completions", SPIN_BODY, 60)
    time.sleep(0.5)  # the chats reach the template
    server.process.send_signal(signal.SIGTERM)
    asked = time.monotonic()
    try:
        rest = list(chunks)
        assert rest and rest[-1].choices[0].finish_reason == "length"
        stdout, _ = server.process.communicate(timeout=GRACEFUL_SECONDS + 30)
    finally:
        for connection in held:
            connection.close()
        spinning.shutdown(wait=False, cancel_futures=True)
    stopped = time.monotonic() - asked
    stderr = server.stderr.read_text()
    assert server.process.returncode == 0, stderr
    assert "Traceback" not in stderr and stdout.rstrip().endswith("stopped"), (stdout, stderr)
    assert stopped < GRACEFUL_SECONDS, f"the server took {stopped:.1f} s to stop"


SPIN_BODY = '{"model": "tiny", "messages": [{"role": "user", "content": "' + SPIN + '"}], "max_tokens": 2}'


def until_closed(connection: socket.socket, deadline: float, trickle: bool = False) -> tuple[float, bytes]:
    """When the server closed ``connection`` (monotonic time; ``deadline`` if it did not) and what it
    sent; with ``trickle``, a byte is sent every 0.2 s meanwhile."""
    received = b""
    connection.settimeout(0.2)
    while time.monotonic() < deadline:
        try:
            if trickle:
                connection.sendall(b"x")
            data = connection.recv(65536)
        except TimeoutError:
            continue
        except OSError:  # reset: the server closed it while we sent
            return time.monotonic(), received
        if not data:
            return time.monotonic(), received
        received += data
    return deadline, received


def enough_files(count: int) -> None:
    """This process may open ``count`` files (its soft limit raised if need be); skips if it may not."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < count:
        if hard != resource.RLIM_INFINITY and hard < count:
            pytest.skip(f"this process may open {hard} files, fewer than the test's {count}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (count, hard))
