"""Lowering recurses into control-flow sub-graphs, or delegates a whole control-flow op."""

import torch
from backends_for_tests import FunctionPartitioner
from models import Cond, WhileLoop, aten, export

from torchdelegate import LoweredBackendModule, call_delegate, to_backend


def delegate_calls(gm: torch.fx.GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes if n.target is call_delegate)


def ops(*targets: object):  # type: ignore[no-untyped-def]
    def tagger(node: torch.fx.Node) -> str | None:
        return "t" if node.op == "call_function" and node.target in targets else None

    return tagger


def test_delegates_inside_each_cond_branch() -> None:
    model = Cond()
    program = export(model, torch.randn(3, 4))
    lowered = to_backend(
        program, FunctionPartitioner(ops(aten.mm.default, aten.relu.default, aten.sub.Tensor, aten.sigmoid.default))
    )
    gm = lowered.graph_module
    assert delegate_calls(gm) == 0
    assert delegate_calls(gm.true_graph_0) == 1 and delegate_calls(gm.false_graph_0) == 1
    assert isinstance(gm.true_graph_0.lowered_module_0, LoweredBackendModule)
    lowered.validate()
    for x in (torch.randn(3, 4).abs(), -torch.randn(3, 4).abs()):
        torch.testing.assert_close(lowered.module()(x), model(x))


def test_a_whole_cond_is_delegated_when_tagged_with_its_branches() -> None:
    model = Cond()
    program = export(model, torch.randn(3, 4))

    def whole_cond(node: torch.fx.Node) -> str | None:
        in_top_graph = node.graph is node.graph.owning_module.graph and "true_graph" not in str(
            node.graph.owning_module
        )
        if node.op == "call_function" and node.target is torch.ops.higher_order.cond:
            return "cond"
        if node.op == "get_attr" and in_top_graph:
            return "cond"
        return None

    lowered = to_backend(program, FunctionPartitioner(whole_cond))
    gm = lowered.graph_module
    assert not hasattr(gm, "true_graph_0")
    (delegate,) = [m for m in gm.children() if isinstance(m, LoweredBackendModule)]
    inner = delegate.original_module
    assert [n.target for n in inner.graph.nodes if n.op == "call_function"][0] is torch.ops.higher_order.cond
    assert hasattr(inner.graph_module, "true_graph_0")
    for x in (torch.randn(3, 4).abs(), -torch.randn(3, 4).abs()):
        torch.testing.assert_close(lowered.module()(x), model(x))


def test_a_while_loop_body_is_lowered() -> None:
    model = WhileLoop()
    x, n = torch.randn(3, 4), torch.zeros(3)
    steps = torch.export.Dim("steps", min=1, max=16)
    program = export(model, x, n, dynamic_shapes=(None, {0: steps}))
    lowered = to_backend(program, FunctionPartitioner(ops(aten.mul.Tensor, aten.sin.default)))
    body = lowered.graph_module.while_loop_body_graph_0
    assert delegate_calls(body) == 1
    assert [n.target for n in body.graph.nodes if n.op == "call_function"] == [
        aten.add.Tensor,
        call_delegate,
        __import__("operator").getitem,
        aten.add.Tensor,
    ]
    lowered.validate()
    torch.testing.assert_close(lowered.module()(x, n), model(x, n))
    torch.testing.assert_close(lowered.module()(x, torch.zeros(5)), model(x, torch.zeros(5)))


class MapBody(torch.nn.Module):
    def forward(self, xs: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        from torch._higher_order_ops.map import map as map_over

        return map_over(lambda x, y: (x * y).cos() + 1, xs, y)


def test_a_map_body_is_lowered() -> None:
    model = MapBody()
    xs, y = torch.randn(3, 4), torch.randn(4)
    program = export(model, xs, y)
    lowered = to_backend(program, FunctionPartitioner(ops(aten.mul.Tensor, aten.cos.default)))
    assert delegate_calls(lowered.graph_module.body_graph_0) == 1
    lowered.validate()
    torch.testing.assert_close(lowered.module()(xs, y), model(xs, y))


def test_a_tagged_branch_get_attr_without_its_cond_does_not_stop_lowering_inside() -> None:
    model = Cond()
    program = export(model, torch.randn(3, 4))
    inner = ops(aten.mm.default, aten.relu.default, aten.sub.Tensor, aten.sigmoid.default)

    def tagger(node: torch.fx.Node) -> str | None:
        return "t" if node.op == "get_attr" else inner(node)

    lowered = to_backend(program, FunctionPartitioner(tagger))
    gm = lowered.graph_module
    assert delegate_calls(gm.true_graph_0) == 1 and delegate_calls(gm.false_graph_0) == 1


def test_a_whole_delegated_cond_carries_no_tags_inside() -> None:
    program = export(Cond(), torch.randn(3, 4))
    inner = ops(aten.mm.default, aten.relu.default)

    def tagger(node: torch.fx.Node) -> str | None:
        if node.op == "call_function" and node.target is torch.ops.higher_order.cond:
            return "c"
        return "c" if inner(node) else None

    lowered = to_backend(program, FunctionPartitioner(tagger))
    (delegate,) = [m for m in lowered.graph_module.children() if isinstance(m, LoweredBackendModule)]
    tags = [
        n.meta["delegation_tag"]
        for gm in delegate.original_module.graph_module.modules()
        if isinstance(gm, torch.fx.GraphModule)
        for n in gm.graph.nodes
        if "delegation_tag" in n.meta
    ]
    assert tags == []
