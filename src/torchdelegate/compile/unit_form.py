"""A compile unit as data: its sub-program in torch.export's serialized form, its state tensors,
their digests, and the key of its structure.

The form is what travels to a worker (``worker.py``) and what the compile cache's key covers:
the sub-program's JSON (graph, signature, node metadata; stack traces left out of the key, since
they name the files of one checkout), the backend, its declared identity, torch's and
torchdelegate's versions and the compile specs. Weights are covered by their SHA-256 where the
backend needs them to be (``entry.py``).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch

from torchdelegate.backend import BackendDetails
from torchdelegate.data import content_key
from torchdelegate.errors import SerializationError
from torchdelegate.lowered_module import state_value
from torchdelegate.lowering.compile_units import CompileUnit
from torchdelegate.lowering.exported_programs import TENSOR_STATE_KINDS
from torchdelegate.serialize.container import canonical_json
from torchdelegate.serialize.graph import program_to_json
from torchdelegate.version import __version__

FORMAT = 1


@dataclass(frozen=True)
class UnitForm:
    """A unit's sub-program as torch.export's JSON, and its state tensors by name with their digests."""

    document: dict[str, Any]
    state: dict[str, torch.Tensor]
    digests: dict[str, str]


def unit_form(unit: CompileUnit, known: dict[torch.Tensor, str]) -> UnitForm | str:
    """The unit's form, or why it has none (a sub-program torch.export cannot serialize: it
    holds delegates of an earlier stage, or script objects); such a unit is compiled here, uncached.

    ``known`` holds the digests of tensors already hashed (by tensor: the units of one lowering
    share their weights), and gains this unit's."""
    try:
        document = program_to_json(unit.program, unit.where, debug_info=True)
    except SerializationError as e:
        return str(e)
    state = {}
    for spec in unit.program.graph_signature.input_specs:
        if spec.kind in TENSOR_STATE_KINDS and spec.target is not None:
            value = state_value(unit.program, spec.target)
            if not isinstance(value, torch.Tensor) or value.device.type != "cpu":
                return f"{unit.where}: {spec.target!r} is not a tensor on the CPU"
            state[spec.target] = value
    for tensor in state.values():
        if tensor not in known:
            known[tensor] = content_key(tensor)
    return UnitForm(document, state, {name: known[tensor] for name, tensor in sorted(state.items())})


def document_key(document: Any) -> str:
    """The hex SHA-256 of a document's canonical JSON: the compile cache's keys."""
    return hashlib.sha256(canonical_json(document)).hexdigest()


def structure_key(backend: type[BackendDetails], unit: CompileUnit, form: UnitForm, identity: dict[str, str]) -> str:
    """What the compiled result depends on, but the weights' bytes."""
    described = {
        "format": FORMAT,
        "backend": backend.backend_id,
        "identity": identity,
        "torch": torch.__version__,
        "torchdelegate": __version__,
        "compile_specs": [[spec.key, spec.value.hex()] for spec in unit.compile_specs],
        "program": _key_form(form.document),
    }
    return document_key(described)


def _key_form(value: Any) -> Any:
    """The document as the key covers it: every node's metadata without its stack trace, and module
    paths without the keys export gave each module call (non-strict export keys them by ``id()``)."""
    if isinstance(value, list):
        return [_key_form(item) for item in value]
    if not isinstance(value, dict):
        return value
    return {k: _key_metadata(v) if k == "metadata" and isinstance(v, dict) else _key_form(v) for k, v in value.items()}


def _key_metadata(metadata: dict[str, Any]) -> dict[str, Any]:
    kept = {k: v for k, v in metadata.items() if k != "stack_trace"}
    stack = kept.get("nn_module_stack")
    if isinstance(stack, str):
        kept["nn_module_stack"] = ";".join(item.partition(",")[2] for item in stack.split(";"))
    return kept
