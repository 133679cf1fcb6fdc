"""The capability partitioner: support sets and callables, backends in priority order, reasons."""

from __future__ import annotations

import pytest
import torch
from backends_for_tests import TorchExportBackend
from models import LINEAR_OPS, TwoLinears, export

import torchdelegate as td
from torchdelegate import CapabilityPartitioner, DelegationSpec
from torchdelegate.partition.capability import CLAIMED_EARLIER, CYCLE, TOO_SMALL

aten = torch.ops.aten
REFERENCE = DelegationSpec("reference")
SECOND = DelegationSpec(TorchExportBackend.backend_id)


def _edge(model: torch.nn.Module, *args: torch.Tensor) -> td.EdgeProgramManager:
    return td.to_edge(export(model, *args))


def _backends(lowered: td.EdgeProgramManager) -> list[str]:
    return [d.backend_id for d in lowered.delegates()["forward"]]


def test_a_support_set_makes_cycle_free_maximal_partitions_with_reasons_for_the_rest() -> None:
    model, x = TwoLinears(), torch.randn(2, 4)
    edge = _edge(model, x)
    partitioner = CapabilityPartitioner(LINEAR_OPS, REFERENCE)
    plan = partitioner.plan(edge.exported_program())
    assert [p.tag for p in plan.partitions] == ["reference_0", "reference_1"]
    sigmoid = plan.by_node()["sigmoid"]
    assert sigmoid.tag is None and sigmoid.reasons == {"reference": "unsupported: aten.sigmoid.default"}
    lowered = edge.to_backend(partitioner)
    assert _backends(lowered) == ["reference", "reference"]
    torch.testing.assert_close(lowered.exported_program().module()(x), model(x))


def test_a_callable_gives_the_backends_own_words() -> None:
    def support(node: torch.fx.Node) -> bool | str:
        value = node.meta["val"]
        if node.target is aten.sigmoid.default:
            return f"sigmoid on {tuple(value.shape)} {value.dtype} is not implemented"
        return True

    plan = CapabilityPartitioner(support, REFERENCE).plan(_edge(TwoLinears(), torch.randn(2, 4)).exported_program())
    assert plan.by_node()["sigmoid"].reasons == {"reference": "sigmoid on (2, 4) torch.float32 is not implemented"}


def test_backends_in_priority_order_each_take_what_the_earlier_left() -> None:
    model, x = TwoLinears(), torch.randn(2, 4)
    edge = _edge(model, x)
    everything = lambda node: True  # noqa: E731
    partitioner = CapabilityPartitioner([(LINEAR_OPS, SECOND), (everything, REFERENCE)])
    plan = partitioner.plan(edge.exported_program())
    decisions = plan.by_node()
    assert decisions["sigmoid"].backend_id == "reference"
    assert decisions["sigmoid"].reasons == {SECOND.backend_id: "unsupported: aten.sigmoid.default"}
    addmm = decisions["addmm"]
    assert addmm.backend_id == SECOND.backend_id and addmm.reasons == {"reference": CLAIMED_EARLIER}
    assert plan.delegated() == len(plan.decisions)
    lowered = edge.to_backend(partitioner)
    assert _backends(lowered) == [SECOND.backend_id, "reference", SECOND.backend_id]
    torch.testing.assert_close(lowered.exported_program().module()(x), model(x))


