"""PatternPartitioner: partitions from op patterns ("addmm followed by relu"), matches never split."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from hypothesis import HealthCheck, given, reject, settings
from hypothesis import strategies as st
from models import aten, export
from random_programs import Recipe, RecipeModule, recipes

import torchdelegate as td
from torchdelegate import DelegationSpec, to_backend
from torchdelegate.backends.reference import ReferenceBackend
from torchdelegate.delegate.lowered_module import LoweredBackendModule
from torchdelegate.partition import Pattern, PatternPartitioner, find_pattern_matches

REFERENCE = DelegationSpec(ReferenceBackend.backend_id)
EXAMPLES = int(os.environ.get("TORCHDELEGATE_EXAMPLES", "200"))
ADDMM_RELU = [aten.addmm.default, aten.relu.default]


class ThreeLinears(torch.nn.Module):
    """linear+relu, sigmoid, linear+relu, linear, + residual: two addmm-relu chains, one bare addmm."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x).relu()
        z = self.b(y.sigmoid()).relu()
        return self.c(z) + y


class Chain(torch.nn.Module):
    """addmm -> relu -> sigmoid: two patterns can claim relu."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x).relu().sigmoid() * 2


def _names(matches: list) -> list[list[str]]:  # type: ignore[type-arg]
    return [[n.name for n in m.nodes] for m in matches]


def test_an_op_sequence_claims_each_match_whole_and_lowers() -> None:
    model = ThreeLinears()
    program = export(model, torch.randn(2, 4))
    partitioner = PatternPartitioner([ADDMM_RELU], REFERENCE)
    assert _names(partitioner.matches(program)) == [["addmm", "relu"], ["addmm_1", "relu_1"]]
    plan = partitioner.plan(program)
    assert [(p.tag, p.nodes) for p in plan.partitions] == [
        ("reference_0", ["addmm", "relu"]),
        ("reference_1", ["addmm_1", "relu_1"]),
    ]
    left = plan.by_node()["addmm_2"]
    assert left.tag is None and left.reasons == {"reference": "in no match of the patterns (aten.addmm.default)"}
    lowered = to_backend(program, partitioner)
    assert len([m for m in lowered.graph_module.children() if isinstance(m, LoweredBackendModule)]) == 2
    x = torch.randn(2, 4)
    torch.testing.assert_close(lowered.module()(x), model(x))


def test_patterns_given_as_functions_and_graphs_match_the_same_nodes() -> None:
    program = export(ThreeLinears(), torch.randn(2, 4))
    x, w, b = torch.randn(2, 4), torch.randn(4, 4), torch.randn(4)
    from_function = Pattern.from_function(lambda x, w, b: torch.relu(torch.addmm(b, x, w)), (x, w, b))
    assert from_function.name == "addmm+relu"
    from_graph = Pattern.from_graph(from_function.graph)  # type: ignore[arg-type]
    expected = [["addmm", "relu"], ["addmm_1", "relu_1"]]
    assert _names(find_pattern_matches(program, [from_function])) == expected
    assert _names(find_pattern_matches(program.graph_module, [from_graph])) == expected
    assert _names(find_pattern_matches(program, [Pattern.sequence(aten.addmm, {aten.relu.default})])) == expected


def test_overlapping_matches_go_to_the_pattern_listed_first() -> None:
    program = export(Chain(), torch.randn(2, 4))
    relu_sigmoid = [aten.relu.default, aten.sigmoid.default]
    first = PatternPartitioner([relu_sigmoid, ADDMM_RELU], REFERENCE)
    assert _names(first.matches(program)) == [["relu", "sigmoid"]]
    assert first.plan(program).by_node()["addmm"].reasons == {
        "reference": "its match of pattern 'addmm+relu' at 'addmm' overlaps the match of 'relu+sigmoid' at "
        "'relu', taken first"
    }
    assert _names(PatternPartitioner([ADDMM_RELU, relu_sigmoid], REFERENCE).matches(program)) == [["addmm", "relu"]]


def test_an_interior_value_used_elsewhere_is_no_match() -> None:
    """addmm+relu where relu's input is also read outside: a fused kernel could not give it back."""
    program = export(ThreeLinears(), torch.randn(2, 4))
    relu_sigmoid = Pattern.sequence(aten.relu.default, aten.sigmoid.default)
    assert find_pattern_matches(program, [relu_sigmoid]) == []  # relu's value also feeds the residual add


