"""A compile unit as data: its state tensors and their digests, the key of its structure, and
the torch.export serialized form of its sub-program that travels to a worker.

The structure key covers what the compiled result depends on but the weights' bytes: the
sub-program's key form (``key_form.py``), the backend, its declared identity, torch's and
torchdelegate's versions and the compile specs. Weights are covered by their SHA-256 where the
backend needs them to be (``cache/compiled_entry.py``). The serialized form is made only for a unit that goes
to a worker.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch

from torchdelegate.compile.key_form import Unkeyable, key_form
from torchdelegate.delegate.backend_details import BackendDetails
from torchdelegate.delegate.compile_units import CompileUnit
from torchdelegate.delegate.named_data import content_key
from torchdelegate.errors import SerializationError
from torchdelegate.exported.programs import TENSOR_STATE_KINDS, state_value
from torchdelegate.serialize.container import canonical_json
from torchdelegate.serialize.graph import program_to_json, unheld_input
from torchdelegate.version import __version__

FORMAT = 3  # 3: entries record their binding and carry a signature


@dataclass(frozen=True)
class UnitForm:
    """A unit's state tensors by name, with their digests."""

    state: dict[str, torch.Tensor]
    digests: dict[str, str]


def unit_form(unit: CompileUnit, known: dict[torch.Tensor, str]) -> UnitForm | str:
    """The unit's form, or why it has none (its state is not all tensors on the CPU, or it reads
    script objects); such a unit is compiled here, uncached.

    ``known`` holds the digests of tensors already hashed (by tensor: the units of one lowering
    share their weights), and gains this unit's."""
    unheld = unheld_input(unit.program)
    if unheld is not None:
        return f"{unit.where}: {unheld}"
    state = state_tensors(unit)
    for name, value in state.items():
        if not isinstance(value, torch.Tensor) or value.device.type != "cpu":
            return f"{unit.where}: {name!r} is not a tensor on the CPU"
    for tensor in state.values():
        if tensor not in known:
            known[tensor] = content_key(tensor)
    return UnitForm(state, {name: known[tensor] for name, tensor in sorted(state.items())})


def state_tensors(unit: CompileUnit) -> dict[str, Any]:
    """The unit's state (parameters, buffers, constants) by name, as its program holds them."""
    program = unit.program
    specs = program.graph_signature.input_specs
    return {
        spec.target: state_value(program, spec.target)
        for spec in specs
        if spec.kind in TENSOR_STATE_KINDS and spec.target is not None
    }


def unit_document(unit: CompileUnit) -> dict[str, Any] | None:
    """The sub-program in torch.export's serialized form, as a worker rebuilds it; None if torch
    cannot serialize it (it holds delegates of an earlier stage): it is compiled here."""
    try:
        return program_to_json(unit.program, unit.where, debug_info=True)
    except SerializationError:
        return None


def document_key(document: Any) -> str:
    """The hex SHA-256 of a document's canonical JSON: the compile cache's keys."""
    return hashlib.sha256(canonical_json(document)).hexdigest()


def structure_key(backend: type[BackendDetails], unit: CompileUnit, identity: dict[str, str]) -> str | None:
    """What the compiled result depends on, but the weights' bytes; None if the sub-program holds
    what the key cannot cover (a delegate of an earlier stage): it is compiled uncached."""
    try:
        program = key_form(unit.program)
    except Unkeyable:
        return None
    described = {
        "format": FORMAT,
        "backend": backend.backend_id,
        "identity": identity,
        "torch": torch.__version__,
        "torchdelegate": __version__,
        "compile_specs": [[spec.key, spec.value.hex()] for spec in unit.compile_specs],
        "program": program,
    }
    return document_key(described)
