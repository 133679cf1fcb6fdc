"""The bodies of OpenAI's ``/v1/completions`` and ``/v1/chat/completions``, read and checked.

What a request may say is what this server honours, and nothing else: a field it does not know
or does not honour is refused with a 400 naming it (as OpenAI refuses an unrecognized argument),
rather than silently ignored. The only fields accepted without effect are ``user``, which OpenAI
itself only records, and fields at the values that mean "off" (``n: 1``, ``logprobs: false``...).
Every refusal is a :class:`RequestError` carrying the status, the field and OpenAI's error ``type``
and ``code``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from torchdelegate.errors import TorchDelegateError
from torchdelegate.llm.generation import Sampling

MAX_STOP_SEQUENCES = 4
"""As OpenAI: up to four stop sequences."""


class RequestError(TorchDelegateError):
    """A request refused: ``status`` (4xx, or 5xx for the server's own state), the ``param`` it names
    and OpenAI's error ``type`` and ``code``."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        kind: str = "invalid_request_error",
        code: str | None = None,
        retry_after: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code
        self.retry_after = retry_after

    def headers(self) -> dict[str, str]:
        """``Retry-After`` (seconds) when sending the request again later may succeed (429, 503)."""
        return {} if self.retry_after is None else {"Retry-After": str(self.retry_after)}

    def body(self) -> dict[str, Any]:
        """OpenAI's error shape."""
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class GenerationRequest:
    """What one request asks for: the prompt as text (completions) or messages (chat), how many
    tokens at most, how they are sampled, where text stops, and how it is returned."""

    chat: bool
    model: str
    prompt: str | list[int] | None
    messages: list[dict[str, str]] | None
    max_tokens: int | None
    sampling: Sampling
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False


_COMMON = {
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "user",
    "n",
    "presence_penalty",
    "frequency_penalty",
    "logprobs",
}
_CHAT = _COMMON | {"messages", "max_completion_tokens", "top_logprobs"}
_COMPLETION = _COMMON | {"prompt", "echo", "best_of"}
_OFF = {"n": 1, "presence_penalty": 0, "frequency_penalty": 0, "echo": False, "best_of": 1}
_ROLES = ("system", "developer", "user", "assistant")


def model_not_found(asked: str, served: str) -> RequestError:
    """The 404 for a model this server does not serve (a request's ``model``, or ``/v1/models/NAME``)."""
    return RequestError(
        404, f"the model {asked!r} does not exist: this server serves {served!r}", "model", code="model_not_found"
    )


def parsed_body(raw: bytes) -> dict[str, Any]:
    """The request's JSON object; a 400 when it is not JSON or not an object."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise RequestError(400, f"the request body is not valid JSON ({e}); send a JSON object") from None
    except RecursionError:
        raise RequestError(400, "the request body is nested too deeply to read; send a flat JSON object") from None
    if not isinstance(body, dict):
        kind = _JSON_KINDS.get(type(body), type(body).__name__)
        raise RequestError(400, f"the request body is {kind}, not an object; send a JSON object")
    return body


def generation_request(body: dict[str, Any], chat: bool, model: str) -> GenerationRequest:
    """``body`` checked for ``/v1/chat/completions`` (``chat``) or ``/v1/completions``, served by ``model``."""
    allowed = _CHAT if chat else _COMPLETION
    for name in sorted(body):
        if name not in allowed:
            raise RequestError(
                400, f"unrecognized request argument supplied: {name}", name, code="unsupported_parameter"
            )
    for name, off in _OFF.items():
        if name in body and body[name] is not None and body[name] != off:
            raise RequestError(
                400,
                f"{name} {body[name]!r} is not supported by this server: leave it out or give {off!r}",
                name,
                code="unsupported_parameter",
            )
    if body.get("logprobs") not in (None, False, 0):
        raise RequestError(
            400,
            "logprobs are not returned by this server: leave logprobs out",
            "logprobs",
            code="unsupported_parameter",
        )
    if body.get("top_logprobs") not in (None, 0):
        raise RequestError(
            400,
            "top_logprobs are not returned by this server: leave it out",
            "top_logprobs",
            code="unsupported_parameter",
        )
    named = _required(body, "model", str)
    if named != model:
        raise model_not_found(named, model)
    max_tokens = _optional_integer(body, "max_tokens", 1)
    if chat:
        newer = _optional_integer(body, "max_completion_tokens", 1)
        if newer is not None and max_tokens is not None and newer != max_tokens:
            raise RequestError(
                400,
                f"max_tokens {max_tokens} and max_completion_tokens {newer} disagree: give one of them",
                "max_completion_tokens",
            )
        max_tokens = newer if newer is not None else max_tokens
    stream = _optional(body, "stream", bool, False)
    options = _optional(body, "stream_options", dict, None)
    if options is not None and not stream:
        raise RequestError(400, "stream_options is only allowed when stream is true", "stream_options")
    include_usage = False
    if options is not None:
        unknown = sorted(set(options) - {"include_usage"})
        if unknown:
            raise RequestError(
                400,
                f"stream_options.{unknown[0]} is not supported: give include_usage only",
                f"stream_options.{unknown[0]}",
                code="unsupported_parameter",
            )
        include_usage = _optional(options, "include_usage", bool, False, "stream_options.")
    return GenerationRequest(
        chat=chat,
        model=named,
        prompt=None if chat else _prompt(body),
        messages=_messages(body) if chat else None,
        max_tokens=max_tokens,
        sampling=_sampling(body),
        stop=_stop(body),
        stream=stream,
        include_usage=include_usage,
    )


def _sampling(body: dict[str, Any]) -> Sampling:
    temperature = _optional_number(body, "temperature", 1.0)
    if not 0 <= temperature <= 2:
        raise RequestError(400, f"temperature {temperature!r}: give a number from 0 (greedy) to 2", "temperature")
    top_p = _optional_number(body, "top_p", 1.0)
    if not 0 < top_p <= 1:
        raise RequestError(400, f"top_p {top_p!r}: give a probability in (0, 1]", "top_p")
    top_k = _optional_integer(body, "top_k", 1)
    seed = _optional(body, "seed", int, None)
    if seed is not None and not 0 <= seed < 2**63:
        raise RequestError(400, f"seed {seed!r}: give an integer from 0 to 2**63 - 1", "seed")
    return Sampling(temperature, top_k, top_p if top_p < 1 else None, seed)


def _prompt(body: dict[str, Any]) -> str | list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # one prompt in a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise RequestError(400, "prompt is empty: give the text to continue", "prompt")
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if min(prompt) < 0:
            raise RequestError(400, "prompt: token ids are 0 or more", "prompt")
        return list(prompt)
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise RequestError(400, f"prompt is a batch of {len(prompt)} prompts: send one prompt per request", "prompt")
    shown = "missing" if prompt is None else _JSON_KINDS.get(type(prompt), type(prompt).__name__)
    raise RequestError(400, f"prompt is {shown}: give a string (or a list of token ids)", "prompt")


def _messages(body: dict[str, Any]) -> list[dict[str, str]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(400, "messages: give a non-empty list of {role, content} objects", "messages")
    read = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            kind = _JSON_KINDS.get(type(message), type(message).__name__)
            raise RequestError(400, f"{where} is {kind}: give a {{role, content}} object", where)
        role = message.get("role")
        if role not in _ROLES:
            raise RequestError(400, f"{where}.role {role!r}: give one of {', '.join(_ROLES)}", f"{where}.role")
        extra = sorted(set(message) - {"role", "content", "name"})
        if extra:
            raise RequestError(
                400,
                f"{where}.{extra[0]} is not supported by this server (text messages only)",
                f"{where}.{extra[0]}",
                code="unsupported_parameter",
            )
        read.append({"role": "system" if role == "developer" else role, "content": _content(message, where)})
    return read


def _content(message: dict[str, Any], where: str) -> str:
    """A message's text: a string, or a list of ``{"type": "text", "text": ...}`` parts joined."""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for index, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise RequestError(
                    400, f"{where}.content[{index}]: only text parts are supported", f"{where}.content[{index}]"
                )
            texts.append(part["text"])
        return "".join(texts)
    raise RequestError(400, f"{where}.content: give a string or a list of text parts", f"{where}.content")


