"""A partition translated to ONNX by torch's exporter, without tracing it a second time.

``torch.onnx.export(program)`` decomposes the program with its own table (torch's
``run_decompositions``, which traces the whole graph again), then translates it node by node. A
partition comes decomposed already (``to_edge``: core ATen, and the ops this backend kept whole),
so where none of its nodes has a decomposition in the exporter's table, that trace changes nothing
but node names and costs as long as the ``to_edge`` decomposition did. There the exporter's other
steps run as its ``export`` runs them (explicit type promotion, assertions dropped, translation,
the opset); a partition with a node left to decompose, or with sub-graphs, takes the exporter's
whole way. The steps are those of ``torch.onnx._internal.exporter`` in the torch this package
pins; the registry is the one the partitioner asks what the exporter translates.
"""

from __future__ import annotations

import importlib
from functools import cache
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.fx.traceback import NodeSource, NodeSourceAction

from torchdelegate.exported.structural_copy import copy_program

_EXPORTER = "torch.onnx._internal.exporter"


def _opset() -> int:
    """The opset ``torch.onnx.export`` writes when given none, which every partition's model is written at."""
    return int(importlib.import_module("torch.onnx._constants").ONNX_DEFAULT_OPSET)


def onnx_registry() -> Any:
    """The exporter's registry of translations (torchlib's, at the opset of :func:`_opset`), built once."""
    return _registry_with(())


@cache
def _registry_with(translations: tuple[tuple[Any, Any], ...]) -> Any:
    """torchlib's registry with ``translations`` (torch op, ONNX function) added, built once for each."""
    registration = importlib.import_module(f"{_EXPORTER}._registration")
    registry = registration.ONNXRegistry.from_torchlib(opset_version=_opset())
    for torch_op, onnx_op in translations:
        registry.register_op(torch_op, onnx_op, is_complex=False)
    return registry


@cache
def _decomposed_by_exporter(registry: Any) -> frozenset[Any]:
    """The ops the exporter would decompose before translating, given ``registry``."""
    decompositions = importlib.import_module(f"{_EXPORTER}._decomp")
    translated = set(decompositions.get_onnx_implemented_overloads(registry))
    return frozenset(decompositions.create_onnx_friendly_decomposition_table(translated))


def onnx_program_of(program: ExportedProgram, translations: dict[Any, Any] | None) -> Any:
    """``torch.onnx.export(program, dynamo=True, optimize=False)`` with ``translations`` added to its
    table, the exporter's decomposition left out where it has nothing to decompose. The caller's
    program is not changed: the exporter's passes edit a structural copy."""
    registry = _registry_with(tuple((translations or {}).items()))
    graphs = [m for m in program.graph_module.modules() if isinstance(m, torch.fx.GraphModule)]
    decomposed = _decomposed_by_exporter(registry)
    if len(graphs) > 1 or any(n.op == "call_function" and n.target in decomposed for n in program.graph.nodes):
        return torch.onnx.export(
            program, (), dynamo=True, optimize=False, verbose=False, custom_translation_table=translations
        )
    core = importlib.import_module(f"{_EXPORTER}._core")
    passes = importlib.import_module(f"{_EXPORTER}._fx_passes")
    program = _traced_from(program)
    with torch.fx.experimental._config.patch(backed_size_oblivious=True):  # type: ignore[attr-defined]
        passes.insert_type_promotion_nodes(program.graph_module)
        program._graph_module = passes.remove_assertion_nodes(program.graph_module)
    translated = core._exported_program_to_onnx_program(program, registry=registry)
    translated.model = core.onnxscript_apis.convert_version(translated.model, _opset())
    return translated


def _traced_from(program: ExportedProgram) -> ExportedProgram:
    """A structural copy of ``program`` whose every node names the node it copies as its source
    (``meta["from_node"]``), as the exporter's re-trace would: the debug handle map
    (``node_sources.py``) reads each ONNX node's partition nodes through it, whatever provenance the
    partition itself carries (none, rebuilt on a worker)."""
    copied = copy_program(program)
    originals = {node.name: node for node in program.graph.nodes}
    for node in copied.graph.nodes:
        source = originals.get(node.name)
        if source is not None and node.op == "call_function":
            node.meta["from_node"] = [NodeSource(source, "torchdelegate.translation", NodeSourceAction.CREATE)]
    return copied
