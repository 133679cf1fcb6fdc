"""GroupBasedPartitioner and the partitions-from-lists helpers: ExecuTorch's group contract on our engine.

Groups in, torch.fx partitions out: each group's supported nodes in one partition, the rest merged
around them, groups that cannot be one partition refused with the node that stands in the way.
"""

from __future__ import annotations

import copy
import operator
import os

import pytest
import torch
from hypothesis import HealthCheck, given, reject, settings
from hypothesis import strategies as st
from models import aten, export
from random_programs import Recipe, RecipeModule, recipes
from torch.fx import GraphModule, Node
from torch.fx.passes.infra.partitioner import Partition
from torch.fx.passes.operator_support import OperatorSupportBase

import torchdelegate as td
from torchdelegate import (
    DELEGATION_TAG,
    DelegationSpec,
    GroupBasedPartitioner,
    Partitioner,
    PartitionResult,
    generate_grouped_partitions_from_list_of_nodes,
    generate_partitions_from_list_of_nodes,
    tag_constant_data,
)


class Crossed(torch.nn.Module):
    """Two supported chains that cross through unsupported ops: ``a1 -> sin -> b2`` and ``b1 -> cos -> a2``."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a1 = x + 1
        b1 = y * 2
        b2 = torch.sin(a1) * 3
        a2 = torch.cos(b1) + 4
        return a2, b2


class Blocks(torch.nn.Module):
    """Two linear + relu blocks with a supported residual and an unsupported sigmoid between them."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x).relu()
        return self.second(h.sigmoid()).relu() + h


EXAMPLES = int(os.environ.get("TORCHDELEGATE_EXAMPLES", "200"))
REFUSABLE = ["aten.tanh.default", "aten.mul.Tensor", "aten.add.Tensor", "aten.sigmoid.default"]
ADD_MUL = {aten.add.Tensor, aten.mul.Tensor}
LINEAR_RELU = {aten.addmm.default, aten.permute.default, aten.relu.default, aten.add.Tensor}


def _nodes(program: torch.export.ExportedProgram, *names: str) -> list[Node]:
    found = {node.name: node for node in program.graph.nodes}
    return [found[name] for name in names]


def _names(partitions: list[Partition]) -> list[set[str]]:
    return [{node.name for node in partition.nodes} for partition in partitions]


def _blocks_program() -> torch.export.ExportedProgram:
    return td.to_edge(export(Blocks(), torch.randn(2, 8))).exported_program()


def test_each_group_lands_whole_in_one_partition_and_the_supported_nodes_around_it_join() -> None:
    program = _blocks_program()
    addmms = [n.name for n in program.graph.nodes if n.target is aten.addmm.default]
    relus = [n.name for n in program.graph.nodes if n.target is aten.relu.default]
    groups = [_nodes(program, addmms[0], relus[0]), _nodes(program, addmms[1], relus[1])]
    partitions = GroupBasedPartitioner(program.graph_module, LINEAR_RELU, node_groups=groups).propose_partitions()
    assert [p.id for p in partitions] == list(range(len(partitions)))
    for group in groups:
        (holding,) = [p for p in partitions if group[0] in p.nodes]
        assert all(node in holding.nodes for node in group)
    everything = set().union(*_names(partitions))
    supported = {n.name for n in program.graph.nodes if n.op == "call_function" and n.target in LINEAR_RELU}
    assert everything == supported  # the permutes and the residual add joined a group's partition
    assert not any(n.target is aten.sigmoid.default for p in partitions for n in p.nodes)


def test_a_group_a_path_outside_it_joins_is_refused_naming_the_node_in_the_way() -> None:
    program = export(Crossed(), torch.randn(3), torch.randn(3))
    a1, b2 = [n for n in program.graph.nodes if n.name in ("add", "mul_1")]
    with pytest.raises(
        ValueError,
        match=r"the node group of 'add', 'mul_1' would have made a cycle: .* through 'sin', which is not in it",
    ):
        GroupBasedPartitioner(program.graph_module, ADD_MUL, node_groups=[[a1, b2]]).propose_partitions()


def test_two_groups_that_would_each_wait_for_the_other_are_refused_together() -> None:
    program = export(Crossed(), torch.randn(3), torch.randn(3))
    add, mul, mul_1, add_1 = _nodes(program, "add", "mul", "mul_1", "add_1")
    partitioner = GroupBasedPartitioner(program.graph_module, ADD_MUL, node_groups=[[add, add_1], [mul, mul_1]])
    with pytest.raises(
        ValueError, match=r"the node groups of 'add', 'add_1' and of 'mul', 'mul_1' would have made a cycle together"
    ):
        partitioner.propose_partitions()
    alone = GroupBasedPartitioner(program.graph_module, ADD_MUL, node_groups=[[add, add_1]])
    assert {"add", "add_1"} in _names(alone.propose_partitions())  # either one alone is possible


