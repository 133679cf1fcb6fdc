"""PreprocessResult.delegate_info: what a backend says about each delegate, kept in its meta and in the file."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from backends_for_tests import DescribingReference, describing_partitioner
from models import TwoLinears, export

import torchdelegate as td
from torchdelegate import DelegationSpec, LoweredBackendModule, PreprocessError, PreprocessResult, SerializationError
from torchdelegate.backends.reference import ReferenceBackend, ReferencePartitioner
from torchdelegate.cli import main


def _lowered() -> td.EdgeProgramManager:
    return td.to_edge(export(TwoLinears(), torch.randn(2, 4))).to_backend(describing_partitioner())


def test_the_info_preprocess_returns_is_in_the_delegates_meta() -> None:
    (delegate,) = _lowered().delegates()["forward"]
    info = delegate.meta["delegate_info"]
    assert info["fused"] is False and info["score"] == 0.5 and info["notes"] is None
    assert "aten.addmm.default" in info["ops"]


def test_a_positional_preprocess_result_keeps_its_three_fields_first() -> None:
    result = PreprocessResult(b"blob", {"h": 1}, None)
    assert (result.processed_bytes, result.debug_handle_map, result.delegate_info) == (b"blob", {"h": 1}, None)


def test_the_whole_program_form_keeps_the_info_too() -> None:
    program = export(TwoLinears(), torch.randn(2, 4))
    lowered = td.to_backend(DescribingReference.backend_id, program, [])
    assert isinstance(lowered, LoweredBackendModule)
    assert "aten.addmm.default" in lowered.meta["delegate_info"]["ops"]


def test_the_info_is_saved_read_back_by_the_runtime_and_shown_by_inspect(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lowered = _lowered()
    expected = lowered.delegates()["forward"][0].meta["delegate_info"]
    lowered.save(tmp_path / "m.tdp")
    with td.load(tmp_path / "m.tdp") as program:
        (record,) = program.delegates
        assert record.delegate_info == expected
    assert main(["inspect", str(tmp_path / "m.tdp")]) == 0
    out = capsys.readouterr().out
    assert "delegate info (from each backend's preprocess):" in out
    assert '#0 forward:TestDescribing_0 (TestDescribing): {"fused": false, "notes": null, "ops": ["aten.add' in out


class _SaysWhatItFused(ReferenceBackend):
    """A backend written as ExecuTorch's are: its info a string, given as ``_delegate_info_meta``."""

    backend_id = "TestSaysWhatItFused"

    @classmethod
    def preprocess(cls, edge_program, compile_specs):  # type: ignore[no-untyped-def]
        result = super().preprocess(edge_program, compile_specs)
        ops = sum(n.op == "call_function" for n in edge_program.graph.nodes)
        return PreprocessResult(
            result.processed_bytes, data_store_output=result.data_store_output, _delegate_info_meta=f"fused {ops} ops"
        )


@pytest.mark.parametrize("info", ["fused 3 ops", ["addmm", "relu"], 7], ids=["string", "list", "number"])
def test_any_json_value_is_a_delegates_info_and_executorchs_spelling_is_the_same_field(
    tmp_path: Path, info: Any
) -> None:
    result = PreprocessResult(b"blob", _delegate_info_meta=info)
    assert result.delegate_info == result._delegate_info_meta == info
    result._delegate_info_meta = {"set": "as ExecuTorch's backends do"}
    assert result.delegate_info == {"set": "as ExecuTorch's backends do"}

    partitioner = ReferencePartitioner()
    partitioner.spec = DelegationSpec(_SaysWhatItFused.backend_id)
    lowered = td.to_edge(export(TwoLinears(), torch.randn(2, 4))).to_backend(partitioner)
    infos = [d.meta["delegate_info"] for d in lowered.delegates()["forward"]]
    assert infos and all(isinstance(i, str) and i.startswith("fused ") for i in infos)
    lowered.save(tmp_path / "m.tdp")
    with td.load(tmp_path / "m.tdp") as program:
        assert [d.delegate_info for d in program.delegates] == infos
    assert lowered.report is not None
    assert [p.delegate_info for p in lowered.report.methods["forward"].partitions] == infos


def test_a_delegate_without_info_saves_no_field_and_loads_as_none(tmp_path: Path) -> None:
    """Files of backends that return no info are as before this field existed, and load the same."""
    from torchdelegate.backends.reference import ReferencePartitioner

    lowered = td.to_edge(export(TwoLinears(), torch.randn(2, 4))).to_backend(ReferencePartitioner())
    assert "delegate_info" not in lowered.delegates()["forward"][0].meta
    lowered.save(tmp_path / "m.tdp", report=False)  # a report names every field of a partition row
    assert b"delegate_info" not in (tmp_path / "m.tdp").read_bytes()
    with td.load(tmp_path / "m.tdp") as program:
        assert program.delegates[0].delegate_info is None


@pytest.mark.parametrize(
    ("info", "problem"),
    [
        ({"fused", "ops"}, "the value is a set"),
        ({"weights": torch.zeros(2)}, "['weights'] is a Tensor"),
        ({"kernels": [{"tile": {8, 16}}]}, "['kernels'][0]['tile'] is a set"),
        ({"error": math.nan}, "['error'] is nan, which JSON cannot hold"),
        ({1: "one"}, "the dict has the key 1, which is not a str"),
    ],
    ids=["set", "tensor", "nested set", "nan", "int key"],
)
def test_info_that_is_not_json_data_is_refused_naming_backend_partition_and_method(
    monkeypatch: pytest.MonkeyPatch, info: Any, problem: str
) -> None:
    monkeypatch.setattr(DescribingReference, "describe", staticmethod(lambda program: info))
    program = export(TwoLinears(), torch.randn(2, 4))
    with pytest.raises(PreprocessError) as caught:
        td.to_backend(program, describing_partitioner())
    assert str(caught.value) == (
        "backend 'TestDescribing' returned a delegate_info for partition 'TestDescribing_0' of method 'forward' "
        f"that is not JSON data: {problem}; return str, int, float, bool, None, lists of them, or dicts with str "
        "keys of them"
    )


def test_info_the_backend_changes_after_preprocess_is_kept_as_returned(monkeypatch: pytest.MonkeyPatch) -> None:
    shared: dict[str, Any] = {"passes": ["fuse"]}
    monkeypatch.setattr(DescribingReference, "describe", staticmethod(lambda program: shared))
    lowered = td.to_backend(export(TwoLinears(), torch.randn(2, 4)), describing_partitioner())
    shared["passes"].append("later")
    (delegate,) = [m for m in lowered.graph_module.children() if isinstance(m, LoweredBackendModule)]
    assert delegate.meta["delegate_info"] == {"passes": ["fuse"]}


def test_saving_refuses_info_put_in_a_delegates_meta_by_hand_that_is_not_json(tmp_path: Path) -> None:
    lowered = _lowered()
    lowered.delegates()["forward"][0].meta["delegate_info"] = {"dtype": torch.float32}
    message = (
        r"delegate 'forward:TestDescribing_0' on 'TestDescribing': "
        r"meta\['delegate_info'\] is not JSON data: \['dtype'\]"
    )
    with pytest.raises(SerializationError, match=message):
        lowered.save(tmp_path / "m.tdp")
    assert not (tmp_path / "m.tdp").exists()
