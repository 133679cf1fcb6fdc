"""ONNX Runtime's debug handle map: each ONNX node of a delegate's model to the graph nodes it computes."""

from __future__ import annotations

import gc
import os
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from language_models import tiny_llama
from models import TwoLinears, aten, export

import torchdelegate as td
from torchdelegate.backends.reference import ReferencePartitioner
from torchdelegate.cli import main
from torchdelegate.report.attribution import attributed_profile

pytest.importorskip("onnxruntime")
from torchdelegate.backends.onnxruntime import OnnxRuntimePartitioner  # noqa: E402
from torchdelegate.llm.checkpoint import export_methods  # noqa: E402


def test_each_onnx_node_maps_to_the_nodes_it_computes_a_linear_layer_to_all_of_its_pieces() -> None:
    with td.preprocessing(cache=False):
        lowered = td.to_edge(export(TwoLinears(), torch.randn(2, 4))).to_backend(OnnxRuntimePartitioner())
    program = lowered.exported_program()
    (delegate,) = lowered.delegates()["forward"]
    handles = {n.name: n.meta["debug_handle"] for n in delegate.original_module.graph.nodes if n.op == "call_function"}
    by_handle = {handle: name for name, handle in handles.items()}
    mapped = {key: sorted(by_handle[h] for h in value) for key, value in delegate.meta["debug_handle_map"].items()}
    assert mapped == {
        "node_addmm": ["addmm", "permute"],
        "node_relu": ["relu"],
        "node_sigmoid": ["sigmoid"],
        "node_addmm_1": ["addmm_1", "permute_1"],
        "node_add": ["add"],
    }
    assert not any(n.target is aten.addmm.default for n in program.graph.nodes)  # all of it delegated


def test_partitions_joined_into_one_model_name_their_nodes_as_its_branches_do(tmp_path: Path) -> None:
    programs = export_methods(tiny_llama(), 16, None)
    with td.preprocessing(cache=False):
        lowered = td.to_edge_transform_and_lower(programs, partitioner=[OnnxRuntimePartitioner()])
    maps = {method: delegates[0].meta["debug_handle_map"] for method, delegates in lowered.delegates().items()}
    assert maps["prefill"] and all(key.startswith("p0/") for key in maps["prefill"])
    assert maps["decode"] == maps["prefill"]  # decode is prefill's program: one branch runs both
    path = tmp_path / "llm.tdp"
    lowered.save(path)
    with td.load(path) as loaded:
        assert {d.method: d.debug_handle_map for d in loaded.delegates} == maps


def test_a_profile_of_onnx_runtimes_nodes_names_the_graph_nodes_behind_each(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = TwoLinears()
    x = torch.randn(2, 4)
    with td.preprocessing(cache=False):
        lowered = td.to_edge(export(model, x)).to_backend(OnnxRuntimePartitioner())
    lowered.save(tmp_path / "m.tdp")
    with td.load(tmp_path / "m.tdp", backend_options={"onnxruntime": {"profile": 1}}) as program:
        for _ in range(3):
            torch.testing.assert_close(program.run("forward", x), model(x))
        (seconds,) = program.profile().values()
        assert set(seconds) <= {"node_addmm", "node_relu", "node_sigmoid", "node_addmm_1", "node_add"}
        assert seconds and all(value >= 0 for value in seconds.values())
        units = attributed_profile(program)
        assert [unit.seconds for unit in units] == sorted((unit.seconds for unit in units), reverse=True)
        named = {unit.identifier: [node.name for node in unit.nodes] for unit in units}
        assert all(named.values())  # every timed node is named in the graph
        assert program.profile() == {0: seconds}  # read once: the same answer again
    with td.load(tmp_path / "m.tdp") as program:
        program.run("forward", x)
        assert program.profile() == {}  # not asked for: nothing recorded
    traces = Path(tempfile.gettempdir()).glob(f"torchdelegate-profile-{os.getpid()}*")
    with td.load(tmp_path / "m.tdp", backend_options={"onnxruntime": {"profile": 1}}) as program:
        program.run("forward", x)  # recorded, never read
    gc.collect()
    assert not list(traces)  # ONNX Runtime's trace files are deleted, read or not
    np.save(tmp_path / "x.npy", x.numpy())
    assert main(["run", str(tmp_path / "m.tdp"), "--input", str(tmp_path / "x.npy"), "--profile"]) == 0
    out = capsys.readouterr().out
    assert "profile: " in out and " ms  forward:onnxruntime_0  node_addmm -> " in out


def test_run_profile_on_a_file_no_backend_of_which_profiles_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lowered = td.to_edge(export(TwoLinears(), torch.randn(2, 4))).to_backend(ReferencePartitioner())
    lowered.save(tmp_path / "r.tdp")
    np.save(tmp_path / "x.npy", torch.randn(2, 4).numpy())
    assert main(["run", str(tmp_path / "r.tdp"), "--input", str(tmp_path / "x.npy"), "--profile"]) == 1
    assert "records a profile (reference)" in capsys.readouterr().err
