"""Debug handles: every computation numbered at to_edge, the same numbers for the same program."""

from __future__ import annotations

import operator

import torch
from models import TwoLinears, aten, export

import torchdelegate as td


def _handles(program: torch.export.ExportedProgram) -> list[tuple[str, object]]:
    return [(n.name, n.meta.get("debug_handle")) for n in program.graph.nodes if n.op == "call_function"]


def test_to_edge_numbers_each_computation_from_one_in_graph_order_and_the_same_way_every_time() -> None:
    first = td.to_edge(export(TwoLinears(), torch.randn(2, 4))).exported_program()
    numbered = _handles(first)
    assert [handle for _, handle in numbered] == list(range(1, len(numbered) + 1))
    again = td.to_edge(export(TwoLinears(), torch.randn(2, 4))).exported_program()
    assert _handles(again) == numbered
    assert all("debug_handle" not in n.meta for n in first.graph.nodes if n.op != "call_function")


def test_nodes_a_pass_adds_get_numbers_after_the_others_and_the_others_keep_theirs() -> None:
    edge = td.to_edge(export(TwoLinears(), torch.randn(2, 4)))
    before = dict(_handles(edge.exported_program()))

    def doubled_sigmoid(program: torch.export.ExportedProgram) -> None:
        graph = program.graph
        for node in list(graph.nodes):
            if node.target is aten.sigmoid.default:
                with graph.inserting_after(node):
                    doubled = graph.call_function(aten.mul.Tensor, (node, 2.0))
                node.replace_all_uses_with(doubled)
                doubled.args = (node, 2.0)
                doubled.meta["val"] = node.meta["val"]

    after = dict(_handles(edge.transform([doubled_sigmoid]).exported_program()))
    assert {name: handle for name, handle in after.items() if name in before} == before
    (added,) = set(after) - set(before)
    assert after[added] == max(before.values()) + 1  # type: ignore[type-var, operator]
    assert dict(_handles(edge.exported_program())) == before  # the manager's own program is unchanged


class Branching(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cond(x.sum() > 0, lambda x: x.sin() + 1, lambda x: x.cos() * 2, (x,))


def test_control_flow_sub_graphs_are_numbered_after_the_graph_that_holds_them() -> None:
    program = td.to_edge(export(Branching(), torch.randn(3))).exported_program()
    top = [
        n.meta["debug_handle"]
        for n in program.graph.nodes
        if n.op == "call_function" and n.target is not operator.getitem
    ]
    inner = [
        n.meta.get("debug_handle")
        for name, module in sorted(program.graph_module.named_modules())
        if name and isinstance(module, torch.fx.GraphModule)
        for n in module.graph.nodes
        if n.op == "call_function"
    ]
    assert top == list(range(1, len(top) + 1))
    assert inner == list(range(len(top) + 1, len(top) + len(inner) + 1))


class Normed(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x).relu()


def test_an_item_of_a_computations_tuple_shares_that_computations_number() -> None:
    program = td.to_edge(export(Normed(), torch.randn(2, 4))).exported_program()
    items = [n for n in program.graph.nodes if n.target is operator.getitem]
    assert items and all(n.meta["debug_handle"] == n.args[0].meta["debug_handle"] for n in items)
    own = [n.meta["debug_handle"] for n in program.graph.nodes if n.op == "call_function" and n not in items]
    assert own == list(range(1, len(own) + 1))
