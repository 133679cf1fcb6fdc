"""DelegateMappingBuilder, and a backend's debug handle map from preprocess to a loaded file.

A backend maps what its blob runs to the debug handles to_edge gave the graph's nodes; the map
stays with the delegate through the compile cache and worker processes, is saved, and a loaded
program names the graph nodes behind each entry from its report.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from models import TwoLinears, export

import torchdelegate as td
from torchdelegate import DelegateMappingBuilder, DelegationSpec, PreprocessResult
from torchdelegate.backends.reference import ReferenceBackend, ReferencePartitioner
from torchdelegate.cli import main
from torchdelegate.report.attribution import GraphNode, attributed_profile, delegate_nodes


def _edge_nodes() -> list[torch.fx.Node]:
    program = td.to_edge(export(TwoLinears(), torch.randn(2, 4))).exported_program()
    return [n for n in program.graph.nodes if n.op == "call_function"]


def test_entries_take_the_handles_of_nodes_or_handles_given_and_come_back_sorted() -> None:
    permute, addmm, relu, *_ = _edge_nodes()
    builder = DelegateMappingBuilder()
    assert builder.insert_delegate_mapping_entry(nodes=[addmm, permute], identifier="gemm") == "gemm"
    assert builder.insert_delegate_mapping_entry(nodes=relu, identifier=7) == 7
    assert builder.insert_delegate_mapping_entry(handles=[5, None, 4], identifier="tail") == "tail"
    assert builder.get_delegate_mapping() == {"gemm": (1, 2), 7: (3,), "tail": (4, 5)}


def test_generated_identifiers_count_from_zero_and_refuse_one_given() -> None:
    builder = DelegateMappingBuilder(generated_identifiers=True)
    assert [builder.insert_delegate_mapping_entry(handles=h) for h in (3, [1, 2])] == [0, 1]
    assert builder.get_delegate_mapping() == {0: (3,), 1: (1, 2)}
    with pytest.raises(ValueError, match="numbers its identifiers"):
        builder.insert_delegate_mapping_entry(handles=4, identifier="mine")


@pytest.mark.parametrize(
    ("arguments", "error", "message"),
    [
        ({"identifier": "x"}, ValueError, "takes nodes or handles: exactly one"),
        ({"nodes": [], "handles": [1], "identifier": "x"}, ValueError, "exactly one"),
        ({"handles": [1]}, ValueError, "give each entry an identifier"),
        ({"handles": [None], "identifier": "x"}, ValueError, "no debug handle among what was given"),
        ({"handles": ["1"], "identifier": "x"}, TypeError, "a debug handle is an int"),
        ({"handles": [1], "identifier": 1.5}, TypeError, "an int or a str"),
    ],
)
def test_a_malformed_entry_is_refused_saying_why(arguments: dict[str, Any], error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        DelegateMappingBuilder().insert_delegate_mapping_entry(**arguments)


def test_an_identifier_given_twice_is_refused() -> None:
    builder = DelegateMappingBuilder()
    builder.insert_delegate_mapping_entry(handles=1, identifier="a")
    with pytest.raises(ValueError, match="'a' was inserted already"):
        builder.insert_delegate_mapping_entry(handles=2, identifier="a")


class MappingReference(ReferenceBackend):
    """The reference backend, mapping each computation of a partition, by name, to its handles."""

    backend_id = "TestMappingReference"
    compile_cache_version = "handles by node name, 1"

    @classmethod
    def preprocess(cls, edge_program, compile_specs):  # type: ignore[no-untyped-def]
        result = super().preprocess(edge_program, compile_specs)
        builder = DelegateMappingBuilder()
        for node in edge_program.graph.nodes:
            if node.op == "call_function":
                builder.insert_delegate_mapping_entry(nodes=node, identifier=f"op:{node.name}")
        return PreprocessResult(
            result.processed_bytes,
            debug_handle_map=builder.get_delegate_mapping(),
            data_store_output=result.data_store_output,
        )

    @classmethod
    def profile(cls, handle: Any) -> dict[str, float]:
        """What a profiler of this backend would say: times of its own units, one under a name it made."""
        return {"op:relu": 0.25, "op:addmm_1_fused": 0.5, "elsewhere": 0.125}


def _mapping_partitioner() -> ReferencePartitioner:
    partitioner = ReferencePartitioner()
    partitioner.spec = DelegationSpec(MappingReference.backend_id)
    return partitioner


def _lowered() -> td.EdgeProgramManager:
    return td.to_edge(export(TwoLinears(), torch.randn(2, 4))).to_backend(_mapping_partitioner())


NAMES = ("permute", "addmm", "relu", "sigmoid", "permute_1", "addmm_1", "add")
EXPECTED = {f"op:{name}": (handle,) for handle, name in enumerate(NAMES, start=1)}


def test_the_map_is_kept_saved_and_a_loaded_program_names_its_nodes_from_the_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lowered = _lowered()
    first = lowered.delegates()["forward"][0]
    assert first.meta["debug_handle_map"] == EXPECTED
    assert [(r.name, r.debug_handle) for r in lowered.report.methods["forward"].nodes][:3] == [  # type: ignore[union-attr]
        ("permute", 1),
        ("addmm", 2),
        ("relu", 3),
    ]
    lowered.save(tmp_path / "m.tdp")
    with td.load(tmp_path / "m.tdp") as program:
        record = program.delegates[0]
        assert record.debug_handle_map == EXPECTED
        nodes = delegate_nodes(record, program.report)
        assert nodes["op:addmm"] == [GraphNode(2, "addmm", "aten.addmm.default")]
        assert program.profile() == {}  # not run yet
        program.run("forward", torch.randn(2, 4))
        units = attributed_profile(program)
        assert [(u.identifier, u.seconds, [n.name for n in u.nodes]) for u in units] == [
            ("op:addmm_1_fused", 0.5, ["addmm_1"]),  # a name the backend made: the longest identifier it starts with
            ("op:relu", 0.25, ["relu"]),
            ("elsewhere", 0.125, []),
        ]
    assert main(["inspect", str(tmp_path / "m.tdp"), "--debug-handles"]) == 0
    out = capsys.readouterr().out
    assert "#0 forward:TestMappingReference_0 (TestMappingReference): 7 entries" in out
    assert "    op:addmm -> addmm (aten.addmm.default)" in out
    lowered.save(tmp_path / "bare.tdp", report=False)
    with td.load(tmp_path / "bare.tdp") as program:
        assert delegate_nodes(program.delegates[0], program.report)["op:addmm"] == [GraphNode(2, None, None)]


def test_the_map_comes_back_the_same_from_the_compile_cache_and_from_workers(tmp_path: Path) -> None:
    maps, answers = [], []
    for options in ({"cache": tmp_path / "cache"}, {"cache": tmp_path / "cache"}, {"jobs": 1, "cache": False}):
        with td.preprocessing(**options):  # type: ignore[arg-type]
            lowered = _lowered()
        maps.append([d.meta["debug_handle_map"] for d in lowered.delegates()["forward"]])
        answers.append([d.meta.get("compile_cache") for d in lowered.delegates()["forward"]])
    assert answers == [["miss"], ["hit"], [None]]
    assert maps[0] == maps[1] == maps[2] and maps[0][0] == EXPECTED


class _Renamed(MappingReference):
    """A port that changed how it compiles, and forgot to change the version it inherited."""

    backend_id = "TestMappingRenamed"

    @classmethod
    def preprocess(cls, edge_program, compile_specs):  # type: ignore[no-untyped-def]
        return super().preprocess(edge_program, compile_specs)


def test_a_backend_overriding_a_compile_hook_does_not_inherit_its_parents_cache_version(tmp_path: Path) -> None:
    assert MappingReference.compile_cache_version is not None and _Renamed.compile_cache_version is None
    partitioner = ReferencePartitioner()
    partitioner.spec = DelegationSpec(_Renamed.backend_id)
    for _ in range(2):
        with td.preprocessing(cache=tmp_path / "cache"):
            lowered = td.to_edge(export(TwoLinears(), torch.randn(2, 4))).to_backend(partitioner)
        assert [d.meta.get("compile_cache") for d in lowered.delegates()["forward"]] == [None]  # compiled each time
