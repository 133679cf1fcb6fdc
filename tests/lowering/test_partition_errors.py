"""Every bad partitioner result is a clear error, and the caller's program survives it."""

from collections.abc import Callable

import pytest
import torch
from backends import FunctionPartitioner, OpSetPartitioner
from models import LINEAR_OPS, KVCache, ReadThenWrite, TwoLinears, aten, export
from programs import assert_unchanged, snapshot

from torchdelegate import (
    DELEGATION_TAG,
    BackendDetails,
    BackendNotFoundError,
    DelegationSpec,
    GraphChangedError,
    Partitioner,
    PartitionError,
    PartitionResult,
    PreprocessError,
    PreprocessResult,
    TorchDelegateError,
    to_backend,
    validation_disabled,
)


class Tagging(Partitioner):
    """Runs ``tag(program)`` and returns ``tags``."""

    def __init__(self, tag: Callable[[torch.export.ExportedProgram], None], tags: dict) -> None:
        self.tag, self.tags = tag, tags

    def partition(self, exported_program: torch.export.ExportedProgram) -> PartitionResult:
        self.tag(exported_program)
        return PartitionResult(exported_program, self.tags)


SPEC = DelegationSpec("TestTorchExport")


def node(program: torch.export.ExportedProgram, name: str) -> torch.fx.Node:
    return next(n for n in program.graph.nodes if n.name == name)


def tag_nodes(*names: str, tag: object = "t") -> Callable[[torch.export.ExportedProgram], None]:
    def apply(program: torch.export.ExportedProgram) -> None:
        for name in names:
            node(program, name).meta[DELEGATION_TAG] = tag

    return apply


@pytest.fixture
def program() -> torch.export.ExportedProgram:
    return export(TwoLinears(), torch.randn(2, 4))


def check_fails(program: torch.export.ExportedProgram, partitioner: object, error: type, match: str) -> None:
    before = snapshot(program)
    with pytest.raises(error, match=match):
        to_backend(program, partitioner)
    assert_unchanged(program, before)


def test_a_tag_missing_from_partition_tags(program: torch.export.ExportedProgram) -> None:
    check_fails(
        program,
        Tagging(tag_nodes("relu", tag="ghost"), {"t": SPEC}),
        PartitionError,
        r"node 'relu' is tagged 'ghost', which is not in the partitioner's partition_tags \(known tags: 't'\)",
    )


def test_a_tag_that_is_not_a_string(program: torch.export.ExportedProgram) -> None:
    check_fails(
        program, Tagging(tag_nodes("relu", tag=3), {"t": SPEC}), PartitionError, "delegation tag 3 that is not a str"
    )


def test_a_tagged_output_node(program: torch.export.ExportedProgram) -> None:
    check_fails(
        program, Tagging(tag_nodes("output"), {"t": SPEC}), PartitionError, "the output node 'output' is tagged 't'"
    )


def test_a_tagged_user_input(program: torch.export.ExportedProgram) -> None:
    check_fails(program, Tagging(tag_nodes("x", "relu"), {"t": SPEC}), PartitionError, "user input 'x' is tagged 't'")


def test_a_partition_that_would_make_a_cycle_names_the_tag_and_a_node_on_the_path(
    program: torch.export.ExportedProgram,
) -> None:
    # relu -> sigmoid (untagged) -> addmm_1 -> add; relu -> add: fusing relu and add loops through sigmoid.
    check_fails(
        program,
        Tagging(tag_nodes("relu", "add"), {"t": SPEC}),
        PartitionError,
        r"partition 't' cannot be fused .* node '(sigmoid|addmm_1)' outside it",
    )


def test_tags_without_nodes_are_skipped(program: torch.export.ExportedProgram) -> None:
    lowered = to_backend(program, Tagging(tag_nodes("relu"), {"t": SPEC, "unused": SPEC}))
    assert [n.target for n in lowered.graph.nodes if n.op == "get_attr"] == ["lowered_module_0"]


def test_a_partitioner_that_changes_the_graph(program: torch.export.ExportedProgram) -> None:
    def rewrite(p: torch.export.ExportedProgram) -> None:
        relu = node(p, "relu")
        relu.target = aten.gelu.default
        relu.meta[DELEGATION_TAG] = "t"

    check_fails(
        program,
        Tagging(rewrite, {"t": SPEC}),
        GraphChangedError,
        r"changed the graph it may only tag: method 'forward': node call_function 'relu' \(aten.relu.default\) became",
    )

    def add_node(p: torch.export.ExportedProgram) -> None:
        with p.graph.inserting_after(node(p, "relu")):
            p.graph.call_function(aten.neg.default, (node(p, "relu"),))

    check_fails(program, Tagging(add_node, {}), GraphChangedError, "was added")


def test_validation_disabled_lowers_what_the_partitioner_returned(program: torch.export.ExportedProgram) -> None:
    def relu_to_gelu(p: torch.export.ExportedProgram) -> None:
        relu = node(p, "relu")
        relu.target = aten.gelu.default
        relu.meta[DELEGATION_TAG] = "t"

    before = snapshot(program)
    with validation_disabled():
        lowered = to_backend(program, Tagging(relu_to_gelu, {"t": SPEC}))
    (delegate,) = [m for n, m in lowered.graph_module.named_children() if n.startswith("lowered_module")]
    assert [n.target for n in delegate.original_module.graph.nodes if n.op == "call_function"] == [aten.gelu.default]
    assert_unchanged(program, before)


