"""The partition report in Google's Model Explorer (``ai-edge-model-explorer``): its graph JSON and
node-data overlays, written from a report alone (no program, no Model Explorer needed to write them).

The graph file is a Model Explorer graph collection with one graph per method: every computation
a node labelled with its op, placed in the module hierarchy export recorded (each module call a
``/``-separated namespace segment, so layers fold as Model Explorer folds them), edges from what it
reads, its backend, partition and each backend's reason as attributes. Two overlays in Model
Explorer's node-data format colour the same nodes: one by backend, one by partition. Node ids
are the program's node names, in every file.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchdelegate.lowering.report_data import LoweringReport, MethodReport, as_report, short_op
from torchdelegate.partition.modules import call_label
from torchdelegate.report.html import LEFT_OUT, OUTPUTS, colours_of

NOT_DELEGATED = "not delegated"


@dataclass(frozen=True)
class ModelExplorerFiles:
    """What :func:`write_model_explorer` wrote: the graphs, and the overlays by backend and by partition."""

    graphs: Path
    backends: Path
    partitions: Path

    @property
    def node_data(self) -> list[Path]:
        return [self.backends, self.partitions]


def write_model_explorer(report: LoweringReport | Mapping[str, Any], directory: Path, name: str) -> ModelExplorerFiles:
    """Write ``NAME.json`` (the graphs), ``NAME.backends.json`` and ``NAME.partitions.json`` into ``directory``;
    ``report`` is a ``LoweringReport`` or its JSON data (``Program.report``)."""
    report = as_report(report)
    directory.mkdir(parents=True, exist_ok=True)
    files = ModelExplorerFiles(
        directory / f"{name}.json", directory / f"{name}.backends.json", directory / f"{name}.partitions.json"
    )
    for path, content in (
        (files.graphs, model_explorer_graphs(report, name)),
        (files.backends, backend_overlay(report)),
        (files.partitions, partition_overlay(report)),
    ):
        path.write_text(json.dumps(content, indent=1, ensure_ascii=False), encoding="utf-8")
    return files


def model_explorer_graphs(report: LoweringReport, label: str) -> dict[str, Any]:
    """A Model Explorer graph collection: one graph per method, its id the method's name."""
    return {"label": label, "graphs": [_graph(method) for method in report.methods.values()]}


def backend_overlay(report: LoweringReport) -> dict[str, Any]:
    """Model Explorer node data: each computation's backend (or "not delegated"), in its backend's colour."""
    colours = colours_of(report.backends)
    overlay = {}
    for method in report.methods.values():
        values = {row.name: _where(row.backend_id, colours) for row in method.nodes}
        overlay[method.method] = _graph_node_data("backend", values)
    return overlay


def partition_overlay(report: LoweringReport) -> dict[str, Any]:
    """Model Explorer node data: each computation's partition tag, partitions told apart by colour."""
    overlay = {}
    for method in report.methods.values():
        colours = colours_of([p.tag for p in method.partitions])
        values = {row.name: _where(row.tag, colours) for row in method.nodes}
        overlay[method.method] = _graph_node_data("partition", values)
    return overlay


def _where(value: str | None, colours: dict[str, str]) -> tuple[str, str]:
    return (value, colours.get(value, LEFT_OUT)) if value is not None else (NOT_DELEGATED, LEFT_OUT)


def _graph_node_data(name: str, values: dict[str, tuple[str, str]]) -> dict[str, Any]:
    """One graph's entry in Model Explorer's node-data JSON (its ``GraphNodeData``, defaults written out)."""
    return {
        "results": {node: {"value": value, "bgColor": colour} for node, (value, colour) in values.items()},
        "name": name,
        "thresholds": [],
        "gradient": [],
        "hideInAggregatedStatsTable": False,
        "hideInChildrenStatsTable": False,
        "showExpandedSummaryOnGroupNode": False,
        "showLabelCountColumnsInChildrenStatsTable": False,
    }


def _graph(method: MethodReport) -> dict[str, Any]:
    namespaces = _namespaces(method)
    nodes = [_node(name, name, "", [], [("kind", "input")]) for name in method.user_inputs]
    group_attributes = {
        namespace: {"module": call, "type": method.module_types.get(call, "")} for call, namespace in namespaces.items()
    }
    for row in method.nodes:
        namespace = namespaces[row.modules[-1]] if row.modules else ""
        attributes = [("op", row.op), ("backend", row.backend_id or NOT_DELEGATED), ("partition", row.tag or "")]
        attributes += [(f"reason ({backend})", reason) for backend, reason in row.reasons.items()]
        module = row.modules[-1] if row.modules else ""
        attributes += [("flops", str(row.flops)), ("module", module)]
        attributes += [("module type", method.module_types.get(module, ""))]
        nodes.append(_node(row.name, short_op(row.op), namespace, row.inputs, attributes))
    nodes.append(_node(OUTPUTS, "output", "", method.user_outputs, [("kind", "output")]))
    return {"id": method.method, "nodes": nodes, "groupNodeAttributes": group_attributes}


def _node(
    node_id: str, label: str, namespace: str, inputs: list[str], attributes: list[tuple[str, str]]
) -> dict[str, Any]:
    """One ``GraphNode`` as Model Explorer's graph builder writes it."""
    return {
        "id": node_id,
        "label": label,
        "namespace": namespace,
        "subgraphIds": [],
        "attrs": [{"key": key, "value": value} for key, value in attributes],
        "incomingEdges": [
            {"sourceNodeId": source, "sourceNodeOutputId": "0", "targetNodeInputId": str(k)}
            for k, source in enumerate(inputs)
        ],
        "outputsMetadata": [],
        "inputsMetadata": [],
    }


def _namespaces(method: MethodReport) -> dict[str, str]:
    """Each module call's namespace: its callers' names and its own, each under its caller's (``layers.0``)."""
    found: dict[str, str] = {}
    for call, caller in method.module_callers().items():  # a caller comes before the calls made in it
        segment = call_label(call, caller or "").replace("/", "\u2215")
        found[call] = f"{found[caller]}/{segment}" if caller else segment
    return found
