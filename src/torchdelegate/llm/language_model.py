"""A program ``llm export`` wrote, as text in and text out: the settings, tokenizer and chat template
the file carries, and the generator over its ``prefill`` and ``decode``.

``llm generate``, ``llm chat`` and ``llm serve`` all read a file through this class, so a prompt
becomes the same tokens and tokens the same text whichever command runs it. Nothing here imports
torch: on a file whose delegates need none, text goes in and out with the runtime alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torchdelegate.errors import CheckpointError
from torchdelegate.llm.assets import SETTINGS, asset_json, chat_template_text, read_tokenizer
from torchdelegate.llm.chat_template import ChatTemplate
from torchdelegate.llm.generation import Generator

if TYPE_CHECKING:
    from torchdelegate.runtime.program import Program

NO_TEMPLATE = "give a prompt, not messages"


class LanguageModel:
    """``program``'s generation settings (``max_cache``, ``stop_tokens``), tokenizer and chat
    template, and a generator over its methods (:meth:`generator`, which makes the sessions: a
    process that only reads and writes text, such as a server's front, never makes them).

    A file without the tokenizer ``llm export`` stores is a ``CheckpointError``."""

    def __init__(self, program: Program) -> None:
        if SETTINGS not in program.asset_names or "tokenizer.json" not in program.asset_names:
            raise CheckpointError(f"{program.path} carries no tokenizer: make it with torchdelegate llm export")
        self.program = program
        self._generator: Generator | None = None
        self._template: ChatTemplate | None = None
        self.settings = asset_json({SETTINGS: program.asset(SETTINGS)}, SETTINGS, {})
        self.max_cache: int = self.settings["max_cache"]
        self.stop_tokens: list[int] = list(self.settings["stop_tokens"])
        try:
            self.tokenizer = read_tokenizer(program.asset("tokenizer.json"), f"{program.path}: its tokenizer.json")
        except ImportError as e:
            raise CheckpointError("generating text needs the tokenizers library: pip install tokenizers") from e

    def generator(self) -> Generator:
        """The generator over the program's ``prefill`` and ``decode``, its sessions made now and
        warmed up (:meth:`Generator.warm_up`), so a first token's time is the prompt's, not the
        sessions'."""
        if self._generator is None:
            self.program.initialize()
            generator = Generator(self.program, stop_tokens=self.stop_tokens, max_positions=self.max_cache)
            generator.warm_up()
            self._generator = generator
        return self._generator

    def encode(self, text: str, special_tokens: bool = True) -> list[int]:
        """``text``'s token ids; ``special_tokens=False``: without those the tokenizer adds (a
        rendered chat template holds its own)."""
        return list(self.tokenizer.encode(text, add_special_tokens=special_tokens).ids)

    def chat_prompt(self, messages: list[dict[str, str]], instead: str = NO_TEMPLATE) -> list[int]:
        """The token ids of ``messages`` rendered by the checkpoint's chat template (``instead``: see
        :meth:`chat_template`)."""
        return self.encode(self.chat_template(instead).render(messages), special_tokens=False)

    def decode(self, tokens: list[int]) -> str:
        return str(self.tokenizer.decode(tokens, skip_special_tokens=True))

    def refuse_unfitting(self, prompt: list[int]) -> None:
        """A ``ValueError`` when ``prompt`` leaves the cache no room for a new token."""
        if len(prompt) >= self.max_cache:
            raise ValueError(
                f"the prompt is {len(prompt)} tokens and the program's cache holds {self.max_cache}; "
                "shorten it, or export with a larger --max-cache"
            )

    def chat_template(self, instead: str = NO_TEMPLATE) -> ChatTemplate:
        """The checkpoint's chat template; a ``CheckpointError`` ending with ``instead`` (what to do
        without one) if its checkpoint had none."""
        if self._template is not None:
            return self._template
        program, names = self.program, self.program.asset_names
        wanted: tuple[str, ...] = ("chat_template.jinja", "tokenizer_config.json")
        assets = {name: program.asset(name) for name in wanted if name in names}
        template = chat_template_text(assets)
        if template is None:
            raise CheckpointError(f"{program.path} carries no chat template (its checkpoint had none): {instead}")
        config = asset_json(assets, "tokenizer_config.json", {})
        self._template = ChatTemplate(program.path, template, config)
        return self._template


class TextStream:
    """The text of tokens as they come: each :meth:`add` returns what the decoded text gained,
    holding back a character still being spelled by the tokens to come.

    Only a window of the last tokens is decoded each time, from the token before the last text
    given out (decoding from there keeps the space a tokenizer drops at the start of a text), so a
    long reply costs each token the same."""

    def __init__(self, model: LanguageModel) -> None:
        self.model = model
        self.tokens: list[int] = []
        self.start = 0  # the window's first token
        self.given = 0  # the tokens whose text is given out

    def add(self, token: int) -> str:
        self.tokens.append(token)
        before = self.model.decode(self.tokens[self.start : self.given])
        text = self.model.decode(self.tokens[self.start :])
        if len(text) <= len(before) or text.endswith("\ufffd"):
            return ""
        self.start, self.given = self.given, len(self.tokens)
        return text[len(before) :]

    def rest(self) -> str:
        """What is left once no token follows (an unfinished character included)."""
        before = self.model.decode(self.tokens[self.start : self.given])
        text = self.model.decode(self.tokens[self.start :])
        self.start = self.given = len(self.tokens)
        return text[len(before) :]


class HeldTokens:
    """The tokens a program's KV cache holds at positions 0, 1, ... after the generations so far: the
    start of the next prompt that need not be read again (a conversation's earlier turns)."""

    def __init__(self) -> None:
        self.tokens: list[int] = []

    def reusable(self, prompt: list[int]) -> int:
        """How many of ``prompt``'s first tokens the cache holds, leaving at least one to read."""
        return min(common_prefix(self.tokens, prompt), len(prompt) - 1)

    def after(self, prompt: list[int], generated: list[int]) -> None:
        """The cache once ``prompt`` is read and ``generated`` chosen: all but the last, never read."""
        self.tokens = prompt + generated[:-1]

    def keep(self, count: int) -> None:
        """Only the first ``count`` tokens are sure (a generation that may fail is under way)."""
        del self.tokens[count:]


def common_prefix(first: list[int], second: list[int]) -> int:
    """How many leading tokens ``first`` and ``second`` share."""
    length = min(len(first), len(second))
    return next((i for i in range(length) if first[i] != second[i]), length)
