"""Several partitions' ONNX models as one model whose branches they are.

ONNX Runtime packs a weight for its matrix products once per session, and the Python API
offers no way to share packed weights between sessions. So the partitions of a lowering
that run with the same session options become the branches of one model: a selector input
(an int64 scalar) picks the branch, and the one session packs each weight once for every
method, ``prefill`` and ``decode`` alike.

Each partition is the ``then`` branch of its own ``If`` node, all at the model's top level
(``If(selector == i)``): a kernel inside a branch finds a weight to pack only in the graph
right above it, so branches are never nested. The ``else`` branch returns empty tensors of
the partition's output types. One partition alone (methods whose partitions are equal, an
LLM's ``prefill`` and ``decode``) is no ``If`` but the model itself, named as its branch, and
has no selector. Each branch keeps its partition's nodes and small initializers, under names
prefixed by its index (``p3/...``; names the combination adds are ``p3:...``), and reads its
inputs from model inputs of the same prefixed names; the partitions' external initializers
(the weights, kept as named data) become top-level initializers, one per distinct (named
data, dtype, shape), that every branch reads. A caller feeds the selected branch's inputs
and anything (zeros) to the others, which no branch that runs reads, and fetches the
selected branch's outputs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

SELECTOR = "torchdelegate.branch"


@dataclass(frozen=True)
class Branch:
    """Where one partition sits in the combined model: the names of its inputs and outputs there, in order."""

    inputs: list[str]
    outputs: list[str]


class CombineError(ValueError):
    """The models cannot be branches of one model (their operator sets or functions disagree, or
    one returns something other than a tensor)."""


def combined_model(onnx: Any, models: Sequence[bytes], external: Sequence[dict[str, str]]) -> tuple[Any, list[Branch]]:
    """One ``ModelProto`` whose branch ``i`` computes ``models[i]``, and where each branch sits.

    ``external[i]`` maps each of model ``i``'s external initializers to the shared name it
    takes in the combined model (equal names for equal data, dtype and shape); those
    initializers are taken from the first model that has them. ``onnx`` is the imported
    package. A ``CombineError`` if the models import different versions of one operator
    domain, define one function differently, or return something other than tensors.
    """
    protos = [onnx.ModelProto.FromString(model) for model in models]
    graph = onnx.GraphProto(name="torchdelegate_branches")
    alone = len(protos) == 1
    if not alone:
        graph.input.append(onnx.helper.make_tensor_value_info(SELECTOR, onnx.TensorProto.INT64, []))
    shared: dict[str, Any] = {}
    branches = []
    for index, (proto, names) in enumerate(zip(protos, external, strict=True)):
        inputs = [_renamed(value, branch_name(index, value.name)) for value in proto.graph.input]
        graph.input.extend(inputs)
        for tensor in proto.graph.initializer:
            if tensor.name in names and names[tensor.name] not in shared:
                shared[names[tensor.name]] = _renamed(tensor, names[tensor.name])
        if alone:
            nodes, outputs = _alone(onnx, graph, proto.graph, names)
        else:
            nodes, outputs = _branch(onnx, proto.graph, index, names)
        graph.node.extend(nodes)
        graph.output.extend(outputs)
        branches.append(Branch([v.name for v in inputs], [v.name for v in outputs]))
    graph.initializer.extend(shared[name] for name in sorted(shared))
    _hoist_conversions(onnx, graph, set(shared))
    model = onnx.helper.make_model(graph, opset_imports=_opsets(onnx, protos), producer_name="torchdelegate")
    model.ir_version = max(proto.ir_version for proto in protos)
    model.functions.extend(_functions(protos))
    return model, branches


def _hoist_conversions(onnx: Any, graph: Any, weights: set[str]) -> None:
    """Each ``Cast`` of a shared weight that branches make (bfloat16 weights read as float) made once, at
    the top level, and read from there by every branch: ONNX Runtime folds a constant once per graph,
    so a conversion in every branch would be a folded copy per branch."""
    made: dict[tuple[str, int], str] = {}
    hoisted = []
    for node in graph.node:
        leaf = next((a.g for a in node.attribute if a.name == "then_branch"), None) if node.op_type == "If" else None
        if leaf is None:
            continue
        returned = {value.name for value in leaf.output}
        renamed: dict[str, str] = {}
        kept = []
        for inner in leaf.node:
            to: int = next((int(a.i) for a in inner.attribute if a.name == "to"), -1)
            converts = inner.op_type == "Cast" and inner.domain in ("", "ai.onnx") and to >= 0
            if not (
                converts and len(inner.input) == 1 and inner.input[0] in weights and inner.output[0] not in returned
            ):
                kept.append(inner)
                continue
            key = (inner.input[0], to)
            if key not in made:
                made[key] = name = f"shared:{inner.input[0]}:as{to}"
                hoisted.append(onnx.helper.make_node("Cast", [inner.input[0]], [name], name=name, to=to))
            renamed[inner.output[0]] = made[key]
        if renamed:
            del leaf.node[:]
            leaf.node.extend(kept)
            _read_from(leaf, renamed)
            kept_info = [value for value in leaf.value_info if value.name not in renamed]
            del leaf.value_info[:]
            leaf.value_info.extend(kept_info)
    if hoisted:
        nodes = list(graph.node)
        del graph.node[:]
        graph.node.extend([*hoisted, *nodes])


def _read_from(graph: Any, renamed: dict[str, str]) -> None:
    """Every node of ``graph`` and its sub-graphs reads ``renamed[name]`` where it read ``name``."""
    for node in graph.node:
        node.input[:] = [renamed.get(name, name) for name in node.input]
        for attribute in node.attribute:
            if attribute.HasField("g"):
                _read_from(attribute.g, renamed)
            for sub in attribute.graphs:
                _read_from(sub, renamed)


def _kind(value: Any) -> tuple[int, int | None]:
    """A value's element type and rank (None when unknown)."""
    if not value.type.HasField("tensor_type"):
        raise CombineError(f"output {value.name!r} is not a tensor")
    tensor = value.type.tensor_type
    return tensor.elem_type, (len(tensor.shape.dim) if tensor.HasField("shape") else None)


