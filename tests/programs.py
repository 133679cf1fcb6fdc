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


def snapshot(program: torch.export.ExportedProgram) -> tuple:
    """What a lowering must leave as it was: code, signature, tensors (by identity and value), node metadata."""
    tensors = {**program.state_dict, **program.constants}
    return (
        program.graph_module.code,
        str(program.graph_signature),
        tensors,
        {k: v.clone() for k, v in tensors.items()},
        [dict(n.meta) for n in program.graph.nodes],
    )


def assert_unchanged(program: torch.export.ExportedProgram, before: tuple) -> None:
    code, signature, tensors, values, metas = before
    assert program.graph_module.code == code, "lowering changed the input program's code"
    assert str(program.graph_signature) == signature, "lowering changed the input program's signature"
    now = {**program.state_dict, **program.constants}
    assert now.keys() == tensors.keys()
    for key, tensor in tensors.items():
        assert now[key] is tensor and torch.equal(tensor, values[key]), f"lowering changed {key}"
    assert [dict(n.meta) for n in program.graph.nodes] == metas
