"""Edits of an onnx_ir model that keep the names the blob's header and other nodes refer to."""

from __future__ import annotations

from typing import Any


def take_place(model: Any, old: Any, new: Any) -> None:
    """``new`` (a value) takes ``old``'s users, graph outputs, name, shape and type."""
    old.replace_all_uses_with(new, replace_graph_outputs=True)
    name, old.name = old.name, None  # two values may not hold one name at once
    new.name, new.shape, new.type = name, old.shape, old.type


def replace_node(model: Any, node: Any, replacement: Any) -> None:
    """``replacement`` (one output) takes ``node``'s place and its output's name, shape and type."""
    model.graph.insert_before(node, replacement)
    take_place(model, node.outputs[0], replacement.outputs[0])
    model.graph.remove(node, safe=True)