def _stop(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise RequestError(400, "stop: give a non-empty string or a list of them", "stop")
    if len(stops) > MAX_STOP_SEQUENCES:
        raise RequestError(400, f"stop has {len(stops)} sequences: give at most {MAX_STOP_SEQUENCES}", "stop")
    return list(stops)


_JSON_KINDS = {str: "a string", int: "an integer", float: "a number", bool: "true or false", dict: "an object",
               list: "a list", type(None): "null"}  # fmt: skip


def _required(body: dict[str, Any], name: str, kind: type) -> Any:
    value = body.get(name)
    if not isinstance(value, kind):
        shown = "missing" if value is None else _JSON_KINDS.get(type(value), type(value).__name__)
        raise RequestError(400, f"{name} is {shown}: give {_JSON_KINDS[kind]}", name)
    return value


def _optional(body: dict[str, Any], name: str, kind: type, default: Any, prefix: str = "") -> Any:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        shown = _JSON_KINDS.get(type(value), type(value).__name__)
        raise RequestError(400, f"{prefix}{name} is {shown}: give {_JSON_KINDS[kind]}", prefix + name)
    return value


def _optional_integer(body: dict[str, Any], name: str, least: int) -> int | None:
    value = _optional(body, name, int, None)
    if value is not None and value < least:
        raise RequestError(400, f"{name} {value}: give {least} or more", name)
    return value


def _optional_number(body: dict[str, Any], name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    try:
        number = float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan
    except OverflowError:
        number = math.inf
    if not math.isfinite(number):
        raise RequestError(400, f"{name} {str(value)[:40]!r}: give a finite number", name)
    return number