def _output_info(onnx: Any, name: str, kind: tuple[int, int | None]) -> Any:
    element, rank = kind
    return onnx.helper.make_tensor_value_info(name, element, None if rank is None else [None] * rank)


def _branch(onnx: Any, graph: Any, index: int, external: dict[str, str]) -> tuple[list[Any], list[Any]]:
    """The nodes that run partition ``index`` when the selector is ``index``, and the model outputs they make."""
    kinds = [_kind(value) for value in graph.output]
    outputs = [_output_info(onnx, f"p{index}:result{number}", kind) for number, kind in enumerate(kinds)]
    unused = onnx.GraphProto(name=f"p{index}_unused")
    for number, kind in enumerate(kinds):
        name = f"p{index}:empty{number}"
        unused.node.append(_empty(onnx, name, kind))
        unused.output.append(_output_info(onnx, name, kind))
    selected, chosen = f"p{index}:selector", f"p{index}:chosen"
    return [
        onnx.helper.make_node("Constant", [], [selected], name=selected, value=_scalar(onnx, selected, index)),
        onnx.helper.make_node("Equal", [SELECTOR, selected], [chosen], name=chosen),
        onnx.helper.make_node(
            "If",
            [chosen],
            [output.name for output in outputs],
            name=f"p{index}:branch",
            then_branch=_leaf(onnx, graph, index, external, kinds),
            else_branch=unused,
        ),
    ], outputs


def _alone(onnx: Any, top: Any, graph: Any, external: dict[str, str]) -> tuple[list[Any], list[Any]]:
    """The one partition's nodes at the top level, named as branch 0's (no ``If``: a sub-graph costs every
    call of the model the run of a nested graph), and the model outputs they make; its small
    initializers and value types join ``top``."""
    leaf = _leaf(onnx, graph, 0, external, [_kind(value) for value in graph.output])
    top.initializer.extend(leaf.initializer)
    top.sparse_initializer.extend(leaf.sparse_initializer)
    top.value_info.extend(leaf.value_info)
    top.quantization_annotation.extend(leaf.quantization_annotation)
    return list(leaf.node), list(leaf.output)


def _scalar(onnx: Any, name: str, value: int) -> Any:
    return onnx.helper.make_tensor(name, onnx.TensorProto.INT64, [], [value])


def _renamed(proto: Any, name: str) -> Any:
    """A copy of a named proto (a graph input, an initializer) under ``name``."""
    renamed = type(proto)()
    renamed.CopyFrom(proto)
    renamed.name = name
    return renamed


