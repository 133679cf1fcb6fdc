"""The ONNX nodes a saved program's ONNX Runtime delegates run, for tests that check what was fused."""

from __future__ import annotations

from typing import Any

import onnx

import torchdelegate as td
from torchdelegate.backends.onnxruntime.blob_header import model_of, unpacked


def delegate_nodes(program: td.Program, index: int) -> list[Any]:
    """The nodes delegate ``index`` runs: its model's, or its branch's of a model that several share."""
    blob = program.file.data(program.delegates[index].blob, "blob")
    branch = unpacked(blob)[0]["branch"]
    graph = onnx.ModelProto.FromString(bytes(model_of(blob, program.named_data)[1])).graph
    name = f"p{branch}:branch"
    taken = [a.g for node in graph.node if node.name == name for a in node.attribute if a.name == "then_branch"]
    return list(taken[0].node if taken else graph.node)
