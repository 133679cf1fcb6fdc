"""The partition report as data: reasons per category, partitions' figures, coverage, and the saved copy."""

from __future__ import annotations

import pytest
import torch
from backends_for_tests import TorchExportBackend
from models import TwoLinears, export

import torchdelegate as td
from torchdelegate import CapabilityPartitioner, DelegationSpec
from torchdelegate.partition.capability import CLAIMED_EARLIER, CYCLE, TOO_SMALL
from torchdelegate.report import LoweringReport, plan_report, render_text

aten = torch.ops.aten
REFERENCE = DelegationSpec("reference")
SECOND = DelegationSpec(TorchExportBackend.backend_id)


class _OneLayerTwice(torch.nn.Module):
    """One linear layer on both sides of a sigmoid: two partitions read the same weight."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(torch.sigmoid(self.layer(x)))


def test_a_weight_two_partitions_read_is_carried_by_both_as_lowering_carries_it() -> None:
    edge = td.to_edge(export(_OneLayerTwice(), torch.randn(2, 4)))
    support = {aten.permute.default, aten.addmm.default}
    lowered = edge.to_backend(CapabilityPartitioner(support, REFERENCE))
    report = lowered.report
    first, second = report.methods["forward"].partitions
    assert first.weight_bytes == second.weight_bytes == (4 * 4 + 4) * 4
    assert first.inputs == ["x"] and second.inputs == ["sigmoid"]
    for row, delegate in zip((first, second), lowered.delegates()["forward"], strict=True):
        carried = delegate.original_module.graph_signature.parameters
        assert sorted(carried) == ["layer.bias", "layer.weight"], row.tag


def test_partitions_carry_their_nodes_ops_boundary_weights_and_flops() -> None:
    model, x = TwoLinears(), torch.randn(2, 4)
    edge = td.to_edge(export(model, x))
    support = {aten.permute.default, aten.addmm.default, aten.relu.default, aten.add.Tensor}
    lowered = edge.to_backend(CapabilityPartitioner(support, REFERENCE))
    report = lowered.report
    method = report.methods["forward"]
    first, second = method.partitions
    assert (first.tag, first.nodes, first.ops) == ("reference_0", 3, {"permute": 1, "addmm": 1, "relu": 1})
    assert first.inputs == ["x"] and first.outputs == ["relu"]
    assert first.weight_bytes == (4 * 4 + 4) * 4  # l1's weight and bias move into the delegate
    assert first.flops == 2 * 2 * 4 * 4  # torch's count for a [2, 4] x [4, 4] product
    assert second.inputs == ["sigmoid", "relu"] and second.outputs == ["add"]
    assert first.blob_bytes == len(lowered.delegates()["forward"][0].processed_bytes) > 0
    assert first.kept_apart == {"reference_1": "sigmoid"}
    assert (method.delegated_nodes, len(method.nodes)) == (6, 7)
    assert method.delegated_flops == method.total_flops == 2 * 64
    assert method.not_delegated() == {
        ("aten.sigmoid.default", "reference: unsupported: aten.sigmoid.default"): ["sigmoid"]
    }


def test_flops_of_a_dynamic_dimension_are_counted_at_the_example_size_and_the_dimension_stays_dynamic() -> None:
    """Counting reads no symbolic size as an int: that would make the caller's dimension static."""
    batch = torch.export.Dim("batch", min=2, max=64)
    program = torch.export.export(TwoLinears(), (torch.randn(3, 4),), dynamic_shapes=({0: batch},))
    edge = td.to_edge(program)
    support = {aten.permute.default, aten.addmm.default, aten.relu.default, aten.add.Tensor, aten.sigmoid.default}
    lowered = edge.to_backend(CapabilityPartitioner(support, REFERENCE))
    report = lowered.report
    assert report.methods["forward"].total_flops == 2 * 2 * 3 * 4 * 4
    for kept in (program, edge.exported_program(), lowered.exported_program()):
        (x,) = [n for n in kept.graph.nodes if n.op == "placeholder" and n.name == "x"]
        assert not isinstance(x.meta["val"].shape[0], int), kept
    assert lowered.exported_program().module()(torch.randn(7, 4)).shape == (7, 4)


