"""Linear layers regained from their decomposition, for backends whose fusions look for them."""

from __future__ import annotations

import torch
from models import TwoLinears, attention_block, export

import torchdelegate as td
from torchdelegate.backends.linear_recomposition import recompose_linear

aten = torch.ops.aten


def _targets(program: torch.export.ExportedProgram) -> list[object]:
    return [n.target for n in program.graph.nodes if n.op == "call_function"]


def _edge(model: torch.nn.Module, x: torch.Tensor) -> torch.export.ExportedProgram:
    return td.to_edge(export(model, x)).exported_program()


def test_each_decomposed_linear_is_one_linear_again_and_computes_the_same() -> None:
    x = torch.randn(2, 3, 32)
    program = _edge(attention_block(), x)
    assert aten.addmm.default in _targets(program)
    recomposed = recompose_linear(program)
    targets = _targets(recomposed)
    assert targets.count(aten.linear.default) == 4
    assert aten.addmm.default not in targets
    torch.testing.assert_close(recomposed.module()(x), program.module()(x))


def test_a_linear_that_is_a_program_output_keeps_its_place_in_the_signature() -> None:
    x = torch.randn(2, 4)
    program = _edge(TwoLinears(), x)
    recomposed = recompose_linear(program)
    assert recomposed.graph_signature.user_outputs == program.graph_signature.user_outputs
    assert _targets(recomposed).count(aten.linear.default) == 2
    torch.testing.assert_close(recomposed.module()(x), program.module()(x))


def test_the_input_program_is_unchanged_and_its_weights_are_shared() -> None:
    program = _edge(attention_block(), torch.randn(1, 1, 32))
    code, signature = program.graph_module.code, str(program.graph_signature)
    recomposed = recompose_linear(program)
    assert program.graph_module.code == code and str(program.graph_signature) == signature
    for name, tensor in program.state_dict.items():
        assert recomposed.state_dict[name].data_ptr() == tensor.data_ptr()


def test_a_program_without_linear_layers_comes_back_as_it_is() -> None:
    class Elementwise(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.sin() + 1

    program = _edge(Elementwise(), torch.randn(3))
    assert recompose_linear(program) is program


def test_any_product_with_a_transposed_matrix_is_a_linear_even_between_inputs() -> None:
    class Product(torch.nn.Module):
        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return torch.mm(a, b.t()) * 2

    a, b = torch.randn(3, 5), torch.randn(4, 5)
    program = td.to_edge(export(Product(), a, b)).exported_program()
    recomposed = recompose_linear(program)
    assert _targets(recomposed).count(aten.linear.default) == 1
    torch.testing.assert_close(recomposed.module()(a, b), Product()(a, b))
