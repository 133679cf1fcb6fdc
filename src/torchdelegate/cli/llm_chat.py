"""``torchdelegate llm chat FILE``: a conversation at the terminal (or from piped lines), held in the
file's KV cache, its earliest exchanges forgotten as it outgrows it."""

from __future__ import annotations

import argparse
import sys
from typing import Any, TextIO

from torchdelegate.cli.command import EXIT_OK, CommandError, loaded
from torchdelegate.cli.generated_text import WITHOUT_CHAT, TextOut, language_model, read_as_text, sampling_of


def llm_chat_command(args: argparse.Namespace, out: TextIO) -> int:
    """Read a user's messages line by line (a terminal, or any stdin), answer each in turn.

    The conversation so far stays in the KV cache: each turn reads only the tokens the cache does
    not hold yet. When the conversation outgrows the cache, the earlier turns are dropped."""
    sampling = sampling_of(args)
    interactive = sys.stdin.isatty()
    with loaded(args.file, args.external_data, args.trust, args.backend_options) as program, read_as_text():
        model = language_model(program)
        conversation = _Conversation(model, args.system)
        reply_tokens = args.max_new_tokens or _chat_reply_tokens(model.max_cache)
        print(
            f"chatting with {args.file.name} ({model.max_cache} positions of context, replies of at most "
            f"{reply_tokens} tokens); /reset starts over, /exit or end of input ends",
            file=out,
        )
        while (message := _next_message(interactive, out)) is not None:
            if message == "/exit":
                break
            if message == "/reset":
                conversation.reset()
                print("(a new conversation)", file=out)
            elif message:
                try:
                    generation = conversation.reply(message, reply_tokens, sampling, out)
                except (CommandError, ValueError) as error:  # this message is refused; the conversation goes on
                    print(f"torchdelegate: error: {error}", file=sys.stderr)
                    continue
                stats = generation.stats
                ids = f"; token ids: {generation.tokens}" if args.ids else ""
                cut = "; cut short: the cache is full" if generation.finish == "cache full" else ""
                print(
                    f"\n({stats.new_tokens} tokens{cut}, first after {stats.time_to_first_token * 1e3:.0f} ms, "
                    f"{stats.decode_tokens_per_second:.1f} tokens/s{ids})",
                    file=out,
                )
    return EXIT_OK


def _next_message(interactive: bool, out: TextIO) -> str | None:
    """The user's next line, stripped; None at the end of input."""
    if interactive:
        try:
            return input("> ").strip()
        except EOFError:
            print("", file=out)
            return None
    line = sys.stdin.readline()
    if not line:
        return None
    print(f"> {line.strip()}", file=out)  # a transcript of piped input reads as the terminal's does
    return line.strip()


def _chat_reply_tokens(max_cache: int) -> int:
    """A reply's default length: a quarter of the cache (at most 256), so that a conversation holds
    several turns before its earliest are forgotten."""
    return max(1, min(256, max_cache // 4))


class _Conversation:
    """The messages so far, and the tokens the KV cache holds at positions 0, 1, ..."""

    def __init__(self, model: Any, system: str | None) -> None:
        self.model, self.generator = model, model.generator()
        model.chat_template(WITHOUT_CHAT)  # no template: refused before the first message
        self.opening = [{"role": "system", "content": system}] if system else []
        self.reset()

    def reset(self) -> None:
        from torchdelegate.llm.language_model import HeldTokens

        self.messages = list(self.opening)
        self.held = HeldTokens()

    def reply(self, message: str, max_new_tokens: int, sampling: Any, out: TextIO) -> Any:
        """Answer ``message``, streaming the reply to ``out``; a message that does not fit the cache even
        alone is refused (ValueError) and leaves the conversation as it was."""
        turn = {"role": "user", "content": message}
        self.model.refuse_unfitting(self.model.chat_prompt([*self.opening, turn]))
        prompt = self._fitting(turn, max_new_tokens, out)
        self.messages.append(turn)
        stream = TextOut(self.model, out)
        cached = self.held.reusable(prompt)
        generation = self.generator.generate(prompt, max_new_tokens, sampling, on_token=stream, cached=cached)
        self.held.after(prompt, generation.tokens)
        self.messages.append({"role": "assistant", "content": self.model.decode(generation.tokens)})
        return generation

    def _fitting(self, turn: dict[str, str], max_new_tokens: int, out: TextIO) -> list[int]:
        """The conversation's prompt with ``turn``, its earliest exchanges (a message and its reply)
        forgotten, oldest first, until a reply of ``max_new_tokens`` fits the cache after it, or none is
        left to forget. How many were forgotten is said on ``out``."""
        past = self.messages[len(self.opening) :]
        prompt = self.model.chat_prompt([*self.opening, *past, turn])
        forgotten = 0
        while past and len(prompt) + max_new_tokens > self.model.max_cache:
            past, forgotten = past[2:], forgotten + 1
            prompt = self.model.chat_prompt([*self.opening, *past, turn])
        if forgotten:
            exchanges = "exchange is" if forgotten == 1 else f"{forgotten} exchanges are"
            print(f"(the conversation outgrew the cache: its earliest {exchanges} forgotten)", file=out)
            self.messages = [*self.opening, *past]
        return prompt