def test_op_support_adds_single_nodes_grouped_with_the_matches() -> None:
    model = ThreeLinears()
    program = export(model, torch.randn(2, 4))
    partitioner = PatternPartitioner([ADDMM_RELU], REFERENCE, op_support={aten.permute.default})
    plan = partitioner.plan(program)
    assert plan.partitions[0].nodes == ["permute", "addmm", "relu"]
    assert plan.by_node()["sigmoid"].reasons == {
        "reference": "in no match of the patterns (aten.sigmoid.default); unsupported: aten.sigmoid.default"
    }
    lowered = to_backend(program, partitioner)
    assert "a.weight" not in lowered.state_dict  # its permute went into the delegate, so the weight did too
    x = torch.randn(2, 4)
    torch.testing.assert_close(lowered.module()(x), model(x))


def test_min_partition_size_leaves_small_partitions() -> None:
    program = export(ThreeLinears(), torch.randn(2, 4))
    plan = PatternPartitioner([ADDMM_RELU], REFERENCE, min_partition_size=3).plan(program)
    assert plan.partitions == []
    assert plan.by_node()["relu"].reasons["reference"].startswith("partition smaller than min_partition_size (2 < 3)")


class Crossed(torch.nn.Module):
    """sin(x) feeds exp (through relu); tan(y) feeds cos (through neg): two matches that cross."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        s = x.sin()
        t = y.tan()
        return s, t, t.neg().cos(), s.relu().exp()


def _pair(first: object, second: object) -> Pattern:
    """A pattern of two unconnected ops, both returned: a match with two exits."""
    graph = torch.fx.Graph()
    a, b = graph.placeholder("a"), graph.placeholder("b")
    graph.output((graph.call_function(first, (a,)), graph.call_function(second, (b,))))
    return Pattern.from_graph(graph)


def test_matches_that_would_make_a_cycle_together_keep_the_first() -> None:
    program = export(Crossed(), torch.randn(3), torch.randn(3))
    sin_cos, exp_tan = _pair(aten.sin.default, aten.cos.default), _pair(aten.exp.default, aten.tan.default)
    each_alone = [_names(find_pattern_matches(program, [p])) for p in (sin_cos, exp_tan)]
    assert each_alone == [[["sin", "cos"]], [["tan", "exp"]]]
    partitioner = PatternPartitioner([sin_cos, exp_tan], REFERENCE)
    assert _names(partitioner.matches(program)) == [["sin", "cos"]]
    assert partitioner.plan(program).by_node()["tan"].reasons == {
        "reference": "its match of pattern 'exp+tan' at 'tan' together with the match of 'sin+cos' at 'sin' "
        "would have made a cycle"
    }
    lowered = to_backend(program, partitioner)
    x, y = torch.randn(3), torch.randn(3)
    for got, want in zip(lowered.module()(x, y), Crossed()(x, y), strict=True):
        torch.testing.assert_close(got, want)


class _SinThroughCos(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = x.sin()
        return s.exp().cos(), s


def test_a_match_two_of_whose_nodes_a_path_outside_it_joins_is_dropped() -> None:
    """sin -> exp -> cos: the two-exit match {sin, cos} as one delegate would read exp, which reads it."""
    program = export(_SinThroughCos(), torch.randn(3))
    partitioner = PatternPartitioner([_pair(aten.sin.default, aten.cos.default)], REFERENCE)
    assert partitioner.matches(program) == []
    assert partitioner.plan(program).by_node()["sin"].reasons == {
        "reference": "its match of pattern 'sin+cos' at 'sin' would have made a cycle on its own"
    }
    x = torch.randn(3)
    for got, want in zip(to_backend(program, partitioner).module()(x), _SinThroughCos()(x), strict=True):
        torch.testing.assert_close(got, want)


def test_a_pattern_with_an_op_the_graph_lacks_has_no_match() -> None:
    """torch.fx's matcher skips an output op it finds no candidate for (and then raises a KeyError)."""
    program = export(Crossed(), torch.randn(3), torch.randn(3))
    assert find_pattern_matches(program, [_pair(aten.sin.default, aten.sigmoid.default)]) == []


