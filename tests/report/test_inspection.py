"""Looking at lowered programs: their delegates, what was left undelegated, a summary and a printout."""

from __future__ import annotations

import copy
import io
import operator

import pytest
import torch
from backends_for_tests import FunctionPartitioner, OpSetPartitioner, TorchExportBackend
from models import LINEAR_OPS, Cond, TwoLinears, WhileLoop, aten, decoder_methods, export
from programs import fresh_decoder

import torchdelegate as td
from torchdelegate import (
    LoweredBackendModule,
    call_delegate,
    delegate_calls,
    delegation_info,
    format_delegated_graph,
    lowered_module_of,
    lowered_modules,
    lowered_submodules,
    print_delegated_graph,
    to_backend,
    undelegated_nodes,
)
from torchdelegate.backends.reference import ReferencePartitioner


def _two_linears() -> torch.export.ExportedProgram:
    """TwoLinears with its linear ops delegated: two delegates, sigmoid left between them."""
    return to_backend(export(TwoLinears(), torch.randn(2, 4)), OpSetPartitioner(LINEAR_OPS))


def _cond_in_branches() -> torch.export.ExportedProgram:
    """Cond with one delegate in each branch: the cond itself stays in the graph."""
    inner = {aten.mm.default, aten.relu.default, aten.sub.Tensor, aten.sigmoid.default}
    return to_backend(
        export(Cond(), torch.randn(3, 4)),
        FunctionPartitioner(lambda n: "t" if n.op == "call_function" and n.target in inner else None),
    )


def test_the_delegates_of_a_program_in_graph_order_with_their_calls_and_payloads() -> None:
    lowered = _two_linears()
    found = lowered_submodules(lowered)
    assert [(s.method, s.graph, s.name) for s in found] == [
        (None, "", "lowered_module_0"),
        (None, "", "lowered_module_1"),
    ]
    for submodule in found:
        assert submodule.call.target is call_delegate and lowered_module_of(submodule.call) is submodule.module
        assert submodule.processed_bytes == submodule.module.processed_bytes and submodule.processed_bytes
        assert submodule.module is getattr(lowered.graph_module, submodule.name)
    assert lowered_modules(lowered) == [s.module for s in found]
    assert lowered_submodules(lowered.graph_module) == found


def test_delegates_inside_control_flow_come_at_their_op() -> None:
    lowered = _cond_in_branches()
    found = lowered_submodules(lowered)
    assert [s.qualified_name for s in found] == ["true_graph_0.lowered_module_0", "false_graph_0.lowered_module_0"]
    assert found[0].module is lowered.graph_module.true_graph_0.lowered_module_0
    assert lowered_submodules(lowered, sub_graphs=False) == []
    assert delegate_calls(lowered) == [] and delegate_calls(lowered.graph_module.true_graph_0) == [found[0].call]


def test_a_while_loop_bodys_delegate_is_found() -> None:
    model = WhileLoop()
    x, n = torch.randn(3, 4), torch.zeros(3)
    program = export(model, x, n, dynamic_shapes=(None, {0: torch.export.Dim("steps", min=1, max=16)}))
    ops = {aten.mul.Tensor, aten.sin.default}
    lowered = to_backend(program, FunctionPartitioner(lambda n: "t" if n.target in ops else None))
    (found,) = lowered_submodules(lowered)
    assert found.graph == "while_loop_body_graph_0"
    assert [n.name for n in undelegated_nodes(lowered)] == [
        "full",
        "while_loop",
        "sym_size_int_1",
        "lt",
        "add_2",
        "add_3",
    ]


def test_every_method_of_a_manager_in_its_order() -> None:
    lowered = td.to_edge(decoder_methods(fresh_decoder())).to_backend(ReferencePartitioner())
    found = lowered_submodules(lowered)
    assert [s.method for s in found] == ["prefill", "decode"]
    assert [s.module for s in found] == [lowered.delegates()["prefill"][0], lowered.delegates()["decode"][0]]
    assert undelegated_nodes(lowered) == []


def test_the_nodes_left_undelegated() -> None:
    lowered = _two_linears()
    assert [n.name for n in undelegated_nodes(lowered)] == ["sigmoid"]
    in_branches = _cond_in_branches()
    left = undelegated_nodes(in_branches)
    assert [n.name for n in left] == ["sum_1", "gt", "cond", "add", "mul", "add"]
    assert torch.ops.higher_order.cond in [n.target for n in left]
    assert all(n.target is not call_delegate and n.target is not operator.getitem for n in left)
    unlowered = export(TwoLinears(), torch.randn(2, 4))
    assert undelegated_nodes(unlowered) == [n for n in unlowered.graph.nodes if n.op == "call_function"]