def test_every_reason_reaches_the_report_and_its_text() -> None:
    class Diamond(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            a = (x + 1).cos()
            return a * torch.sigmoid(a), x.exp()

    edge = td.to_edge(export(Diamond(), torch.randn(3)))

    def first(node: torch.fx.Node) -> bool | str:
        if node.target is aten.sigmoid.default:
            return "sigmoid on float32[3] is not fused"
        return node.target is not aten.exp.default

    second = {aten.exp.default, aten.cos.default}
    partitioner = CapabilityPartitioner([(first, REFERENCE), (second, SECOND)], min_partition_size=2)
    report = plan_report(edge, partitioner)
    rows = {row.name: row for row in report.methods["forward"].nodes}
    assert rows["sigmoid"].reasons["reference"] == "sigmoid on float32[3] is not fused"
    assert rows["sigmoid"].reasons[SECOND.backend_id] == "unsupported: aten.sigmoid.default"
    assert rows["mul"].reasons["reference"].startswith(TOO_SMALL) and CYCLE in rows["mul"].reasons["reference"]
    assert rows["exp"].reasons["reference"] == "unsupported: aten.exp.default"
    assert rows["exp"].reasons[SECOND.backend_id].startswith(TOO_SMALL)
    assert rows["cos"].tag == "reference_0" and rows["cos"].reasons == {SECOND.backend_id: CLAIMED_EARLIER}
    text = render_text(report)
    assert "method 'forward': 2 of 5 computations delegated (40.0%)" in text
    assert "aten.sigmoid.default x1 (sigmoid): reference: sigmoid on float32[3] is not fused" in text


def test_the_report_is_saved_with_the_program_and_read_back(tmp_path: pytest.TempPathFactory) -> None:
    model, x = TwoLinears(), torch.randn(2, 4)
    edge = td.to_edge(export(model, x))
    lowered = edge.to_backend(CapabilityPartitioner(lambda node: True, REFERENCE))
    report = lowered.report
    path = tmp_path / "model.tdp"  # type: ignore[operator]
    lowered.save(path, report=report.to_json())
    with td.load(path) as program:
        assert program.report is not None
        assert LoweringReport.from_json(program.report) == report
        torch.testing.assert_close(program.run("forward", x), model(x))
    assert report.state_bytes == {"forward": 2 * (16 + 4) * 4} and report.unique_state_bytes == 160


def test_a_partitions_ops_stay_most_frequent_first_when_read_back(tmp_path: pytest.TempPathFactory) -> None:
    edge = td.to_edge(export(_OneLayerTwice(), torch.randn(2, 4)))
    lowered = edge.to_backend(CapabilityPartitioner(lambda node: True, REFERENCE))
    report = lowered.report
    path = tmp_path / "model.tdp"  # type: ignore[operator]
    lowered.save(path, report=report.to_json())
    with td.load(path) as program:
        assert program.report is not None
        (read,) = LoweringReport.from_json(program.report).methods["forward"].partitions
    (made,) = report.methods["forward"].partitions
    assert list(read.ops.items()) == list(made.ops.items())
    assert list(made.ops.items()) == [("addmm", 2), ("permute", 2), ("sigmoid", 1)]


def test_a_report_needs_one_capability_partitioner_and_says_how_to_join_several() -> None:
    from torchdelegate.backends.reference import ReferencePartitioner

    edge = td.to_edge(export(TwoLinears(), torch.randn(2, 4)))
    with pytest.raises(TypeError, match=r"needs one CapabilityPartitioner, got list; .*\.backends"):
        plan_report(edge, [ReferencePartitioner()])  # type: ignore[arg-type]
    joined = CapabilityPartitioner([*ReferencePartitioner().backends])
    assert plan_report(edge, joined).methods["forward"].delegated_nodes == 7


def test_two_methods_holding_one_weight_count_it_once() -> None:
    model = TwoLinears()
    programs = {"a": export(model, torch.randn(2, 4)), "b": export(model, torch.randn(3, 4))}
    report = plan_report(td.to_edge(programs), CapabilityPartitioner(lambda node: True, REFERENCE))
    assert report.state_bytes == {"a": 160, "b": 160} and report.unique_state_bytes == 160


def test_tied_weights_count_once() -> None:
    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(16, 4)
            self.head = torch.nn.Linear(4, 16, bias=False)
            self.head.weight = self.embed.weight  # as language models tie their input and output embeddings

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.head(self.embed(ids))

    report = plan_report(
        td.to_edge(export(Tied(), torch.tensor([1, 2]))), CapabilityPartitioner(lambda n: True, REFERENCE)
    )
    assert report.state_bytes == {"forward": 16 * 4 * 4} and report.unique_state_bytes == 16 * 4 * 4


@pytest.mark.parametrize("bad", [{}, {"version": 2}, {"version": 1, "backends": [], "methods": [{"method": "f"}]}])
def test_a_report_that_is_not_one_is_refused(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="report"):
        LoweringReport.from_json(bad)


class _Shared(torch.nn.Module):
    """A module called twice, and a Sequential: two calls of one module are two groups."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.seq = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.seq(self.lin(self.lin(x)))


@pytest.mark.parametrize("strict", [False, True])
def test_each_computation_carries_the_module_calls_it_was_made_in(strict: bool) -> None:
    program = torch.export.export(_Shared(), (torch.randn(2, 4),), strict=strict)
    report = plan_report(td.to_edge(program), CapabilityPartitioner({aten.addmm.default}, REFERENCE))
    method = report.methods["forward"]
    calls = {row.name: row.modules for row in method.nodes}
    assert calls["addmm"] == ["lin"] and calls["addmm_1"] == ["lin@1"]
    assert calls["addmm_2"] == ["seq", "seq.0"] and calls["relu"] == ["seq", "seq.1"]
    assert method.module_types["seq"] == "torch.nn.modules.container.Sequential"
    assert method.module_types["lin@1"] == "torch.nn.modules.linear.Linear"
    read = LoweringReport.from_json(report.to_json()).methods["forward"]
    assert read == method
    old = report.to_json()  # a report saved before module calls were kept still reads
    for row in old["methods"][0]["nodes"]:
        del row["modules"]
    del old["methods"][0]["module_types"]
    assert all(row.modules == [] for row in LoweringReport.from_json(old).methods["forward"].nodes)


def test_what_a_method_returns_is_named_through_tuple_items() -> None:
    class MaxAndIndex(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return torch.max(x, dim=1)

    report = plan_report(td.to_edge(export(MaxAndIndex(), torch.randn(2, 4))), CapabilityPartitioner(set(), REFERENCE))
    method = report.methods["forward"]
    assert method.user_outputs == [method.nodes[-1].name] == ["max_1"]
