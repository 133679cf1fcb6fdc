"""Saved programs shared by the format and runtime tests."""

from __future__ import annotations

from pathlib import Path

import torch
from models import TinyDecoder, decoder_methods

from torchdelegate import EdgeProgramManager, Partitioner, to_edge
from torchdelegate.backends.reference import ReferencePartitioner

PROMPT = torch.tensor([5, 17, 3, 99, 42, 7, 0, 250])
DECODE_TOKENS = (11, 200, 64, 9)


def fresh_decoder() -> TinyDecoder:
    """The same decoder every time: weights from a fixed seed, empty caches."""
    torch.manual_seed(1234)
    return TinyDecoder()


def lowered_decoder(partitioner: Partitioner | None = None) -> EdgeProgramManager:
    return to_edge(decoder_methods(fresh_decoder())).to_backend(partitioner or ReferencePartitioner())


def save_decoder(path: Path, partitioner: Partitioner | None = None) -> Path:
    lowered_decoder(partitioner).save(path)
    return path


def eager_generation() -> list[torch.Tensor]:
    """Eager's logits for the prompt, then for each decode token."""
    model = fresh_decoder()
    with torch.no_grad():
        outputs = [model(PROMPT, torch.arange(len(PROMPT)))]
        for step, token in enumerate(DECODE_TOKENS):
            outputs.append(model(torch.tensor([token]), torch.tensor([len(PROMPT) + step])))
    return outputs


def program_generation(program) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
    """The same sequence of calls on a loaded program."""
    outputs = [program.run("prefill", PROMPT, torch.arange(len(PROMPT)))]
    for step, token in enumerate(DECODE_TOKENS):
        outputs.append(program.run("decode", torch.tensor([token]), torch.tensor([len(PROMPT) + step])))
    return outputs