def test_a_node_in_two_groups_or_from_another_graph_is_refused() -> None:
    program = export(Crossed(), torch.randn(3), torch.randn(3))
    add, mul = _nodes(program, "add", "mul")
    with pytest.raises(ValueError, match=r"node 'add' is in node groups 0 and 1"):
        GroupBasedPartitioner(program.graph_module, ADD_MUL, node_groups=[[add, mul], [add]])
    other = export(Crossed(), torch.randn(3), torch.randn(3))
    with pytest.raises(ValueError, match=r"node group 0: .* is not a node of this graph"):
        GroupBasedPartitioner(program.graph_module, ADD_MUL, node_groups=[_nodes(other, "add")])


class _AddOnly(OperatorSupportBase):
    def is_node_supported(self, submodules: dict[str, torch.nn.Module], node: Node) -> bool:
        return node.op == "call_function" and node.target is aten.add.Tensor


def test_a_torch_fx_operator_support_decides_and_a_groups_unsupported_nodes_are_left_out() -> None:
    program = export(Crossed(), torch.randn(3), torch.randn(3))
    add, mul = _nodes(program, "add", "mul")
    partitions = GroupBasedPartitioner(
        program.graph_module, _AddOnly(), node_groups=[[add, mul]], allows_single_node_partition=True
    ).propose_partitions()
    assert _names(partitions) == [{"add", "add_1"}]  # the two adds merge: no path joins them


