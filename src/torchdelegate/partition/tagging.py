"""Helpers partitioners call after tagging computations: who takes the weights and the state.

A tagged parameter, buffer or constant is carried inside every partition that uses it
(its storage shared, never copied); an untagged one stays with the program and is passed
to delegates as an input. A tagged buffer that the program mutates is owned by its
partition: every reader and the update must carry that tag.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch.export import ExportedProgram
from torch.fx import Node

from torchdelegate.exported.programs import DELEGATION_TAG
from torchdelegate.partition.contract import tags_in


def _state_placeholders(program: ExportedProgram) -> dict[str, str]:
    """Placeholder name -> FQN, for parameters, buffers and lifted constants."""
    signature = program.graph_signature
    return {
        **signature.inputs_to_parameters,
        **signature.inputs_to_buffers,
        **signature.inputs_to_lifted_tensor_constants,
    }


def _tags_of(users: list[Node]) -> list[str | None]:
    return [user.meta.get(DELEGATION_TAG) for user in users]


def tag_constant_data(program: ExportedProgram) -> list[str]:
    """Tag each parameter/constant (and unmutated buffer) whose users are all tagged.

    It takes its first user's tag; as with any tagged constant, every partition that reads
    it carries it inside. Mutated buffers are left to :func:`tag_mutated_buffers`. Returns
    the FQNs tagged.
    """
    constants = constant_data_tags(program, tags_in(program.graph.nodes))
    state = _state_placeholders(program)
    for node, tag in constants.items():
        node.meta[DELEGATION_TAG] = tag
    return [state[node.name] for node in constants]


def constant_data_tags(program: ExportedProgram, tags: Mapping[Node, str]) -> dict[Node, str]:
    """The tags :func:`tag_constant_data` gives the state placeholders when the computations carry
    ``tags``, without tagging anything (``program`` is only read)."""
    mutated = set(program.graph_signature.buffers_to_mutate.values())
    state = _state_placeholders(program)
    found: dict[Node, str] = {}
    for node in program.graph.nodes:
        if node.op != "placeholder" or node.name not in state or state[node.name] in mutated:
            continue
        users = [tags.get(user) for user in node.users]
        first = users[0] if users else None
        if first is not None and None not in users:
            found[node] = first
    return found


def tag_mutated_buffers(program: ExportedProgram) -> list[str]:
    """Tag each mutated buffer whose readers and update all carry one tag, so that delegate owns it.

    Returns the FQNs tagged. Buffers are mutated only in functional programs (after
    ``run_decompositions()``): in-place ops elsewhere are not seen as mutations.
    """
    tagged = []
    signature = program.graph_signature
    updates = {fqn: name for name, fqn in signature.buffers_to_mutate.items()}
    producers = {node.name: node for node in program.graph.nodes}
    for node in program.graph.nodes:
        fqn = signature.inputs_to_buffers.get(node.name) if node.op == "placeholder" else None
        if fqn is None or fqn not in updates:
            continue
        update = producers.get(updates[fqn])
        tags = {*_tags_of(list(node.users)), update.meta.get(DELEGATION_TAG) if update is not None else None}
        if len(tags) == 1 and None not in tags:
            node.meta[DELEGATION_TAG] = tags.pop()
            tagged.append(fqn)
    return tagged
