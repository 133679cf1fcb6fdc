"""`torchdelegate llm serve FILE`: a server started on loopback by the test, used through the `openai`
client and curl, stopped by SIGTERM. Greedy replies equal transformers' greedy tokens (what `llm
generate` prints, tested beside it), streamed or not, one at a time or four at once; bad requests are
4xx in OpenAI's error shape; a worker killed mid-request fails that request and is replaced."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("onnxruntime")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

from language_models import transformers_greedy  # noqa: E402
from served import CACHE, KEY, STARTUP_SECONDS, Server  # noqa: E402
from test_llm_command import TEXT, _command  # noqa: E402

pytestmark = pytest.mark.xdist_group("llm_serve")  # one worker runs them all: one server, started once


def test_greedy_completions_equal_transformers_streamed_or_not(server: Server) -> None:
    prompt = TEXT[0][:30]
    expected = server.greedy_text(server.tokenizer.encode(prompt), 12)
    whole = server.client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
    assert whole.choices[0].text == expected
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage is not None and whole.usage.completion_tokens == 12
    assert whole.usage.prompt_tokens == len(server.tokenizer.encode(prompt))
    streamed = server.client.completions.create(
        model="tiny", prompt=prompt, max_tokens=12, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12
    printed = server.generate_text.stdout  # type: ignore[attr-defined]
    assert printed.startswith(expected), printed  # llm generate prints the same text


def test_chat_reuses_the_cached_prefix_of_a_conversation(server: Server) -> None:
    messages: list[Any] = [{"role": "user", "content": "hello there"}]
    first = server.client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0)
    prompt = server.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    assert first.choices[0].message.content == server.greedy_text(prompt, 6)
    messages += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "ok"}]
    second = server.client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0)
    prompt = server.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    assert second.choices[0].message.content == server.greedy_text(prompt, 6)
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    pieces = server.client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=6, temperature=0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in pieces) == second.choices[0].message.content


def test_four_concurrent_requests_each_get_their_own_greedy_reply(server: Server) -> None:
    prompts = [TEXT[0][:20], TEXT[1][:25], TEXT[2][:15], TEXT[1][:40]]

    def ask(prompt: str) -> str:
        reply = server.client.completions.create(model="tiny", prompt=prompt, max_tokens=20, temperature=0)
        return str(reply.choices[0].text)

    with ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(ask, prompts))  # 2 workers, 2 waiting
    assert replies == [server.greedy_text(server.tokenizer.encode(p), 20) for p in prompts]


def test_stop_sequences_cut_the_text_and_the_seed_fixes_sampling(server: Server) -> None:
    prompt = TEXT[1][:30]
    full = server.greedy_text(server.tokenizer.encode(prompt), 20)
    stop = full[5:8]
    tokens = transformers_greedy(server.model, server.tokenizer.encode(prompt), 20)
    through_stop = next(
        n for n in range(1, 21) if stop in server.tokenizer.decode(tokens[:n], skip_special_tokens=True)
    )
    cut = server.client.completions.create(model="tiny", prompt=prompt, max_tokens=20, temperature=0, stop=[stop])
    assert cut.choices[0].text == full[: full.index(stop)] and cut.choices[0].finish_reason == "stop"
    assert cut.usage is not None and cut.usage.completion_tokens == through_stop  # not what the worker ran on to make
    streamed = list(
        server.client.completions.create(
            model="tiny", prompt=prompt, max_tokens=20, temperature=0, stop=stop, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    assert "".join(c.choices[0].text for c in streamed if c.choices) == full[: full.index(stop)]
    assert streamed[-1].usage is not None and streamed[-1].usage.completion_tokens == through_stop
    sampled = [
        server.client.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=1.0, seed=7)
        for _ in range(2)
    ]
    assert sampled[0].choices[0].text == sampled[1].choices[0].text


def _curl(server: Server, path: str, body: str | None = None, key: str | None = KEY) -> tuple[int, str]:
    command = ["curl", "-s", "-N", "-o", "-", "-w", "\n%{http_code}", f"{server.url.removesuffix('/v1')}{path}"]
    if key:
        command += ["-H", f"Authorization: Bearer {key}"]
    if body is not None:
        command += ["-H", "Content-Type: application/json", "--data-binary", "@-"]  # any length, on standard input
    done = subprocess.run(command, input=body, capture_output=True, text=True, timeout=60)
    text, _, status = done.stdout.rpartition("\n")
    return int(status), text


def test_curl_streams_server_sent_events_and_lists_the_model(server: Server) -> None:
    status, text = _curl(server, "/v1/models")
    assert status == 200 and json.loads(text)["data"][0]["id"] == "tiny"
    assert json.loads(text)["data"][0]["max_model_len"] == CACHE
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 4}
    status, text = _curl(server, "/v1/chat/completions", json.dumps(body))
    events = [line.removeprefix("data: ") for line in text.splitlines() if line.startswith("data: ")]
    assert status == 200 and events[-1] == "[DONE]"
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
    status, text = _curl(server, "/health")
    assert status == 200 and json.loads(text)["status"] == "ok"


@pytest.mark.parametrize(
    ("body", "status", "param", "message"),
    [
        ('{"model": "tiny", "prompt": ', 400, None, "the request body is not valid JSON"),
        (
            '{"model": "other", "prompt": "hi"}',
            404,
            "model",
            "the model 'other' does not exist: this server serves 'tiny'",
        ),
        ('{"model": "tiny", "prompt": "hi", "max_tokens": -1}', 400, "max_tokens", "max_tokens -1: give 1 or more"),
        ('{"model": "tiny", "prompt": 3}', 400, "prompt", "prompt is an integer: give a string"),
        ('{"model": "tiny", "prompt": "hi", "temperature": "hot"}', 400, "temperature", "give a finite number"),
        ('{"model": "tiny", "prompt": "hi", "logit_bias": {}}', 400, "logit_bias", "unrecognized request argument"),
        ('{"model": "tiny", "prompt": "hi", "n": 2}', 400, "n", "n 2 is not supported by this server"),
        ('["tiny"]', 400, None, "the request body is a list, not an object"),
        (json.dumps({"model": "tiny", "prompt": " ".join(TEXT * 8)}), 400, "prompt", "program's cache holds 400"),
        pytest.param(
            json.dumps({"model": "tiny", "prompt": "x" * (2 << 20)}),
            413,
            None,
            "no prompt that long fits the model's",
            id="a-body-past-any-prompt-that-fits",  # its own id: the test's name reaches the environment
        ),
    ],
)
def test_bad_requests_are_refused_in_openais_error_shape(
    server: Server, body: str, status: int, param: str | None, message: str
) -> None:
    got, text = _curl(server, "/v1/completions", body)
    error = json.loads(text)["error"]
    assert got == status and error["param"] == param and message in error["message"], text


def test_a_body_past_any_prompt_that_fits_is_413_to_the_openai_client_too(server: Server) -> None:
    """The openai client sends the whole body without waiting: it still reads the 413, not a reset."""
    with pytest.raises(openai.APIStatusError) as refused:
        server.client.completions.create(model="tiny", prompt="x" * (2 << 20), max_tokens=1)
    assert refused.value.status_code == 413 and "no prompt that long fits" in str(refused.value)


def test_a_request_without_the_key_is_401(server: Server) -> None:
    status, text = _curl(server, "/v1/models", key=None)
    error = json.loads(text)["error"]
    assert status == 401 and error["code"] == "invalid_api_key"
    assert error["message"].startswith("no valid API key: send the header 'Authorization: Bearer <key>'")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url, api_key="wrong", max_retries=0).models.list()


def test_a_server_that_cannot_start_says_why_in_one_line(server: Server) -> None:
    place = server.stderr.parent
    port = int(server.url.rsplit(":", 1)[1].split("/")[0])
    taken = _command("llm", "serve", "tiny.tdp", "--port", str(port), cwd=place)
    assert taken.returncode == 1 and taken.stderr.count("\n") == 1, taken.stderr
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in taken.stderr
    none = _command("llm", "serve", "tiny.tdp", "--workers", "0", cwd=place)
    assert none.returncode == 2 and "--workers 0: give 1 or more" in none.stderr, none.stderr
    checkpoint = _command("llm", "serve", "checkpoint", "--port", "0", cwd=place)
    assert checkpoint.returncode == 1 and (
        "checkpoint is a directory, not a program file: a checkpoint? make a program file from it with "
        "torchdelegate llm export checkpoint -o FILE.tdp" in checkpoint.stderr
    ), checkpoint.stderr


def _health(server: Server) -> dict[str, Any]:
    status, text = _curl(server, "/health")
    return dict(json.loads(text)) if status in (200, 503) else {}


def _until(condition: Any, what: str) -> None:
    deadline = time.monotonic() + STARTUP_SECONDS
    while not condition():
        assert time.monotonic() < deadline, f"still waiting for {what}"
        time.sleep(0.2)


def test_a_full_queue_is_429_and_workers_killed_mid_request_fail_only_their_requests(server: Server) -> None:
    """Both workers stopped (SIGSTOP) with a request each and two waiting: a fifth is refused with 429.
    Then both are killed: their requests end with an error saying so, the waiting ones are answered by
    the replacements, and the server is healthy again."""
    workers = server.workers()
    assert len(workers) == 2
    for pid in workers:
        os.kill(pid, signal.SIGSTOP)
    prompts = [TEXT[2][:20], TEXT[0][:25], TEXT[1][:15], TEXT[2][:30]]
    try:
        running = [
            server.client.completions.create(model="tiny", prompt=p, max_tokens=8, temperature=0, stream=True)
            for p in prompts[:2]
        ]
        _until(lambda: _health(server).get("busy") == 2, "both workers to hold a request")
        pool = ThreadPoolExecutor(2)
        waiting = [
            pool.submit(server.client.completions.create, model="tiny", prompt=p, max_tokens=8, temperature=0)
            for p in prompts[2:]
        ]
        _until(lambda: _health(server).get("waiting") == 2, "two requests to wait")
        status, text = _curl(server, "/v1/completions", json.dumps({"model": "tiny", "prompt": "hi"}))
        assert status == 429 and json.loads(text)["error"]["code"] == "queue_full", text
        assert "the server is busy: 2 workers generating and 2 requests waiting" in text
        with pytest.raises(openai.RateLimitError) as refused:
            server.client.completions.create(model="tiny", prompt="hi", max_tokens=2)
        assert refused.value.response.headers["retry-after"] == "1"  # the openai client waits that long to retry
    finally:
        for pid in workers:
            os.kill(pid, signal.SIGKILL)
    for stream in running:
        with pytest.raises(openai.APIError, match="the worker generating this request stopped"):
            list(stream)
    answers = [future.result(timeout=STARTUP_SECONDS).choices[0].text for future in waiting]
    assert answers == [server.greedy_text(server.tokenizer.encode(p), 8) for p in prompts[2:]]
    _until(lambda: _health(server).get("workers") == 2, "the replacements")
    health = _health(server)
    assert health["status"] == "ok" and health["replaced"] >= 2, health
    wanted = {rf"worker {pid} stopped generating request \d+ \(exit code -9\)" for pid in workers}
    _until_printed(server, wanted)


def _until_printed(server: Server, patterns: set[str]) -> None:
    """Read the server's output until a line matches each of ``patterns``, within a bounded wait;
    other lines are passed over."""
    left = set(patterns)

    def read() -> None:
        assert server.process.stdout is not None
        while left:
            line = server.process.stdout.readline()
            if not line:
                return
            left.difference_update({p for p in left if re.fullmatch(p, line.strip())})

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout=30)
    assert not left, f"the server never printed lines matching {sorted(left)}"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
