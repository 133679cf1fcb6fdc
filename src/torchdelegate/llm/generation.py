"""Generating tokens with a loaded program's ``prefill`` and ``decode`` over a static KV cache.

The program is the one transformers' exportable wrapper gives (``TorchExportableModuleForDecoderOnlyLM``):
both methods take ``input_ids`` [1, n] and ``cache_position`` [n] and return logits [1, n, vocabulary]
(prefill, as ``llm export`` writes it, only the last position's: [1, 1, vocabulary]), writing the
cache they share at those positions. A prefill of dynamic length reads the whole prompt in one call
(a lone token goes to decode). A prefill exported for a fixed length takes a prompt in chunks of that
length, the last one padded: the padding's cache entries lie past the prompt, where causal attention
never reads them before decoding writes them again; where the padded chunk's logits are the
padding's, decode reads the prompt's last token again for its own.

Everything here is numpy: ids and positions go in as int64 arrays and logits come back as arrays, so
generating never imports torch (a file whose graphs only call ONNX Runtime's delegates runs without
it). A decode step writes its token and position into two arrays made once per generator, so the
program is handed the same inputs each step and rebinds nothing but their contents.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from torchdelegate.runtime.program import Program


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen: greedy when ``temperature`` is 0; otherwise sampled from the
    ``top_k`` most likely tokens whose probabilities add up to ``top_p``, ``seed`` fixing the draw."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature {self.temperature!r}: give 0 (greedy) or more")
        if self.top_k is not None and (
            isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 1
        ):
            raise ValueError(f"top_k {self.top_k!r}: give a number of tokens >= 1")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p {self.top_p!r}: give a probability in (0, 1]")
        if not self.temperature < float("inf"):
            raise ValueError(f"temperature {self.temperature!r}: give a finite number")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed {self.seed!r}: give an integer from 0 to 2**63 - 1")


@dataclass(frozen=True)
class GenerationStats:
    """Timings of one generation (seconds), and what they come to in tokens per second."""

    prompt_tokens: int
    new_tokens: int
    time_to_first_token: float
    decode_time: float

    @property
    def prompt_tokens_per_second(self) -> float:
        return self.prompt_tokens / self.time_to_first_token if self.time_to_first_token else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        decoded = self.new_tokens - 1  # the first new token comes from the prompt's pass
        return decoded / self.decode_time if decoded > 0 and self.decode_time else 0.0


@dataclass(frozen=True)
class Generation:
    """The new tokens, why generation ended (``"stop token"``, ``"max new tokens"``, ``"cache full"``)
    and its timings."""

    tokens: list[int]
    finish: str
    stats: GenerationStats = field(compare=False)


class Generator:
    """Generates tokens with ``program``'s ``prefill`` and ``decode`` methods.

    ``stop_tokens`` end a generation (the stop token is returned as its last token);
    ``max_positions`` is the static cache's length, which a prompt and its new tokens may not
    exceed (None: the program's own shapes say nothing, and the program fails past its cache).
    One generation at a time: they share the program's cache, and decode's two input arrays.
    """

    def __init__(
        self,
        program: Program,
        *,
        stop_tokens: Sequence[int] = (),
        max_positions: int | None = None,
        prefill: str = "prefill",
        decode: str = "decode",
    ) -> None:
        self._prefill, self._decode = program.method(prefill), program.method(decode)
        self.chunk = self._prefill.input_shape("input_ids")[-1]
        """The prompt length prefill was exported for (None: any length)."""
        self.stop_tokens = frozenset(int(t) for t in stop_tokens)
        self.max_positions = max_positions
        self._step_ids = np.zeros((1, 1), dtype=np.int64)  # decode's inputs, written in place each step
        self._step_position = np.zeros(1, dtype=np.int64)

    def warm_up(self) -> None:
        """Decode run once on token 0 at position 0 (and a prefill exported for a fixed chunk, once
        at positions 0 on), the results dropped: a runtime's first call sets up what later calls
        reuse (ONNX Runtime: its threads, its memory arena), which would otherwise fall on the first
        prompt's time. A prefill of any length is not run: in a file ``llm export`` writes it is
        decode's program, which ONNX Runtime runs as one model. The positions it writes are those
        any prompt read from position 0 writes again; call it before a first generation, not
        between a conversation's turns."""
        if self.chunk is not None:
            chunk = np.zeros((1, self.chunk), dtype=np.int64)
            self._prefill(input_ids=chunk, cache_position=np.arange(self.chunk, dtype=np.int64))
        self._decoded(0, 0)

    def generate(
        self,
        prompt: Sequence[int],
        max_new_tokens: int,
        sampling: Sampling = Sampling(),
        on_token: Callable[[int], None] | None = None,
        cached: int = 0,
    ) -> Generation:
        """Up to ``max_new_tokens`` tokens after ``prompt`` (its ids), each passed to ``on_token``
        as soon as it is chosen.

        ``cached``: how many of the prompt's first tokens the cache already holds at their
        positions, from an earlier call (a conversation's previous turns); only the rest is read."""
        tokens: list[int] = []
        finish = "max new tokens"
        started = time.perf_counter()
        first = started
        for token in self._tokens(list(prompt), max_new_tokens, sampling, cached):
            if not tokens:
                first = time.perf_counter()
            if isinstance(token, str):
                finish = token
                break
            tokens.append(token)
            if on_token is not None:
                on_token(token)
            if token in self.stop_tokens:
                finish = "stop token"
                break
        done = time.perf_counter()
        stats = GenerationStats(len(prompt) - cached, len(tokens), first - started, done - first)
        return Generation(tokens, finish, stats)

    def stream(self, prompt: Sequence[int], max_new_tokens: int, sampling: Sampling = Sampling()) -> Iterator[int]:
        """The new tokens one by one, as they are chosen; stops after a stop token."""
        for token in self._tokens(list(prompt), max_new_tokens, sampling, 0):
            if isinstance(token, str):
                return
            yield token
            if token in self.stop_tokens:
                return

    def _tokens(self, prompt: list[int], max_new_tokens: int, sampling: Sampling, cached: int) -> Iterator[int | str]:
        """Each new token; ``"cache full"`` when the cache has no room for the next."""
        if not prompt:
            raise ValueError("the prompt is empty: give at least one token")
        if not 0 <= cached < len(prompt):
            raise ValueError(f"cached {cached!r}: give 0 to {len(prompt) - 1}, leaving at least one token to read")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens {max_new_tokens!r}: give 1 or more")
        if self.max_positions is not None and len(prompt) >= self.max_positions:
            raise ValueError(
                f"the prompt has {len(prompt)} tokens and the cache holds {self.max_positions} positions; "
                "shorten the prompt, or export the model with a longer cache"
            )
        choose = _Chooser(sampling)
        token = choose(self._read_prompt(prompt, cached))
        position = len(prompt)
        for count in range(max_new_tokens):
            yield token
            if count + 1 == max_new_tokens or token in self.stop_tokens:
                return
            if self.max_positions is not None and position >= self.max_positions:
                yield "cache full"
                return
            token = choose(self._decoded(token, position))
            position += 1

    def _decoded(self, token: int, position: int) -> np.ndarray:
        """The logits after ``token`` read by decode at ``position`` (written into the cache there)."""
        self._step_ids[0, 0] = token
        self._step_position[0] = position
        return self._decode(input_ids=self._step_ids, cache_position=self._step_position)[0, -1]

    def _read_prompt(self, prompt: list[int], cached: int) -> np.ndarray:
        """The prompt from position ``cached`` on written into the cache; the logits after its last token."""
        chunk = self.chunk or len(prompt) - cached
        logits = np.empty(0, dtype=np.float32)
        for start in range(cached, len(prompt), chunk):
            part = prompt[start : start + chunk]
            no_room = self.max_positions is not None and start + chunk > self.max_positions
            if no_room or (self.chunk is None and len(part) == 1):  # decode reads a lone token
                for offset, token in enumerate(part):  # one token at a time
                    logits = self._decoded(token, start + offset)
                break
            padded = np.array([part + [part[-1]] * (chunk - len(part))], dtype=np.int64)
            logits = self._prefill(input_ids=padded, cache_position=np.arange(start, start + chunk, dtype=np.int64))
            if logits.shape[1] == chunk:  # every position's logits
                logits = logits[0, len(part) - 1]
            elif len(part) == chunk:
                logits = logits[0, -1]
            else:  # the last position's only, and it was padding's: the prompt's last token read again
                logits = self._decoded(part[-1], start + len(part) - 1)
        return logits


class _Chooser:
    """Chooses each next token from a row of logits, as ``sampling`` says: greedy takes the first
    highest score; sampling draws from numpy's generator, seeded by ``sampling.seed`` (unseeded: fresh
    entropy for each generation, so workers and restarts draw differently)."""

    def __init__(self, sampling: Sampling) -> None:
        self.sampling = sampling
        self.random = np.random.default_rng(sampling.seed) if sampling.temperature else None

    def __call__(self, logits: np.ndarray) -> int:
        sampling = self.sampling
        if self.random is None:
            return int(logits.argmax())
        scores = np.asarray(logits, dtype=np.float64) / sampling.temperature
        if sampling.top_k is not None and sampling.top_k < scores.size:
            cutoff = np.partition(scores, -sampling.top_k)[-sampling.top_k]  # the k-th highest score
            scores[scores < cutoff] = -np.inf
        if sampling.top_p is not None and sampling.top_p < 1:
            order = np.argsort(-scores, kind="stable")
            probabilities = _softmax(scores[order])
            before = np.cumsum(probabilities) - probabilities  # keep the token that crosses top_p
            scores[order[before >= sampling.top_p]] = -np.inf
        cumulative = np.cumsum(_softmax(scores))
        drawn = np.searchsorted(cumulative, self.random.random() * cumulative[-1], side="right")
        return int(min(drawn, scores.size - 1))


def _softmax(scores: np.ndarray) -> np.ndarray:
    """Probabilities from scores (``-inf``: none), computed from the highest so nothing overflows."""
    exponentials = np.exp(scores - scores.max())
    return exponentials / exponentials.sum()