class Chain(torch.nn.Module):
    """``add, view`` then ``sin``, then ``mul, add`` then ``cos``: two partitions the unsupported ops keep apart."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cos(torch.sin((x + 1).view(-1)) * 2 + 3)


def test_partitions_of_one_computation_are_dropped_unless_allowed_counting_as_executorch_does() -> None:
    graph_module = export(Chain(), torch.randn(2, 3)).graph_module
    support = {aten.add.Tensor, aten.mul.Tensor, aten.view.default}

    def proposed(**options: object) -> list[set[str]]:
        return _names(GroupBasedPartitioner(graph_module, support, **options).propose_partitions())  # type: ignore[arg-type]

    assert proposed() == [{"mul", "add_1"}]  # add + view is one computation: a view computes nothing
    assert proposed(allows_single_node_partition=True) == [{"mul", "add_1"}, {"add", "view"}]  # latest first
    assert proposed(non_compute_ops=["torch.ops.aten.mul.Tensor"]) == []
    assert proposed(allowed_single_node_partition_ops=["torch.ops.aten.add.Tensor"]) == [
        {"mul", "add_1"},
        {"add", "view"},
    ]


def test_partitions_from_lists_of_nodes_merge_the_lists_unless_told_to_keep_each_whole() -> None:
    program = export(Crossed(), torch.randn(3), torch.randn(3))
    add, mul, mul_1, add_1 = _nodes(program, "add", "mul", "mul_1", "add_1")
    merged = generate_partitions_from_list_of_nodes(program.graph_module, [[add, mul]])
    assert _names(merged) == [{"add", "mul"}]  # the listed nodes, as few partitions as stay cycle-free
    with_support = generate_partitions_from_list_of_nodes(program.graph_module, [[add]], op_support=_AddOnly())
    assert _names(with_support) == [{"add", "add_1"}]
    grouped = generate_grouped_partitions_from_list_of_nodes(program.graph_module, [[add, add_1], [mul]])
    assert {"add", "add_1"} in _names(grouped) and all(names != {"add"} for names in _names(grouped))
    with pytest.raises(ValueError, match="give a list of nodes or an operator support"):
        generate_partitions_from_list_of_nodes(program.graph_module)
    assert generate_partitions_from_list_of_nodes(program.graph_module, []) == []  # a pattern that matched nothing
    assert generate_grouped_partitions_from_list_of_nodes(program.graph_module, []) == []
    assert not any("match" in node.meta for node in program.graph.nodes)  # the caller's graph is left as it was
    del mul_1


class _BlockPartitioner(Partitioner):
    """A backend's partitioner written as ExecuTorch's are: groups found, partitions proposed, nodes tagged."""

    def __init__(self) -> None:
        super().__init__(DelegationSpec("reference"))

    def partition(self, exported_program: torch.export.ExportedProgram) -> PartitionResult:
        graph_module: GraphModule = exported_program.graph_module
        groups = [
            [node, next(iter(node.users))]
            for node in graph_module.graph.nodes
            if node.target is aten.addmm.default and next(iter(node.users)).target is aten.relu.default
        ]
        partitions = GroupBasedPartitioner(graph_module, LINEAR_RELU, node_groups=groups).propose_partitions()
        tags = {}
        for partition in partitions:
            tag = f"block_{partition.id}"
            for node in partition.nodes:
                node.meta[DELEGATION_TAG] = tag
            tags[tag] = self.spec
        tag_constant_data(exported_program)
        return PartitionResult(exported_program, tags)


def test_a_partitioner_ported_from_executorch_lowers_saves_and_runs_as_eager(tmp_path: pytest.TempPathFactory) -> None:
    model = Blocks().eval()
    x = torch.randn(2, 8)
    lowered = td.to_edge_transform_and_lower(export(model, x), partitioner=[_BlockPartitioner()])
    assert len(lowered.delegates()["forward"]) == 2  # the sigmoid between the blocks stays outside
    lowered.save(tmp_path / "blocks.tdp")  # type: ignore[operator]
    with td.load(tmp_path / "blocks.tdp") as program:  # type: ignore[operator]
        torch.testing.assert_close(program.run("forward", x), model(x))
    report = lowered.report
    # the report lists partitions in graph order; ids number the proposed partitions latest first, as torch.fx's
    assert report is not None and [p.tag for p in report.methods["forward"].partitions] == ["block_1", "block_0"]


class _RandomGroups(Partitioner):
    """Tags what GroupBasedPartitioner proposes for groups chosen by position among the computations."""

    def __init__(self, groups: list[list[int]], refused_ops: set[str]) -> None:
        super().__init__(DelegationSpec("reference"))
        self.groups, self.refused_ops = groups, refused_ops
        self.tag_of_group: list[set[str]] = []

    def partition(self, exported_program: torch.export.ExportedProgram) -> PartitionResult:
        graph_module = exported_program.graph_module
        calls = [n for n in graph_module.graph.nodes if n.op == "call_function" and n.target is not operator.getitem]
        taken: set[int] = set()
        groups = []
        for indices in self.groups:
            chosen = sorted({i % len(calls) for i in indices} - taken) if calls else []
            taken.update(chosen)
            groups.append([calls[i] for i in chosen])

        def support(node: Node) -> bool:
            return str(node.target) not in self.refused_ops

        partitions = GroupBasedPartitioner(
            graph_module, support, node_groups=groups, allows_single_node_partition=True
        ).propose_partitions()
        tags = {}
        for partition in partitions:
            for node in partition.nodes:
                node.meta[DELEGATION_TAG] = f"group_{partition.id}"
            tags[f"group_{partition.id}"] = self.spec
        self.tag_of_group = [{str(n.meta.get(DELEGATION_TAG)) for n in group if support(n)} for group in groups]
        tag_constant_data(exported_program)
        return PartitionResult(exported_program, tags)


@settings(max_examples=max(5, EXAMPLES // 25), deadline=None, suppress_health_check=list(HealthCheck))
@given(
    recipe=recipes(max_steps=25),
    groups=st.lists(st.lists(st.integers(0, 40), min_size=1, max_size=4), max_size=4),
    refused=st.sets(st.sampled_from(REFUSABLE)),
)
def test_random_groups_on_random_programs_stay_whole_or_are_refused_and_compute_what_eager_computes(
    recipe: Recipe, groups: list[list[int]], refused: set[str]
) -> None:
    module = RecipeModule(recipe)
    inputs = recipe.example_inputs()
    try:
        program = torch.export.export(copy.deepcopy(module), (), inputs)
        program.module()
    except Exception:  # torch.export's limits are not ours to test
        reject()
    partitioner = _RandomGroups(groups, refused)
    try:
        lowered = td.to_edge(program).to_backend(partitioner)
    except ValueError as error:
        assert "would have made a cycle" in str(error)
        return
    assert all(len(tags) <= 1 for tags in partitioner.tag_of_group)  # each group whole, in one partition
    with torch.no_grad():
        expected = copy.deepcopy(module)(**inputs)
        torch.testing.assert_close(lowered.exported_program().module()(**inputs), expected)


def test_a_group_holding_the_unsupported_node_in_the_way_says_to_split_it() -> None:
    program = export(Crossed(), torch.randn(3), torch.randn(3))
    add, sin, mul_1 = _nodes(program, "add", "sin", "mul_1")
    partitioner = GroupBasedPartitioner(program.graph_module, ADD_MUL, node_groups=[[add, sin, mul_1]])
    with pytest.raises(ValueError, match=r"through 'sin', which the operator support refuses .*split the group there$"):
        partitioner.propose_partitions()


class _Linears(torch.nn.Module):
    """Two linear layers whose sum (a supported ``add``) feeds a third, then an unsupported ``sin``."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second, self.third = (torch.nn.Linear(4, 4) for _ in range(3))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.third(self.first(x) + self.second(x))
        return out, torch.sin(out)


