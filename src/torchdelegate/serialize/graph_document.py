"""A saved graph's JSON document checked before either reader reads it, and the state it names.

Two readers take a method's graph from a file: ``residual_graph.py`` (straight into a torch.fx graph)
and ``graph.py`` (torch.export's own deserializer, for control flow and older documents). Both run
:func:`checked_document` first, so a document is refused the same way whichever reads it: what a
graph may not hold and operators this process lacks (``allow_list.py``), container types made plain
(``tree_specs.py``), and state the file does not store. :func:`state_names` reads the parameters,
buffers and constants a document's signature names, with their kinds.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from torchdelegate.errors import FormatError, OperatorNotFoundError
from torchdelegate.serialize.allow_list import check_graph_document, namespace_of, unregistered_operators
from torchdelegate.serialize.call_plan import STATE_FIELDS
from torchdelegate.serialize.tree_specs import with_plain_containers

if TYPE_CHECKING:
    import torch


def checked_document(
    document: Any, tensors: Mapping[str, torch.Tensor], where: str, plain_types: dict[str, str] | None
) -> Any:
    """``document`` with unregistered container types made plain, after refusing what a graph may not
    hold, operators this process lacks, and state the file does not store."""
    missing_operators = unregistered_operators(check_graph_document(document, where))
    if missing_operators:
        namespaces = sorted({namespace_of(target) for target in missing_operators})
        raise OperatorNotFoundError(
            f"{where}: the graph calls {', '.join(missing_operators)}, which this process has not registered "
            f"(the file itself is sound); import the library that defines the "
            f"{', '.join(map(repr, namespaces))} operators before loading"
        )
    document = with_plain_containers(document, where, {} if plain_types is None else plain_types)
    missing = sorted(set(state_names(document)) - set(tensors))
    if missing:
        raise FormatError(f"{where}: the graph reads {', '.join(map(repr, missing))}, which are not stored")
    return document


def state_names(document: Any) -> dict[str, str]:
    """Each parameter, buffer and constant a serialized program reads, with its kind: "parameter",
    "buffer" (persistent) or "constant" (tensor constants and non-persistent buffers)."""
    module = document.get("graph_module") if isinstance(document, dict) else None
    signature = module.get("signature") if isinstance(module, dict) else None
    specs = signature.get("input_specs") if isinstance(signature, dict) else None
    names: dict[str, str] = {}
    for spec in specs if isinstance(specs, list) else []:
        for kind, field in STATE_FIELDS.items():
            entry = spec.get(kind) if isinstance(spec, dict) else None
            if isinstance(entry, dict) and isinstance(entry.get(field), str):
                persistent = kind != "buffer" or entry.get("persistent") is not False
                names[entry[field]] = kind if kind != "tensor_constant" and persistent else "constant"
    return names
