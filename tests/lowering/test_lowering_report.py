"""The report lowering emits: every form of to_backend carries it, the partitioner runs once, save keeps it."""

from __future__ import annotations

import gc
import json
import weakref
from pathlib import Path

import pytest
import torch
from backends_for_tests import OpSetPartitioner, TorchExportBackend
from models import LINEAR_OPS, TwoLinears, export

import torchdelegate as td
from torchdelegate import CapabilityPartitioner, DelegationSpec
from torchdelegate.backends.reference import ReferencePartitioner
from torchdelegate.cli import main
from torchdelegate.report import plan_report, render_text

aten = torch.ops.aten
REFERENCE = DelegationSpec("reference")


class _CountingPlans(CapabilityPartitioner):
    """A capability partitioner that counts how often it plans."""

    plans = 0

    def plan(self, exported_program: torch.export.ExportedProgram) -> td.PartitionPlan:
        type(self).plans += 1
        return super().plan(exported_program)


def test_the_partitioner_plans_once_and_the_report_is_its_plan_with_what_compiled() -> None:
    edge = td.to_edge(export(TwoLinears(), torch.randn(2, 4)))
    _CountingPlans.plans = 0
    lowered = edge.to_backend(_CountingPlans(LINEAR_OPS, REFERENCE))
    assert _CountingPlans.plans == 1
    report = lowered.report
    assert report is not None
    planned = plan_report(edge, CapabilityPartitioner(LINEAR_OPS, REFERENCE))
    delegates = lowered.delegates()["forward"]
    sizes = {"forward": {str(d.meta["tag"]): len(d.processed_bytes) for d in delegates}}
    assert report.without_cache_answers() == planned.with_blob_sizes(sizes)
    assert report.methods["forward"].not_delegated() == {
        ("aten.sigmoid.default", "reference: unsupported: aten.sigmoid.default"): ["sigmoid"]
    }


def test_any_partitioner_gets_a_report_of_its_tags_partitions_and_sizes() -> None:
    program = export(TwoLinears(), torch.randn(2, 4))
    lowered = td.to_backend(program, OpSetPartitioner(LINEAR_OPS))
    report = td.lowering_report(lowered)
    assert report is not None and report.backends == [TorchExportBackend.backend_id]
    method = report.methods["forward"]
    assert [p.tag for p in method.partitions] == ["tag0", "tag1"]
    assert all(p.blob_bytes and p.blob_bytes > 0 for p in method.partitions)
    assert method.not_delegated() == {
        ("aten.sigmoid.default", f"{TorchExportBackend.backend_id}: not tagged by OpSetPartitioner"): ["sigmoid"]
    }
    assert td.lowering_report(program) is None  # the caller's program was not lowered
    with pytest.raises(TypeError, match="EdgeProgramManager.report"):
        td.lowering_report(td.to_edge(program))  # type: ignore[arg-type]


def test_the_mapping_form_and_a_manager_built_from_its_programs_carry_the_report() -> None:
    programs = {"a": export(TwoLinears(), torch.randn(2, 4)), "b": export(TwoLinears(), torch.randn(3, 4))}
    lowered = td.to_backend(programs, {"a": ReferencePartitioner()})
    report = td.lowering_report(lowered["a"])
    assert report is not None and list(report.methods) == ["a"]
    assert td.lowering_report(lowered["b"]) is None  # not lowered: the caller's own program
    manager = td.EdgeProgramManager(lowered)
    assert manager.report is not None and list(manager.report.methods) == ["a"]


class _SharedWeight(torch.nn.Module):
    def __init__(self, weight: torch.nn.Parameter) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight


def test_methods_lowered_by_separate_calls_join_under_the_managers_names_their_shared_weight_once() -> None:
    weight = torch.nn.Parameter(torch.randn(64, 64))
    prefill = td.to_backend(export(_SharedWeight(weight), torch.randn(4, 64)), ReferencePartitioner())
    decode = td.to_backend(export(_SharedWeight(weight), torch.randn(1, 64)), ReferencePartitioner())
    report = td.EdgeProgramManager({"prefill": prefill, "decode": decode}).report
    assert report is not None and list(report.methods) == ["prefill", "decode"]
    assert [m.method for m in report.methods.values()] == ["prefill", "decode"]
    assert report.state_bytes == {"prefill": 64 * 64 * 4, "decode": 64 * 64 * 4}
    assert report.unique_state_bytes == 64 * 64 * 4
    assert td.to_edge({"prefill": prefill}).report == report.restricted(["prefill"])


