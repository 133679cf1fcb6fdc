"""An ONNX model from a blob reaches nothing outside itself: the checks before ONNX Runtime sees it.

A blob is untrusted input. ONNX lets a tensor say its bytes live in a file (ONNX Runtime
reads a relative location from the loader's working directory), lets a node call an
operator from any domain (served by whatever custom-op library a session registered), and
ONNX Runtime can take session settings from a model's metadata. This backend supplies every
large initializer itself from named data, registers no custom-op library and never reads
settings from a model; so a model may hold external tensors only where the blob's header
says the backend supplies them, call only ONNX's, ONNX-ML's, ONNX Runtime's and its own
functions' operators, and carry no ``ort_config``. Anything else is a ``FormatError``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from torchdelegate.backends.onnxruntime.model_proto import EXTERNAL, Message, ModelProtoError, read_model
from torchdelegate.errors import FormatError

STANDARD_DOMAINS = frozenset({"", "ai.onnx", "ai.onnx.ml", "com.microsoft"})
_REFUSAL = "the blob was not written by this backend; do not run the file"


def confined_model(model_bytes: bytes, supplied: Mapping[str, tuple[str, int]], where: str) -> tuple[bytes, Message]:
    """The model's bytes and what was read of them, once checked; a ``FormatError`` if they would make
    ONNX Runtime read a file, load code or take settings from the model.

    ``supplied`` names the top-level initializers the backend gives the session itself, each with
    the in-memory file it is read from and that file's length; they alone may be stored outside
    the model, each as the whole of its own file. The bytes are read by ``model_proto``, which
    refuses anything protobuf could read otherwise, and sessions are told they are an ONNX model
    (``session.load_model_format``, settings.py), never another format hidden in the same bytes.
    """
    try:
        model = read_model(model_bytes)
    except ModelProtoError as e:
        raise FormatError(f"{where}: the ONNX model cannot be read ({e})") from None
    for entry in model.metadata_props:
        if entry.key == "ort_config":
            raise FormatError(f"{where}: the ONNX model carries session settings ('ort_config'); {_REFUSAL}")
    functions = {(f.domain, f.name) for f in model.functions}
    for opset in model.opset_import:
        if opset.domain not in STANDARD_DOMAINS and opset.domain not in {d for d, _ in functions}:
            raise FormatError(
                f"{where}: the ONNX model imports operator domain {opset.domain!r}, which only a custom-op "
                f"library would serve; {_REFUSAL}"
            )
    for place, tensor, top_level in _tensors(model):
        if tensor.data_location == EXTERNAL or len(tensor.external_data):
            fields = {e.key: e.value for e in tensor.external_data}
            location = fields.get("location", "")
            if top_level and tensor.name in supplied:
                _check_supplied(tensor.name, fields, supplied[tensor.name], where)
                continue
            raise FormatError(
                f"{where}: {place} {tensor.name!r} says its bytes are outside the model, at {location!r}; only "
                f"initializers the backend supplies from named data may be; {_REFUSAL}"
            )
    for place, node in _nodes(model):
        if node.domain not in STANDARD_DOMAINS and (node.domain, node.op_type) not in functions:
            raise FormatError(
                f"{where}: {place} calls {node.domain}.{node.op_type}, an operator neither ONNX, ONNX Runtime nor "
                f"the model's own functions define; {_REFUSAL}"
            )
    return model_bytes, model


def _check_supplied(name: str, fields: dict[str, str], file: tuple[str, int], where: str) -> None:
    """A supplied initializer reads all of its own in-memory file and nothing else."""
    location, length = file
    expected = {"location": location, "offset": "0", "length": str(length)}
    unknown = sorted(set(fields) - set(expected) - {"checksum"})
    wrong = [key for key in ("location", "offset", "length") if fields.get(key, expected[key]) != expected[key]]
    if unknown or wrong or "location" not in fields:
        raise FormatError(
            f"{where}: initializer {name!r} must be read from all of named data {location!r} ({length} bytes), "
            f"but its external data says {fields}; {_REFUSAL}"
        )


def _graphs(model: Any) -> Iterator[tuple[str, Any, bool]]:
    """Every graph and function body: (where, proto, is the top-level graph)."""
    yield "the graph", model.graph, True
    for function in model.functions:
        yield f"function {function.domain}.{function.name}", function, False
    for index, info in enumerate(model.training_info):
        yield f"training graph {index}", info.initialization, False
        yield f"training graph {index}", info.algorithm, False


def _nodes(model: Any) -> Iterator[tuple[str, Any]]:
    """Every node, sub-graphs (If, Loop, Scan bodies) included."""
    pending = [(where, graph) for where, graph, _ in _graphs(model)]
    while pending:
        where, graph = pending.pop()
        for node in graph.node:
            yield f"{where}: node {node.name!r}", node
            for attribute in node.attribute:
                pending.extend((f"{where}: node {node.name!r}, sub-graph", g) for g in _attribute_graphs(attribute))


def _attribute_graphs(attribute: Any) -> list[Any]:
    return ([attribute.g] if attribute.HasField("g") else []) + list(attribute.graphs)


def _tensors(model: Any) -> Iterator[tuple[str, Any, bool]]:
    """Every tensor a model holds: initializers, sparse ones, and tensors in attributes, at any depth."""
    pending = list(_graphs(model))
    while pending:
        where, graph, top_level = pending.pop()
        for tensor in getattr(graph, "initializer", ()):
            yield f"{where}: initializer", tensor, top_level
        for sparse in getattr(graph, "sparse_initializer", ()):
            yield f"{where}: sparse initializer", sparse.values, False
            yield f"{where}: sparse initializer indices", sparse.indices, False
        attributes = [a for node in graph.node for a in node.attribute]
        attributes += list(getattr(graph, "attribute_proto", ()))
        for attribute in attributes:
            tensors = ([attribute.t] if attribute.HasField("t") else []) + list(attribute.tensors)
            for sparse in ([attribute.sparse_tensor] if attribute.HasField("sparse_tensor") else []) + list(
                attribute.sparse_tensors
            ):
                tensors += [sparse.values, sparse.indices]
            for tensor in tensors:
                yield f"{where}: attribute {attribute.name!r} tensor", tensor, False
            pending.extend((f"{where}: sub-graph", g, False) for g in _attribute_graphs(attribute))
