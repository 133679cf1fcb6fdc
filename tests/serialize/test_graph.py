"""The graph form (torch.export JSON): a graph read and written again is the same document, so a
unit rebuilt on a worker compiles to the bytes it compiles to here."""

from __future__ import annotations

import torch

import torchdelegate as td
from torchdelegate.exported.programs import state_value
from torchdelegate.serialize.graph import program_from_json, program_to_json


class Views(torch.nn.Module):
    """Views at offsets into one projection, as attention splits q, k and v."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(8, 24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(2, 4, 3, 8).unbind(2)
        return (q @ k.transpose(-1, -2)).softmax(-1) @ v + v[:, 1:2]


def test_a_graph_read_and_written_again_is_the_same_document() -> None:
    program = td.to_edge(torch.export.export(Views(), (torch.randn(2, 4, 8),))).exported_program()
    document = program_to_json(program, "test", debug_info=True)
    state = {
        spec.target: state_value(program, spec.target)
        for spec in program.graph_signature.input_specs
        if spec.target is not None
    }
    again = program_to_json(program_from_json(document, state, "test"), "test", debug_info=True)
    assert again == document
