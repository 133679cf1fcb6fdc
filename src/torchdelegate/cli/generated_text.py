"""What the commands that generate text from a file share (``llm generate``, ``llm chat``,
``llm serve``): the sampling the flags ask for, the file read as a language model, its text refusals
as one-line command errors, and tokens printed as text as they come."""

from __future__ import annotations

import argparse
import contextlib
from typing import Any, TextIO

from torchdelegate.cli.command import CommandError, UsageError


def sampling_of(args: argparse.Namespace) -> Any:
    from torchdelegate.llm import Sampling

    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens {args.max_new_tokens}: give 1 or more")
    try:
        return Sampling(args.temperature, args.top_k, args.top_p, args.seed)
    except ValueError as error:
        raise UsageError(str(error)) from error


WITHOUT_CHAT = "use llm generate without --chat"


def language_model(program: Any) -> Any:
    from torchdelegate.llm.language_model import LanguageModel

    return LanguageModel(program)


@contextlib.contextmanager
def read_as_text() -> Any:
    """What the file carries (tokenizer, chat template) and the prompt's fit, refused as a command error."""
    from torchdelegate.errors import CheckpointError

    try:
        yield
    except (CheckpointError, ValueError) as error:
        raise CommandError(str(error)) from error


class TextOut:
    """Prints each token's text as it comes."""

    def __init__(self, model: Any, out: TextIO) -> None:
        from torchdelegate.llm.language_model import TextStream

        self.text, self.out = TextStream(model), out

    def __call__(self, token: int) -> None:
        gained = self.text.add(token)
        if gained:
            self.out.write(gained)
            self.out.flush()
