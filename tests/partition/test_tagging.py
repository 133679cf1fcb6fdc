import torch
from models import KVCache, ReadThenWrite, SharedConstant, aten, export

from torchdelegate import DELEGATION_TAG, tag_constant_data, tag_mutated_buffers


def tags(program: torch.export.ExportedProgram) -> dict[str, str]:
    return {n.name: n.meta[DELEGATION_TAG] for n in program.graph.nodes if DELEGATION_TAG in n.meta}


def test_constants_are_tagged_only_when_every_user_is_tagged() -> None:
    program = export(SharedConstant(), torch.randn(3, 4))
    for node in program.graph.nodes:
        if node.target is aten.mm.default:
            node.meta[DELEGATION_TAG] = node.name
    tag_constant_data(program)
    assert "p_w" not in tags(program)  # tanh reads it untagged
    for node in program.graph.nodes:
        if node.target is aten.tanh.default:
            node.meta[DELEGATION_TAG] = "t"
    assert tag_constant_data(program) == ["w"]
    assert tags(program)["p_w"] == "mm"


def test_a_mutated_buffer_is_tagged_only_when_its_readers_and_update_share_one_tag() -> None:
    program = export(KVCache(), torch.randn(1, 4), torch.tensor([0]))
    for node in program.graph.nodes:
        if node.op == "call_function":
            node.meta[DELEGATION_TAG] = "t"
    tag_constant_data(program)
    assert "b_cache" not in tags(program)  # mutated buffers are left to tag_mutated_buffers
    assert tag_mutated_buffers(program) == ["cache"]
    assert tags(program)["b_cache"] == "t"

    program = export(ReadThenWrite(), torch.randn(4))
    for node in program.graph.nodes:
        if node.name in ("mul", "add"):
            node.meta[DELEGATION_TAG] = node.name  # the reader and the update in different partitions
    tag_mutated_buffers(program)
    assert "b_state" not in tags(program)