def test_the_helpers_say_what_they_take() -> None:
    lowered = _two_linears()
    with pytest.raises(
        ValueError, match=r"node 'sigmoid' \(call_function aten.sigmoid.default\) is not a delegate call"
    ):
        lowered_module_of(next(n for n in lowered.graph.nodes if n.name == "sigmoid"))
    with pytest.raises(
        TypeError,
        match=r"lowered_submodules takes an ExportedProgram, a GraphModule or an EdgeProgramManager, got list",
    ):
        lowered_submodules([lowered])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"delegate_calls takes a Graph, a GraphModule or an ExportedProgram, got str"):
        delegate_calls("graph")  # type: ignore[arg-type]


def test_a_loaded_program_is_pointed_to_its_delegate_table(tmp_path) -> None:  # type: ignore[no-untyped-def]
    td.to_edge(export(TwoLinears(), torch.randn(2, 4))).to_backend(ReferencePartitioner()).save(tmp_path / "m.tdp")
    with td.load(tmp_path / "m.tdp") as program:
        with pytest.raises(
            TypeError,
            match=r"got Program; a loaded Program has no lowered modules: its delegates are Program.delegates",
        ):
            undelegated_nodes(program)  # type: ignore[arg-type]


def test_delegation_info_counts_computations_per_operator() -> None:
    info = delegation_info(_two_linears())
    assert (info.delegates, info.delegated_nodes, info.undelegated_nodes) == (2, 6, 1)
    assert info.by_operator["aten.sigmoid.default"] == td.OperatorDelegation("aten.sigmoid.default", 0, 1)
    assert info.by_operator["aten.addmm.default"].delegated == 2
    assert list(info.by_operator) == sorted(info.by_operator)
    assert info.summary() == ("delegates: 2\ncomputations delegated: 6 of 7 (85.7%)\ncomputations not delegated: 1\n")
    table = info.operator_table().splitlines()
    assert table[0].split() == ["operator", "delegated", "not", "delegated"]
    assert table[-1].split() == ["total", "6", "1"]
    assert "aten.sigmoid.default" in info.operator_table()


def test_delegation_info_counts_inside_control_flow() -> None:
    info = delegation_info(_cond_in_branches())
    assert info.delegates == 2
    assert info.by_operator["cond"].not_delegated == 1
    assert info.by_operator["aten.mm.default"].delegated == 1
    assert info.summary().splitlines()[1] == "computations delegated: 4 of 10 (40.0%)"


def test_the_printed_graph_shows_delegates_with_their_sub_programs_and_sub_graphs() -> None:
    text = format_delegated_graph(_two_linears())
    assert text.splitlines()[0] == "x = input"
    assert "call_delegate = call_delegate(lowered_module_0, x)" in text
    assert (
        f"    lowered_module_0: backend {TorchExportBackend.backend_id!r}, partition 'tag0' of method 'forward'" in text
    )
    assert "        p_l1_weight = parameter 'l1.weight'" in text
    assert "sigmoid = aten.sigmoid.default(relu)" in text
    branches = format_delegated_graph(_cond_in_branches())
    assert "    true_graph_0:\n" in branches and "    false_graph_0:\n" in branches
    assert "            lowered_module_0: backend" in branches
    out = io.StringIO()
    print_delegated_graph(_two_linears(), file=out)
    assert out.getvalue() == text


def test_a_managers_printout_has_a_section_per_method() -> None:
    lowered = td.to_edge(decoder_methods(fresh_decoder())).to_backend(ReferencePartitioner())
    text = format_delegated_graph(lowered)
    assert text.startswith("method 'prefill':\n    b_k_cache = buffer 'k_cache'\n")
    assert "\nmethod 'decode':\n" in text
    assert text == format_delegated_graph(
        td.to_edge(decoder_methods(fresh_decoder())).to_backend(ReferencePartitioner())
    )


def test_the_same_lowering_twice_gives_the_same_answers() -> None:
    first, second = _cond_in_branches(), _cond_in_branches()
    assert format_delegated_graph(first) == format_delegated_graph(second)
    assert [n.name for n in undelegated_nodes(first)] == [n.name for n in undelegated_nodes(second)]
    assert isinstance(lowered_modules(first)[0], LoweredBackendModule)


def test_a_module_called_twice_is_one_module_with_two_calls() -> None:
    lowered = _two_linears()
    gm = torch.fx.GraphModule(lowered.graph_module, copy.deepcopy(lowered.graph))  # shares the modules
    first = next(n for n in gm.graph.nodes if n.target is call_delegate)
    with gm.graph.inserting_after(first):
        gm.graph.call_function(call_delegate, first.args)
    calls = lowered_submodules(gm)
    assert [s.name for s in calls] == ["lowered_module_0", "lowered_module_0", "lowered_module_1"]
    assert lowered_modules(gm) == [calls[0].module, calls[2].module]
