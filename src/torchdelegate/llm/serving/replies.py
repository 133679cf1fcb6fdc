"""A generation's tokens as OpenAI's response to ``llm serve``'s routes: the text (whole, or as
server-sent events) cut at the first stop sequence, the finish reason and the usage counts."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from torchdelegate.llm.language_model import LanguageModel, TextStream
from torchdelegate.llm.serving.openai_requests import GenerationRequest, RequestError
from torchdelegate.llm.serving.worker_pool import Job, JobEnd, WorkerPool
from torchdelegate.llm.serving.worker_process import CANCELLED

_FINISH = {"stop token": "stop", "max new tokens": "length", "cache full": "length", CANCELLED: "stop"}


class Reply:
    """A job's tokens as OpenAI's response: text cut at the first stop sequence (the job cancelled
    there), the finish reason and the usage counts."""

    def __init__(self, model: LanguageModel, pool: WorkerPool, job: Job, wanted: GenerationRequest) -> None:
        self.pool, self.job, self.wanted = pool, job, wanted
        self.text = TextStream(model)
        self.kept = ""  # the text so far, up to any stop sequence
        self.sent = 0  # how much of it has been given out
        self.stopped = False
        self.identifier = f"{'chatcmpl' if wanted.chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    async def whole(self) -> dict[str, Any]:
        text = ""
        async for gained, end in self._pieces():
            text += gained
            if end is not None:
                return self._body(text, end)
        raise AssertionError("a job's events end with its end")

    async def events(self) -> AsyncIterator[str]:
        try:
            if self.wanted.chat:
                yield _event(self._chunk({"role": "assistant", "content": ""}, None))
            async for gained, end in self._pieces():
                if gained:
                    yield _event(self._chunk(self._delta(gained), None))
                if end is not None:
                    yield _event(self._chunk(self._delta("") if self.wanted.chat else "", self._finish(end)))
                    if self.wanted.include_usage:
                        yield _event({**self._head(), "choices": [], "usage": self._usage(end)})
                    yield "data: [DONE]\n\n"
        except RequestError as error:
            yield _event(error.body())
        finally:
            self.pool.cancel(self.job)  # the client left, or it is over: either way its worker is freed

    async def _pieces(self) -> AsyncIterator[tuple[str, JobEnd | None]]:
        """The text each of the job's events releases, with the job's end on the last; a
        ``RequestError`` when the job failed. Past a stop sequence, tokens are no longer read."""
        while True:
            event = await self.job.events.get()
            if isinstance(event, RequestError):
                raise event
            end = None if isinstance(event, int) else event
            if not self.stopped:
                self._add(self.text.add(event) if end is None else self.text.rest())
            yield self._released(end is not None), end
            if end is not None:
                return

    def _add(self, gained: str) -> None:
        """``gained`` text; a stop sequence it completes cuts the text there and ends the job."""
        self.kept += gained
        cuts = [self.kept.find(stop) for stop in self.wanted.stop]
        cuts = [cut for cut in cuts if cut >= 0]
        if cuts:
            self.kept = self.kept[: min(cuts)]
            self.stopped = True
            self.pool.cancel(self.job)

    def _released(self, final: bool) -> str:
        """What may be given out now: all but a tail that could begin a stop sequence."""
        end = len(self.kept)
        if not (final or self.stopped):
            end -= _longest_stop_start(self.kept, self.wanted.stop)
        gained = self.kept[self.sent : end]
        self.sent = max(self.sent, end)
        return gained

    def _finish(self, end: JobEnd) -> str:
        return "stop" if self.stopped else _FINISH.get(end.finish, "stop")

    def _usage(self, end: JobEnd) -> dict[str, Any]:
        prompt, completion = len(self.job.prompt), len(self.text.tokens)  # up to the stop, if one was met
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": end.cached},
        }

    def _head(self, kind: str = "chat.completion.chunk") -> dict[str, Any]:
        kind = kind if self.wanted.chat else "text_completion"
        return {"id": self.identifier, "object": kind, "created": self.created, "model": self.wanted.model}

    def _delta(self, text: str) -> Any:
        return {"content": text} if self.wanted.chat else text

    def _chunk(self, delta: Any, finish: str | None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
        choice.update({"delta": delta, "logprobs": None} if self.wanted.chat else {"text": delta, "logprobs": None})
        return {**self._head(), "choices": [choice]}

    def _body(self, text: str, end: JobEnd) -> dict[str, Any]:
        finish = self._finish(end)
        answer = {"message": {"role": "assistant", "content": text}} if self.wanted.chat else {"text": text}
        choice = {"index": 0, **answer, "finish_reason": finish, "logprobs": None}
        return {**self._head("chat.completion"), "choices": [choice], "usage": self._usage(end)}


def _longest_stop_start(text: str, stops: list[str]) -> int:
    """The length of the longest end of ``text`` that begins one of ``stops``."""
    longest = 0
    for stop in stops:
        for length in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:length]):
                longest = length
                break
    return longest


def _event(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"