def test_a_supported_node_between_a_group_and_itself_joins_the_groups_partition() -> None:
    program = torch.export.export(_Linears(), (torch.randn(2, 4),))
    linears = _nodes(program, "linear", "linear_1", "linear_2")
    support = {aten.linear.default, aten.add.Tensor}
    partitions = GroupBasedPartitioner(program.graph_module, support, node_groups=[linears]).propose_partitions()
    assert _names(partitions) == [{"linear", "linear_1", "add", "linear_2"}]  # add is on the path linear -> linear_2


def test_groups_each_waiting_for_the_other_through_supported_nodes_become_one_partition() -> None:
    program = export(Crossed(), torch.randn(3), torch.randn(3))
    add, mul, mul_1, add_1 = _nodes(program, "add", "mul", "mul_1", "add_1")
    support = {*ADD_MUL, aten.sin.default, aten.cos.default}
    partitioner = GroupBasedPartitioner(program.graph_module, support, node_groups=[[add, add_1], [mul, mul_1]])
    assert _names(partitioner.propose_partitions()) == [{"add", "mul", "sin", "mul_1", "cos", "add_1"}]
    assert [p.nodes for p in partitioner.plan().partitions] == [["add", "mul", "sin", "mul_1", "cos", "add_1"]]


class _Convolutions(torch.nn.Module):
    """Four convolutions (the third and fourth share weights), an add between the second and third, a max
    pooling and a subtraction after them, then a relu."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.conv2, self.conv3 = (torch.nn.Conv2d(2, 2, 1) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.conv1(x)
        c = self.conv3(a + self.conv2(a))
        d = self.conv3(c)
        return (d.amax(dim=2) - c.amax(dim=2)).relu()


class _AddOrDiv(OperatorSupportBase):
    def is_node_supported(self, submodules: dict[str, torch.nn.Module], node: Node) -> bool:
        return node.op == "call_function" and node.target in (aten.add.Tensor, aten.div.Tensor)


def _listed_by_module(program: torch.export.ExportedProgram) -> list[list[Node]]:
    """Each convolution and relu with the weight and bias placeholders it reads, the way an ExecuTorch
    partitioner lists the nodes of the modules it runs."""
    lists = []
    for node in program.graph.nodes:
        if node.target in (aten.convolution.default, aten.relu.default):
            weights = [a for a in node.args if isinstance(a, Node) and a.op == "placeholder" and a.name != "x"]
            lists.append([node, *weights])
    return lists


def test_listed_placeholders_and_those_the_support_accepts_are_in_the_partitions_latest_partition_first() -> None:
    program = td.to_edge(export(_Convolutions(), torch.randn(1, 2, 4, 4))).exported_program()
    partitions = generate_partitions_from_list_of_nodes(program.graph_module, _listed_by_module(program), _AddOrDiv())
    convolutions = {"convolution", "convolution_1", "convolution_2", "convolution_3", "add"}
    weights = {f"p_conv{i}_{kind}" for i in (1, 2, 3) for kind in ("weight", "bias")}
    assert _names(partitions) == [{"relu"}, convolutions | weights]  # the later partition first, as torch.fx's
    assert [p.id for p in partitions] == [0, 1]
    first_two = _listed_by_module(program)[:2]  # (the later ones share conv3's weights: one group each)
    grouped = generate_grouped_partitions_from_list_of_nodes(program.graph_module, first_two)
    assert _names(grouped) == [{"convolution", "convolution_1", *(w for w in weights if "conv3" not in w)}]


class _AddsAndInputs(OperatorSupportBase):
    """Accepts ``add`` and every placeholder (user inputs included), as a torch.fx support may."""

    def is_node_supported(self, submodules: dict[str, torch.nn.Module], node: Node) -> bool:
        return node.op == "placeholder" or node.target is aten.add.Tensor


class _ReadTwice(torch.nn.Module):
    """A weight read by two adds that an unsupported ``sin`` keeps apart; a second input read by neither."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(3))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (x + self.w).sin() + self.w + y.cos()


def test_an_accepted_placeholder_goes_with_the_first_partition_reading_it_and_one_no_partition_reads_is_left_out() -> (
    None
):
    program = export(_ReadTwice(), torch.randn(3), torch.randn(3))
    partitions = generate_partitions_from_list_of_nodes(program.graph_module, op_support=_AddsAndInputs())
    assert _names(partitions) == [{"add_1", "add_2"}, {"p_w", "x", "add"}]  # y feeds only cos, in no partition