def branch_name(index: int, name: str) -> str:
    """What a value or node of partition ``index`` is named in the model its branch joined."""
    return f"{branch_prefix(index)}{name}" if name else name


def branch_prefix(index: int) -> str:
    """What begins the name of every value and node of partition ``index`` in the model its branch joined."""
    return f"p{index}/"


def _leaf(onnx: Any, graph: Any, index: int, external: dict[str, str], kinds: list[tuple[int, int | None]]) -> Any:
    """Partition ``index``'s graph as a branch: its values renamed, its outputs returned in order."""
    rename = _renamer(index, external)
    leaf = onnx.GraphProto()
    leaf.CopyFrom(graph)
    leaf.name = f"p{index}_selected"
    del leaf.input[:]
    del leaf.output[:]
    local = [t for t in leaf.initializer if t.name not in external]
    del leaf.initializer[:]
    leaf.initializer.extend(local)
    _rename_graph(leaf, rename)
    produced = {output for node in leaf.node for output in node.output}
    returned: set[str] = set()
    for number, (value, kind) in enumerate(zip(graph.output, kinds, strict=True)):
        name = rename(value.name)
        if name not in produced or name in returned:  # an input, an initializer, or returned twice
            copy = f"p{index}:out{number}"
            leaf.node.append(onnx.helper.make_node("Identity", [name], [copy], name=copy))
            name = copy
        returned.add(name)
        leaf.output.append(_output_info(onnx, name, kind))
    return leaf


def _empty(onnx: Any, name: str, kind: tuple[int, int | None]) -> Any:
    """A constant empty tensor of ``kind`` (a one-element zero for a scalar): an output of a branch not taken."""
    element, rank = kind
    rank = 1 if rank is None else rank
    shape = [0] * rank
    tensor = onnx.helper.make_tensor(name, element, shape, vals=[0] if rank == 0 else [])
    return onnx.helper.make_node("Constant", [], [name], name=name, value=tensor)


def _renamer(index: int, external: dict[str, str]) -> Any:
    def rename(name: str) -> str:
        return external.get(name) or branch_name(index, name)

    return rename


def _rename_graph(graph: Any, rename: Any) -> None:
    """Every value and node name of ``graph`` and its sub-graphs through ``rename``, in place."""
    for tensor in graph.initializer:
        tensor.name = rename(tensor.name)
    for sparse in graph.sparse_initializer:
        sparse.values.name = rename(sparse.values.name)
        sparse.indices.name = rename(sparse.indices.name)
    for value in (*graph.input, *graph.output, *graph.value_info):
        value.name = rename(value.name)
    for annotation in graph.quantization_annotation:
        annotation.tensor_name = rename(annotation.tensor_name)
    for node in graph.node:
        node.name = rename(node.name) if node.name else node.name
        node.input[:] = [rename(name) for name in node.input]
        node.output[:] = [rename(name) for name in node.output]
        for attribute in node.attribute:
            if attribute.HasField("g"):
                _rename_graph(attribute.g, rename)
            for sub in attribute.graphs:
                _rename_graph(sub, rename)


def _opsets(onnx: Any, protos: list[Any]) -> list[Any]:
    """The operator sets every model imports, each domain at the one version they share."""
    versions: dict[str, int] = {"": 0}
    for proto in protos:
        for opset in proto.opset_import:
            known = versions.get(opset.domain)
            if known and known != opset.version:
                raise CombineError(
                    f"the partitions import operator domain {opset.domain!r} at versions {known} and {opset.version}"
                )
            versions[opset.domain] = opset.version
    if not versions[""]:
        versions[""] = 13  # If, and Equal on int64, for models that import no standard operator
    return [onnx.helper.make_opsetid(domain, version) for domain, version in sorted(versions.items())]


def _functions(protos: list[Any]) -> list[Any]:
    """The model-local functions of every model, once each; one name defined two ways is a ``CombineError``."""
    functions: dict[tuple[str, str, str], Any] = {}
    for proto in protos:
        for function in proto.functions:
            key = (function.domain, function.name, getattr(function, "overload", ""))
            known = functions.get(key)
            if known is not None and known.SerializeToString() != function.SerializeToString():
                raise CombineError(f"the partitions define function {key[0]}.{key[1]} differently")
            functions[key] = function
    return [functions[key] for key in sorted(functions)]
