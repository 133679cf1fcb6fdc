"""node.meta["no_copy"]: a tagged constant that must live only in the delegate of its tag."""

from __future__ import annotations

from collections.abc import Mapping

import pytest
import torch
from backends_for_tests import TorchExportBackend
from models import SharedConstant, TwoLinears, aten, export
from programs import assert_unchanged, snapshot

from torchdelegate import (
    DELEGATION_TAG,
    NO_COPY,
    DelegationSpec,
    LoweredBackendModule,
    Partitioner,
    PartitionError,
    PartitionResult,
    to_backend,
)


class NoCopyPartitioner(Partitioner):
    """Tags nodes by name (``{node name: tag}``) and marks the constants named in ``no_copy``."""

    def __init__(self, tags: Mapping[str, str], no_copy: tuple[str, ...]) -> None:
        super().__init__(DelegationSpec(TorchExportBackend.backend_id))
        self.tags, self.no_copy = dict(tags), no_copy

    def partition(self, exported_program: torch.export.ExportedProgram) -> PartitionResult:
        for node in exported_program.graph.nodes:
            if node.name in self.tags:
                node.meta[DELEGATION_TAG] = self.tags[node.name]
            if node.name in self.no_copy:
                node.meta[NO_COPY] = True
        return PartitionResult(exported_program, dict.fromkeys(self.tags.values(), self.spec))


def test_a_no_copy_weight_read_only_by_its_partition_lives_only_in_its_delegate() -> None:
    model = TwoLinears()
    program = export(model, torch.randn(2, 4))
    computations = [n.name for n in program.graph.nodes if n.op == "call_function"]
    tags = dict.fromkeys([*computations, "p_l1_weight", "p_l1_bias"], "all")
    lowered = to_backend(program, NoCopyPartitioner(tags, no_copy=("p_l1_weight",)))
    (delegate,) = [m for m in lowered.graph_module.children() if isinstance(m, LoweredBackendModule)]
    assert "l1.weight" not in lowered.state_dict
    assert delegate.original_module.state_dict["l1.weight"] is program.state_dict["l1.weight"]
    x = torch.randn(2, 4)
    torch.testing.assert_close(lowered.module()(x), model(x))


def test_a_no_copy_weight_another_partition_reads_is_refused_naming_weight_method_tag_and_reader() -> None:
    program = export(SharedConstant(), torch.randn(2, 4))
    first, second = [n.name for n in program.graph.nodes if n.target is aten.mm.default]
    before = snapshot(program)
    partitioner = NoCopyPartitioner({first: "a", second: "b", "p_w": "a"}, no_copy=("p_w",))
    with pytest.raises(PartitionError) as caught:
        to_backend(program, partitioner)
    assert str(caught.value) == (
        f"method 'forward': parameter 'w' is marked no_copy, so it must live only in the delegate of its tag 'a', "
        f"but node {second!r} in partition 'b' reads it too; tag {second!r} with 'a', or remove "
        "node.meta['no_copy'] so that the program and the partitions that read it share it"
    )
    assert_unchanged(program, before)


def test_a_no_copy_weight_an_undelegated_node_reads_is_refused() -> None:
    program = export(SharedConstant(), torch.randn(2, 4))
    mms = [n.name for n in program.graph.nodes if n.target is aten.mm.default]
    partitioner = NoCopyPartitioner({mms[0]: "a", mms[1]: "a", "sigmoid": "a", "p_w": "a"}, no_copy=("p_w",))
    with pytest.raises(
        PartitionError, match=r"but node 'tanh' outside every partition reads it too; tag 'tanh' with 'a'"
    ):
        to_backend(program, partitioner)


def test_without_no_copy_the_same_weight_is_shared_by_both_partitions_and_the_program() -> None:
    model = SharedConstant()
    program = export(model, torch.randn(2, 4))
    first, second = [n.name for n in program.graph.nodes if n.target is aten.mm.default]
    lowered = to_backend(program, NoCopyPartitioner({first: "a", second: "b", "p_w": "a"}, no_copy=()))
    holders = [
        m.original_module.state_dict["w"]
        for m in lowered.graph_module.children()
        if isinstance(m, LoweredBackendModule)
    ]
    assert all(w is program.state_dict["w"] for w in [*holders, lowered.state_dict["w"]])
    x = torch.randn(2, 4)
    torch.testing.assert_close(lowered.module()(x), model(x))


class Writes(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("state", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.state.add_(x)
        return x


class Reads(Writes):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.state * x


def test_a_no_copy_buffer_another_method_writes_is_refused() -> None:
    x = torch.randn(4)
    programs = {"write": export(Writes(), x), "read": export(Reads(), x)}
    partitioner = NoCopyPartitioner({"mul": "a", "b_state": "a"}, no_copy=("b_state",))
    with pytest.raises(PartitionError) as caught:
        to_backend(programs, {"read": partitioner})
    assert str(caught.value) == (
        "method 'read': buffer 'state' is marked no_copy and tagged 'a', but another method writes it, so it is "
        "passed to the delegate as an input and cannot live only in it; remove node.meta['no_copy']"
    )
