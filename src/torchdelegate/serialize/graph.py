"""Residual graphs to and from torch.export's own JSON serializer, without tensors.

A graph's delegates are calls of the saved ``call_delegate`` operator (``call_delegate.py``); before
deserializing, every operator a node names and every symbolic expression is checked
against what a graph may contain (``allow_list.py``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any

import torch
from torch._export.serde import schema
from torch._export.serde.serialize import (
    EnumEncoder,
    ExportedProgramDeserializer,
    ExportedProgramSerializer,
    _dataclass_to_dict,
    _dict_to_dataclass,
)
from torch.export import ExportedProgram

from torchdelegate.errors import FormatError, SerializationError
from torchdelegate.exported.torch_warnings import loggers_quieted, torch_internal_warnings_silenced
from torchdelegate.serialize import call_delegate as _call_delegate  # noqa: F401 - registers the operator graphs call
from torchdelegate.serialize.allow_list import walk
from torchdelegate.serialize.graph_document import checked_document, state_names

# Node metadata that only helps a person debugging: stack traces and module paths are most of
# a graph's JSON (a few hundred bytes per node), so files carry them only when asked.
_DEBUG_METADATA = ("stack_trace", "nn_module_stack", "source_fn_stack", "torch_fn")


def unheld_input(program: ExportedProgram) -> str | None:
    """The first input of ``program`` that a file cannot hold (a script object, an effect token), or None."""
    for spec in program.graph_signature.input_specs:
        if spec.kind.name in ("CUSTOM_OBJ", "TOKEN"):
            return f"input {spec.arg.name!r} is a {spec.kind.name.lower()}"
    return None


def program_to_json(program: ExportedProgram, where: str, *, debug_info: bool = False) -> dict[str, Any]:
    """torch.export's serialized form of ``program`` (graph, signature, specs), without tensors.

    ``debug_info`` keeps each node's stack trace and module path.
    """
    unheld = unheld_input(program)
    if unheld is not None:
        raise SerializationError(f"{where}: {unheld}; torchdelegate files hold tensor state only")
    try:
        with torch_internal_warnings_silenced():
            serialized = ExportedProgramSerializer().serialize(
                program, serialize_state_dict=False, serialize_constants=False, serialize_example_inputs=False
            )
    except Exception as e:
        raise SerializationError(f"{where}: torch.export's serializer failed: {e}") from e
    # Enums to their values, exactly as torch writes its own JSON.
    document = json.loads(json.dumps(_dataclass_to_dict(serialized.exported_program), cls=EnumEncoder, allow_nan=False))
    # torch's reader drops export's guard code (inputs are checked by the program's signature here):
    # written as read, so a sub-program compiled on a worker gives the bytes it gives here.
    if "guards_code" in document:
        document["guards_code"] = []
    for key, value in walk(document):
        if key == "tensor_values" and isinstance(value, dict):
            for meta in value.values():
                # torch's reader makes each value's tensor anew (offset 0): write what a reader rebuilds,
                # so that a graph read and written again is the same bytes (a unit compiled on a worker).
                meta["storage_offset"] = {"as_int": 0}
        if key == "metadata" and isinstance(value, dict):
            # Provenance of passes, keyed by id() of in-memory graphs: neither stable nor useful in a file.
            value.pop("from_node", None)
            for name in () if debug_info else _DEBUG_METADATA:
                value.pop(name, None)
    return document


def program_from_json(
    document: Any, tensors: Mapping[str, torch.Tensor], where: str, plain_types: dict[str, str] | None = None
) -> ExportedProgram:
    """The program a :func:`program_to_json` document describes, reading ``tensors`` by name.

    The program holds the tensors themselves (parameters wrapped as Parameters, no copy). Input
    and output containers whose type this process has not registered are plain ones, each added
    to ``plain_types`` with the plain type it became (``tree_specs.with_plain_containers``, which
    also refuses specs whose reading would import); the document itself is not changed.
    """
    return deserialized(checked_document(document, tensors, where, plain_types), tensors, where)


def deserialized(document: Any, tensors: Mapping[str, torch.Tensor], where: str) -> ExportedProgram:
    """:func:`program_from_json` of a document ``graph_document.checked_document`` has checked already."""
    names = state_names(document)
    state_dict: dict[str, torch.Tensor] = {}
    constants: dict[str, torch.Tensor] = {}
    for name, kind in names.items():
        if kind == "parameter":
            state_dict[name] = torch.nn.Parameter(tensors[name], requires_grad=False)
        else:
            (state_dict if kind == "buffer" else constants)[name] = tensors[name]
    try:
        serialized = _dict_to_dataclass(schema.ExportedProgram, document)
        # a dynamic dimension whose only readers were delegated is logged as missing from the graph
        with torch_internal_warnings_silenced(), loggers_quieted(["torch._export.serde.serialize"], logging.ERROR):
            return ExportedProgramDeserializer().deserialize(serialized, state_dict, constants, None)
    except FormatError:
        raise
    except Exception as e:
        raise FormatError(f"{where}: torch.export cannot read this graph ({type(e).__name__}: {e})") from e
