"""Which outputs of a model ONNX Runtime may write over one of its inputs: a KV cache updated in place.

A static KV cache reaches a partition as an input (the buffer) and leaves it as an output (the
buffer with this call's positions written), which the runtime then copies back into the buffer:
a cache-sized write and copy per layer and per token. When the runtime donates the buffer (it
replaces the buffer with that output and nothing else reads it, see
``BackendDetails.accept_donated_inputs``), the session can write the output straight into the
buffer's memory, through IO binding, and nothing is copied.

That is only sound where the model reads the input once, in the operator that makes the output
from it: a ``ScatterND`` whose data is the input (ONNX Runtime's kernel copies nothing when the
two share memory, and writes only the scattered positions), or ``GroupQueryAttention``, whose
present keys and values are its past ones with the new tokens appended (given one buffer for
both, it appends in place). This module finds those pairs, in
a model of one partition and in a model whose branches (``If`` nodes) are partitions; any other
shape of graph gets none, and the output is copied as before.

An input the model never reads (a counter the program keeps beside the cache, whose new value is
computed from another input) may take any output the program replaces it with: nothing reads the
memory the output is written into (``unread_inputs``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

_STANDARD = ("", "ai.onnx")


def in_place_outputs(
    model: Any, branches: list[tuple[list[str], list[str]]], selector: str | None
) -> list[dict[int, int]]:
    """For each branch, ``{output position: input position}`` of the outputs that may be written
    into that input's memory. ``model`` is the parsed ``ModelProto``."""
    graph = model.graph
    reads = Counter(name for node in _all_nodes(graph) for name in node.input if name)
    returned = Counter(value.name for value in graph.output)
    producers = {output: node for node in graph.node for output in node.output}
    taken: dict[str, dict[str, Any]] = {}  # per If (by its first output), its taken branch's producers
    found = []
    for inputs, outputs in branches:
        positions = {name: index for index, name in enumerate(inputs)}
        pairs = {}
        for k, output in enumerate(outputs):
            data = _written_input(producers, output, selector is not None, taken)
            if data in positions and reads[data] == 1 and returned[output] == 1 and data not in returned:
                pairs[k] = positions[data]
        found.append(pairs)
    return found


def unread_inputs(model: Any, branches: list[tuple[list[str], list[str]]]) -> list[frozenset[int]]:
    """For each branch, the positions of the inputs no node of ``model`` reads, at any depth."""
    reads = Counter(name for node in _all_nodes(model.graph) for name in node.input if name)
    returned = {value.name for value in model.graph.output}
    return [
        frozenset(j for j, name in enumerate(inputs) if not reads[name] and name not in returned)
        for inputs, _ in branches
    ]


def _written_input(
    producers: dict[str, Any], output: str, branched: bool, taken: dict[str, dict[str, Any]]
) -> str | None:
    """The input ``output`` is written over, looking into the taken branch of an ``If``: a ``ScatterND``'s
    data, or the cache ``GroupQueryAttention`` appends to (its present keys and values). ``taken`` keeps
    each ``If``'s branch producers once found."""
    node = producers.get(output)
    if node is not None and branched and node.op_type == "If" and node.domain in _STANDARD:
        branch = next((a.g for a in node.attribute if a.name == "then_branch"), None)
        if branch is None:
            return None
        position = list(node.output).index(output)
        if position >= len(branch.output):
            return None
        output = branch.output[position].name
        if node.output[0] not in taken:
            taken[node.output[0]] = {name: n for n in branch.node for name in n.output}
        node = taken[node.output[0]].get(output)
    if node is None:
        return None
    if node.op_type == "GroupQueryAttention" and node.domain == "com.microsoft":
        position = list(node.output).index(output)
        return str(node.input[position + 2]) if position in (1, 2) and len(node.input) > position + 2 else None
    if node.op_type != "ScatterND" or node.domain not in _STANDARD:
        return None
    if any(a.name == "reduction" and a.s not in (b"", b"none") for a in node.attribute):
        return None
    return str(node.input[0])


def _all_nodes(graph: Any) -> Iterator[Any]:
    """Every node of ``graph`` and of the graphs its nodes hold, at any depth."""
    for node in graph.node:
        yield node
        for attribute in node.attribute:
            if attribute.HasField("g"):
                yield from _all_nodes(attribute.g)
            for sub in attribute.graphs:
                yield from _all_nodes(sub)