def test_a_partitioner_that_returns_something_else(program: torch.export.ExportedProgram) -> None:
    class ReturnsProgram(Partitioner):
        def partition(self, exported_program):  # type: ignore[no-untyped-def]
            return exported_program

    check_fails(
        program,
        ReturnsProgram(),
        PartitionError,
        "ReturnsProgram returned ExportedProgram .* expected a PartitionResult",
    )
    check_fails(
        program,
        Tagging(tag_nodes("relu"), {"t": "TestTorchExport"}),
        PartitionError,
        r"partition_tags\['t'\] is a str, expected a DelegationSpec",
    )


def test_a_partitioner_that_raises_is_named_and_chained(program: torch.export.ExportedProgram) -> None:
    class Broken(Partitioner):
        def partition(self, exported_program):  # type: ignore[no-untyped-def]
            raise KeyError("no such op")

    with pytest.raises(PartitionError, match="partitioner Broken failed on method 'forward'") as info:
        to_backend(program, Broken())
    assert isinstance(info.value.__cause__, KeyError)


def test_not_a_partitioner(program: torch.export.ExportedProgram) -> None:
    with pytest.raises(TypeError, match="expected a Partitioner or a DelegationSpec, got str"):
        to_backend(program, "TestTorchExport")  # type: ignore[call-overload]
    with pytest.raises(TypeError, match="must be a backend id"):
        to_backend(3, program)  # type: ignore[call-overload]


def test_a_delegated_buffer_read_outside_its_partition() -> None:
    program = export(ReadThenWrite(), torch.randn(4))
    check_fails(
        program,
        Tagging(tag_nodes("b_state", "add"), {"t": SPEC}),
        PartitionError,
        "buffer 'state' is tagged 't' and mutated there, but node 'mul' outside the partition reads it",
    )


def test_a_delegated_buffer_updated_outside_its_partition() -> None:
    program = export(KVCache(), torch.randn(1, 4), torch.tensor([0]))
    check_fails(
        program,
        Tagging(tag_nodes("b_cache", "mul"), {"t": SPEC}),
        PartitionError,
        "buffer 'cache' is tagged 't', so its partition would own its state, but its new value "
        "'index_put' is computed outside",
    )


def test_a_backend_failing_halfway_leaves_the_caller_unchanged(program: torch.export.ExportedProgram) -> None:
    class FailsOnSecond(BackendDetails):
        backend_id = "TestFailsOnSecond"
        count = 0

        @staticmethod
        def preprocess(edge_program, compile_specs):  # type: ignore[no-untyped-def]
            FailsOnSecond.count += 1
            if FailsOnSecond.count == 2:
                raise ValueError("second partition unsupported")
            return PreprocessResult(b"ok")

    before = snapshot(program)
    with pytest.raises(
        PreprocessError, match=r"'TestFailsOnSecond' failed to preprocess partition 'tag1' of method 'forward'"
    ):
        to_backend(program, OpSetPartitioner(LINEAR_OPS, backend_id="TestFailsOnSecond"))
    assert_unchanged(program, before)
    # And the program is still usable.
    lowered = to_backend(program, OpSetPartitioner(LINEAR_OPS))
    x = torch.randn(2, 4)
    torch.testing.assert_close(lowered.module()(x), program.module()(x))


def test_every_error_is_a_torchdelegate_error() -> None:
    for error in (PartitionError, GraphChangedError, PreprocessError):
        assert issubclass(error, TorchDelegateError)
    _ = FunctionPartitioner


def test_a_partition_writing_in_place_into_its_input_asks_for_a_functional_program() -> None:
    program = torch.export.export(KVCache(), (torch.randn(1, 4), torch.tensor([0])))  # not decomposed
    assert any(n.target is aten.index_copy_.default for n in program.graph.nodes)
    check_fails(
        program,
        Tagging(tag_nodes("index_copy_"), {"t": SPEC}),
        PartitionError,
        r"node 'index_copy_' in partition 't' writes in place into 'b_cache'.*run_decompositions\(\) first",
    )


def test_passing_the_partitioner_class_says_to_pass_an_instance(program: torch.export.ExportedProgram) -> None:
    with pytest.raises(TypeError, match=r"got the class OpSetPartitioner; pass an instance: OpSetPartitioner\(...\)"):
        to_backend(program, OpSetPartitioner)  # type: ignore[call-overload]


def test_partition_tags_that_are_not_a_dict(program: torch.export.ExportedProgram) -> None:
    check_fails(program, Tagging(tag_nodes("relu"), None), PartitionError, "partition_tags is a NoneType")  # type: ignore[arg-type]


def test_an_unknown_backend_on_a_tag_names_the_tag_and_method(program: torch.export.ExportedProgram) -> None:
    check_fails(
        program,
        Tagging(tag_nodes("relu"), {"t": DelegationSpec("NoSuchBackend")}),
        BackendNotFoundError,
        r"partition 't' of method 'forward': no backend with id 'NoSuchBackend'",
    )
