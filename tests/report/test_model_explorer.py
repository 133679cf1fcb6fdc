"""The report for Google's Model Explorer: files its own data classes read back field for field,
overlays whose node ids are the graph's, and the module hierarchy as namespaces."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from models import layered_program

import torchdelegate as td
from torchdelegate.cli import main

aten = torch.ops.aten


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("model-explorer")
    program = layered_program(directory / "layered.tdp")
    assert main(["inspect", str(program), "--model-explorer", str(directory / "me")]) == 0
    return directory / "me"


def test_model_explorers_own_classes_read_the_graphs_field_for_field(written: Path) -> None:
    from dacite import Config, from_dict
    from model_explorer.graph_builder import GraphCollection
    from model_explorer.utils import remove_none

    data = json.loads((written / "layered.json").read_text())
    collection = from_dict(GraphCollection, data, config=Config(strict=True))
    assert remove_none(dataclasses.asdict(collection)) == {**data, "graphSorting": "node_count_desc"}
    assert [graph.id for graph in collection.graphs] == ["forward", "batch"]
    graph = collection.graphs[0]
    ids = [node.id for node in graph.nodes]
    assert len(ids) == len(set(ids))
    assert all(edge.sourceNodeId in ids for node in graph.nodes for edge in node.incomingEdges)
    by_label = {node.namespace for node in graph.nodes}
    assert {"0/norm", "0/mlp/0", "1/mlp/2", "2", ""} <= by_label  # layers as Model Explorer folds them
    attributes = {
        a.key: a.value for a in next(n for n in graph.nodes if n.namespace == "0/mlp/0" and n.label == "addmm").attrs
    }
    assert attributes["backend"] == "reference" and attributes["op"] == "aten.addmm.default"
    norm = {a.key: a.value for a in next(n for n in graph.nodes if n.namespace == "0/norm").attrs}
    assert norm["backend"] == "not delegated" and norm["reason (reference)"].startswith("unsupported")
    assert graph.groupNodeAttributes is not None
    assert graph.groupNodeAttributes["0/mlp"]["type"] == "torch.nn.modules.container.Sequential"


@pytest.mark.parametrize(("overlay", "values"), [("backends", {"reference", "not delegated"}), ("partitions", None)])
def test_each_overlay_is_model_explorers_node_data_keyed_by_the_graphs_node_ids(
    written: Path, overlay: str, values: set[str] | None
) -> None:
    from dacite import Config, from_dict
    from model_explorer.node_data_builder import GraphNodeData, ModelNodeData

    data = json.loads((written / f"layered.{overlay}.json").read_text())
    graphs = {g["id"]: g for g in json.loads((written / "layered.json").read_text())["graphs"]}
    assert list(data) == list(graphs)  # one entry per method
    for method, entry in data.items():
        node_data = ModelNodeData(
            {method: from_dict(GraphNodeData, entry, config=Config(strict=True, check_types=False))}
        )
        assert json.loads(node_data.to_json_string()) == {method: entry}
        computations = {n["id"] for n in graphs[method]["nodes"] if not any(a["key"] == "kind" for a in n["attrs"])}
        assert set(entry["results"]) == computations
        assert all(r["bgColor"].startswith("#") for r in entry["results"].values())
    found = {r["value"] for r in data["forward"]["results"].values()}
    assert found == values if values else {"reference_0", "not delegated"} <= found


def test_model_explorer_without_a_saved_report_or_with_open_alone_says_what_to_do(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plain = tmp_path / "plain.tdp"
    td.to_edge(torch.export.export(torch.nn.Linear(2, 2), (torch.randn(1, 2),))).save(plain)
    assert main(["inspect", str(plain), "--model-explorer", str(tmp_path / "me")]) == 1
    assert "holds no partition report" in capsys.readouterr().err
    assert main(["inspect", str(plain), "--open"]) == 2
    assert "--open and --port go with --model-explorer DIR" in capsys.readouterr().err
    (tmp_path / "file").write_text("")
    program = layered_program(tmp_path / "layered.tdp")
    assert main(["inspect", str(program), "--model-explorer", str(tmp_path / "file")]) == 1
    assert "not a directory" in capsys.readouterr().err