def test_the_same_program_gives_the_same_plan() -> None:
    program = export(ThreeLinears(), torch.randn(2, 4))
    partitioner = PatternPartitioner([[aten.relu.default], ADDMM_RELU], REFERENCE)
    assert partitioner.plan(program) == partitioner.plan(export(ThreeLinears(), torch.randn(2, 4)))


@pytest.mark.parametrize(
    ("make", "error", "message"),
    [
        (lambda: Pattern.sequence(), ValueError, "Pattern.sequence needs at least one op"),
        (lambda: Pattern.sequence("addmm"), TypeError, "pattern step 0 holds 'addmm', which is not a torch op"),
        (lambda: Pattern.sequence(aten.addmm.default, set()), ValueError, "pattern step 1 is empty"),
        (lambda: Pattern.from_graph(torch.fx.Graph()), ValueError, "the graph has no call_function node to match"),
        (lambda: PatternPartitioner([], REFERENCE), ValueError, "needs at least one pattern, or an op_support"),
        (lambda: PatternPartitioner([ADDMM_RELU], "reference"), TypeError, "takes (patterns, DelegationSpec)"),
        (lambda: PatternPartitioner(["addmm+relu"], REFERENCE), TypeError, "a pattern is a Pattern, a list of ops"),
        (
            lambda: find_pattern_matches("graph", [ADDMM_RELU]),
            TypeError,
            "find_pattern_matches takes an ExportedProgram",
        ),
    ],
    ids=["empty", "name", "empty step", "no ops", "nothing", "spec", "string", "program"],
)
def test_patterns_that_cannot_match_are_refused_when_made(make, error, message) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(error) as caught:
        make()
    assert message in str(caught.value)


UNARY_OPS = (aten.relu.default, aten.tanh.default, aten.sigmoid.default, aten.neg.default, aten.abs.default)
BINARY_OPS = (aten.add.Tensor, aten.mul.Tensor, aten.sub.Tensor, aten.mm.default, aten.maximum.default)


def _random_pattern(kind: str, ops: list[int]) -> Pattern:
    pool = UNARY_OPS + BINARY_OPS
    chosen = [pool[i % len(pool)] for i in ops]
    if kind == "sequence":
        return Pattern.sequence(*chosen)
    graph = torch.fx.Graph()  # unconnected ops, all returned: matches with several exits
    outputs = [
        graph.call_function(op, tuple(graph.placeholder(f"p{i}_{k}") for k in range(1 if op in UNARY_OPS else 2)))
        for i, op in enumerate(chosen)
    ]
    graph.output(tuple(outputs))
    return Pattern.from_graph(graph)


@settings(max_examples=max(5, EXAMPLES // 25), deadline=None, suppress_health_check=list(HealthCheck))
@given(
    recipe=recipes(max_steps=30),
    patterns=st.lists(
        st.tuples(st.sampled_from(["sequence", "unconnected"]), st.lists(st.integers(0, 9), min_size=1, max_size=3)),
        min_size=1,
        max_size=4,
    ),
)
def test_random_patterns_on_random_programs_lower_and_compute_what_eager_computes(
    recipe: Recipe, patterns: list[tuple[str, list[int]]]
) -> None:
    """Whatever the patterns and however their matches cross, the partitions are cycle-free and run right."""
    module = RecipeModule(recipe)
    inputs = recipe.example_inputs()
    try:
        program = torch.export.export(copy.deepcopy(module), (), inputs)
        program.module()  # torch cannot unlift state named like a keyword (`lambda`): not ours to test
    except Exception:  # torch.export's limits are not ours to test
        reject()
    partitioner = PatternPartitioner([_random_pattern(kind, ops) for kind, ops in patterns], REFERENCE)
    lowered = td.to_edge(program).to_backend(partitioner)
    with torch.no_grad():
        expected = copy.deepcopy(module)(**inputs)
        torch.testing.assert_close(lowered.exported_program().module()(**inputs), expected)
