"""Every bad partitioner result is a clear error, and the caller's program survives it."""

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from backends_for_tests import FunctionPartitioner, OpSetPartitioner
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
    load,
    lowered_modules,
    to_backend,
    to_edge,
    undelegated_nodes,
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


def _insert_after(p: torch.export.ExportedProgram, name: str, target: object, tag: str | None = None) -> torch.fx.Node:
    """Add ``target(<name>)`` after node ``name``, without any metadata, and route its users through it."""
    anchor = node(p, name)
    with p.graph.inserting_after(anchor):
        added = p.graph.call_function(target, (anchor,))  # type: ignore[arg-type]
    anchor.replace_all_uses_with(added, delete_user_cb=lambda user: user is not added)
    if tag is not None:
        added.meta[DELEGATION_TAG] = tag
    return added


def _computations(lowered: torch.export.ExportedProgram) -> list[torch.fx.Node]:
    """The program's undelegated nodes, then its delegates' nodes."""
    inside = [n for m in lowered_modules(lowered) for n in m.original_module.graph.nodes if n.op == "call_function"]
    return undelegated_nodes(lowered) + inside


def _with_negated_relu(program: torch.export.ExportedProgram, x: torch.Tensor) -> torch.Tensor:
    """What ``TwoLinears`` computes once ``-relu`` replaces ``relu``."""
    state = program.state_dict
    y = -torch.relu(torch.nn.functional.linear(x, state["l1.weight"], state["l1.bias"]))
    return torch.nn.functional.linear(torch.sigmoid(y), state["l2.weight"], state["l2.bias"]) + y


@pytest.mark.parametrize("tag", ["t", None], ids=["tagged", "untagged"])
def test_a_node_added_without_metadata_gets_its_value_and_the_program_runs(
    program: torch.export.ExportedProgram, tag: str | None, tmp_path: Path
) -> None:
    def add_neg(p: torch.export.ExportedProgram) -> None:
        tag_nodes("relu")(p)
        _insert_after(p, "relu", aten.neg.default, tag)

    before = snapshot(program)
    with validation_disabled():
        manager = to_edge(program).to_backend(Tagging(add_neg, {"t": SPEC}))
    assert_unchanged(program, before)
    lowered = manager.exported_program()
    (added,) = [n for n in _computations(lowered) if n.target == aten.neg.default]
    assert added.meta["val"].shape == (2, 4)
    x = torch.randn(2, 4)
    torch.testing.assert_close(lowered.module()(x), _with_negated_relu(program, x))
    manager.save(tmp_path / "changed.tdp")
    with load(tmp_path / "changed.tdp") as loaded:
        torch.testing.assert_close(loaded.run("forward", x), _with_negated_relu(program, x))


def test_a_node_added_before_the_output_with_dynamic_shapes_becomes_the_output() -> None:
    program = torch.export.export(TwoLinears(), (torch.randn(2, 4),), dynamic_shapes=({0: torch.export.Dim("b")},))

    def negate_the_result(p: torch.export.ExportedProgram) -> None:
        _insert_after(p, "add", aten.neg.default, "t")

    with validation_disabled():
        lowered = to_backend(program, Tagging(negate_the_result, {"t": SPEC}))
    (added,) = [n for n in _computations(lowered) if n.target == aten.neg.default]
    assert str(added.meta["val"].shape[0]) == str(node(program, "x").meta["val"].shape[0])
    x = torch.randn(5, 4)
    torch.testing.assert_close(lowered.module()(x), -program.module()(x))


def test_dead_nodes_added_without_metadata_are_dropped(program: torch.export.ExportedProgram) -> None:
    def add_dead_chain(p: torch.export.ExportedProgram) -> None:
        tag_nodes("relu")(p)
        anchor = node(p, "relu")
        with p.graph.inserting_after(anchor):
            cos = p.graph.call_function(aten.cos.default, (anchor,))
        with p.graph.inserting_after(cos):
            p.graph.call_function(aten.neg.default, (cos,))

    with validation_disabled():
        lowered = to_backend(program, Tagging(add_dead_chain, {"t": SPEC}))
    assert not {aten.cos.default, aten.neg.default} & {n.target for n in _computations(lowered)}
    x = torch.randn(2, 4)
    torch.testing.assert_close(lowered.module()(x), program.module()(x))


def test_a_changed_graph_that_cannot_be_completed_is_named(program: torch.export.ExportedProgram) -> None:
    def add_bad_mm(p: torch.export.ExportedProgram) -> None:
        mm = _insert_after(p, "relu", aten.mm.default)  # (2, 4) @ (2, 4)
        mm.args = (*mm.args, node(p, "x"))

    def add_python_sin(p: torch.export.ExportedProgram) -> None:
        _insert_after(p, "relu", torch.sin)

    def add_input(p: torch.export.ExportedProgram) -> None:
        with p.graph.inserting_before(node(p, "x")):
            extra = p.graph.placeholder("extra")
        extra.meta["val"] = node(p, "x").meta["val"]
        add = _insert_after(p, "relu", aten.add.Tensor)
        add.args = (*add.args, extra)

    def return_more(p: torch.export.ExportedProgram) -> None:
        output = p.graph.output_node()
        output.args = ((*output.args[0], node(p, "relu")),)

    for change, match in [
        (
            add_bad_mm,
            r"Tagging changed method 'forward' inside validation_disabled\(\): node call_function 'mm_default' "
            r"\(aten.mm.default\) it added has no meta\['val'\], and running its op .* failed",
        ),
        (add_python_sin, r"node 'sin' it added calls <built-in method sin .*not an ATen operator overload"),
        (
            add_input,
            r"validation_disabled\(\) and added input 'extra': the graph's inputs must stay",
        ),
        (return_more, r"validation_disabled\(\) and made it return 2 values where its signature lists 1"),
    ]:
        before = snapshot(program)
        with validation_disabled(), pytest.raises(GraphChangedError, match=match):
            to_backend(program, Tagging(change, {}))
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
    with pytest.raises(
        TypeError,
        match=r"expected a Partitioner or a DelegationSpec, got str; for the whole method on one backend: "
        r"DelegationSpec\('TestTorchExport'\)",
    ):
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