def test_nodes_on_both_sides_of_an_unsupported_one_go_to_two_partitions() -> None:
    class Diamond(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            a = x + 1
            b = torch.sigmoid(a)  # not supported: a -> b -> c and a -> c
            return a * b

    x = torch.randn(3)
    edge = _edge(Diamond(), x)
    partitioner = CapabilityPartitioner({aten.add.Tensor, aten.mul.Tensor}, REFERENCE)
    plan = partitioner.plan(edge.exported_program())
    assert [p.nodes for p in plan.partitions] == [["add"], ["mul"]]
    assert [p.kept_apart for p in plan.partitions] == [{"reference_1": "sigmoid"}, {"reference_0": "sigmoid"}]
    torch.testing.assert_close(edge.to_backend(partitioner).exported_program().module()(x), Diamond()(x))


def test_a_small_group_a_cycle_kept_apart_says_so() -> None:
    class Diamond(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            a = (x + 1).cos()
            return a * torch.sigmoid(a)

    x = torch.randn(3)
    edge = _edge(Diamond(), x)
    support = {aten.add.Tensor, aten.cos.default, aten.mul.Tensor}
    plan = CapabilityPartitioner(support, REFERENCE, min_partition_size=2).plan(edge.exported_program())
    assert [p.nodes for p in plan.partitions] == [["add", "cos"]]
    why = plan.by_node()["mul"].reasons["reference"]
    assert why == f"{TOO_SMALL} (1 < 2); joining the group holding add {CYCLE} through sigmoid"


def test_groups_no_path_links_are_one_partition() -> None:
    class Branches(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            left = torch.sigmoid(x).cos()  # cos after an unsupported node: level 1
            right = x.sin()  # level 0, no path to or from cos
            return torch.tanh(left) + right

    x = torch.randn(3)
    edge = _edge(Branches(), x)
    support = {aten.cos.default, aten.sin.default}
    plan = CapabilityPartitioner(support, REFERENCE).plan(edge.exported_program())
    assert [p.nodes for p in plan.partitions] == [["cos", "sin"]]
    torch.testing.assert_close(
        edge.to_backend(CapabilityPartitioner(support, REFERENCE)).exported_program().module()(x), Branches()(x)
    )


def test_two_backends_interleaved_along_paths_lower_without_a_cycle() -> None:
    class Through(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            a = x.sin()  # second backend
            b = a.exp()  # first backend
            c = x.cos()  # first backend
            d = c.tanh()  # second backend
            return b + d

    x = torch.randn(3)
    edge = _edge(Through(), x)
    first = {aten.exp.default, aten.cos.default}
    partitioner = CapabilityPartitioner([(first, REFERENCE), ({aten.sin.default, aten.tanh.default}, SECOND)])
    plan = partitioner.plan(edge.exported_program())
    assert plan.delegated() == 5 - 1  # all but the final add, which neither supports
    assert {p.backend_id for p in plan.partitions} == {"reference", SECOND.backend_id}
    torch.testing.assert_close(edge.to_backend(partitioner).exported_program().module()(x), Through()(x))


def test_small_partitions_are_given_back_to_the_next_backend_with_the_reason() -> None:
    model, x = TwoLinears(), torch.randn(2, 4)
    edge = _edge(model, x)
    everything = lambda node: True  # noqa: E731
    partitioner = CapabilityPartitioner([(LINEAR_OPS, SECOND), (everything, REFERENCE)], min_partition_size=4)
    plan = partitioner.plan(edge.exported_program())
    decisions = plan.by_node()
    assert decisions["addmm"].backend_id == "reference"
    assert decisions["addmm"].reasons[SECOND.backend_id].startswith(TOO_SMALL)
    torch.testing.assert_close(edge.to_backend(partitioner).exported_program().module()(x), model(x))


def test_planning_and_partitioning_leave_the_callers_program_unchanged() -> None:
    edge = _edge(TwoLinears(), torch.randn(2, 4))
    program = edge.exported_program()
    before = program.graph_module.code, [dict(n.meta) for n in program.graph.nodes]
    partitioner = CapabilityPartitioner(LINEAR_OPS, REFERENCE)
    partitioner.plan(program)
    edge.to_backend(partitioner)
    assert (program.graph_module.code, [dict(n.meta) for n in program.graph.nodes]) == before


def test_tags_and_decisions_are_the_same_every_time() -> None:
    edge = _edge(TwoLinears(), torch.randn(2, 4))
    partitioner = CapabilityPartitioner(LINEAR_OPS, REFERENCE)
    assert partitioner.plan(edge.exported_program()) == partitioner.plan(edge.exported_program())


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ((LINEAR_OPS,), "takes \\(support, DelegationSpec\\)"),
        (([],), "needs at least one backend"),
        ((LINEAR_OPS, REFERENCE, 0), "min_partition_size must be at least 1"),
        (([(LINEAR_OPS, REFERENCE), ({aten.sigmoid.default}, REFERENCE)],), "'reference' is listed more than once"),
    ],
)
def test_bad_arguments_are_refused(arguments: tuple[object, ...], message: str) -> None:
    kwargs = {"min_partition_size": arguments[2]} if len(arguments) == 3 else {}
    with pytest.raises((TypeError, ValueError), match=message):
        CapabilityPartitioner(*arguments[:2], **kwargs)  # type: ignore[arg-type]


_TRANSFORMERS_CASES = [
    ("llama", {"aten.embedding.default"}),
    ("llama", {"aten.add.Tensor", "aten.rsqrt.default"}),
    ("llama", {"aten.mul.Tensor"}),
    ("llama", {"aten.view.default"}),
    ("llama", {"aten.permute.default", "aten.sin.default"}),
    ("llama", {"aten.mm.default"}),
    ("llama", {"aten.cat.default", "aten.neg.default"}),
    ("gpt2", {"aten.embedding.default"}),
    ("gpt2", {"aten.mul.Tensor"}),
    ("gpt2", {"aten.view.default"}),
    ("gpt2", {"aten.permute.default", "aten.sin.default"}),
    ("gpt2", {"aten.addmm.default"}),
]


@pytest.fixture(scope="module")
def language_models() -> dict[str, tuple[torch.nn.Module, torch.Tensor, td.EdgeProgramManager]]:
    pytest.importorskip("transformers")
    from language_models import tiny_gpt2, tiny_llama

    found = {}
    for name, build in (("llama", tiny_llama), ("gpt2", tiny_gpt2)):
        module, ids = build(), torch.randint(0, 512, (1, 8), generator=torch.Generator().manual_seed(0))
        found[name] = module, ids, td.to_edge(torch.export.export(module, (ids,), kwargs={"use_cache": False}))
    return found


@pytest.mark.parametrize(("model", "excluded"), _TRANSFORMERS_CASES)
def test_no_more_partitions_than_torch_fx_on_transformers_graphs(
    language_models: dict[str, tuple[torch.nn.Module, torch.Tensor, td.EdgeProgramManager]],
    model: str,
    excluded: set[str],
) -> None:
    from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner
    from torch.fx.passes.operator_support import OperatorSupportBase

    module, ids, edge = language_models[model]
    program = edge.exported_program()

    def support(node: torch.fx.Node) -> bool:
        return isinstance(node.target, torch._ops.OpOverload) and str(node.target) not in excluded

    class Support(OperatorSupportBase):
        def is_node_supported(self, submodules: object, node: torch.fx.Node) -> bool:
            return node.op == "call_function" and support(node)

    partitioner = CapabilityPartitioner(support, REFERENCE)
    ours = partitioner.plan(program).partitions
    theirs = CapabilityBasedPartitioner(
        program.graph_module, Support(), allows_single_node_partition=True
    ).propose_partitions()
    assert len(ours) <= len(theirs)
    lowered = edge.to_backend(partitioner)
    assert len(lowered.delegates()["forward"]) == len(ours)
    with torch.no_grad():
        expected = module(ids, use_cache=False).logits
        actual = lowered.exported_program().module()(ids, use_cache=False).logits
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)