def test_a_report_not_yet_made_keeps_none_of_the_callers_tensors_alive() -> None:
    class Cached(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("cache", torch.zeros(256, 256))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.cache[0, :4].add_(x[0])
            return x * self.cache[0, :4]

    program = export(Cached(), torch.randn(2, 4))
    given = weakref.ref(program.state_dict["cache"])
    lowered = td.to_backend(program, ReferencePartitioner())  # lowering copies the state it mutates
    del program
    gc.collect()
    assert given() is None
    report = td.lowering_report(lowered)
    assert report is not None and report.state_bytes == {"forward": 256 * 256 * 4}


def test_stages_add_up_a_later_backend_takes_what_the_first_left() -> None:
    edge = td.to_edge(export(TwoLinears(), torch.randn(2, 4)))
    first = CapabilityPartitioner({aten.addmm.default, aten.permute.default}, REFERENCE)
    lowered = edge.to_backend([first, OpSetPartitioner({aten.sigmoid.default})])
    report = lowered.report
    assert report is not None
    assert report.backends == ["reference", TorchExportBackend.backend_id]
    method = report.methods["forward"]
    assert [p.backend_id for p in method.partitions] == ["reference", "reference", TorchExportBackend.backend_id]
    sigmoid = next(row for row in method.nodes if row.name == "sigmoid")
    assert sigmoid.backend_id == TorchExportBackend.backend_id
    assert "reference" in sigmoid.reasons  # the first stage's reason stays


def test_save_keeps_the_report_unless_told_not_to_and_inspect_draws_any_such_file(tmp_path: Path) -> None:
    lowered = td.to_edge_transform_and_lower(export(TwoLinears(), torch.randn(2, 4)), ReferencePartitioner())
    assert lowered.report is not None
    lowered.save(tmp_path / "m.tdp")
    with td.load(tmp_path / "m.tdp") as program:
        assert program.report == lowered.report.without_cache_answers().to_json()
        assert "reference_0" in render_text(program.report)  # a loaded file's report draws as the lowering's
    assert main(["inspect", str(tmp_path / "m.tdp"), "--html", str(tmp_path / "m.html")]) == 0
    assert "reference_0" in (tmp_path / "m.html").read_text()
    assert main(["inspect", str(tmp_path / "m.tdp"), "--model-explorer", str(tmp_path / "explorer")]) == 0
    assert any((tmp_path / "explorer").iterdir())
    lowered.save(tmp_path / "bare.tdp", report=False)
    with td.load(tmp_path / "bare.tdp") as program:
        assert program.report is None
    with pytest.raises(TypeError, match="save\\(report=...\\) takes True"):
        lowered.save(tmp_path / "x.tdp", report="yes")  # type: ignore[arg-type]
    assert not (tmp_path / "x.tdp").exists()


def test_the_report_of_a_lowering_does_not_depend_on_the_compile_cache(cache_directory: Path) -> None:
    edge = td.to_edge(export(TwoLinears(), torch.randn(2, 4)))
    miss = edge.to_backend(ReferencePartitioner()).report
    hit = edge.to_backend(ReferencePartitioner()).report
    assert miss is not None and hit is not None
    assert {p.cache for p in miss.methods["forward"].partitions} == {"miss"}
    assert {p.cache for p in hit.methods["forward"].partitions} == {"hit"}
    assert json.dumps(miss.without_cache_answers().to_json()) == json.dumps(hit.without_cache_answers().to_json())


def test_a_list_of_partitioners_given_to_the_standalone_form_says_where_lists_go() -> None:
    program = export(TwoLinears(), torch.randn(2, 4))
    with pytest.raises(TypeError, match="a list\\) go to EdgeProgramManager.to_backend or to_edge_transform_and_lower"):
        td.to_backend(program, [ReferencePartitioner()])  # type: ignore[arg-type]
