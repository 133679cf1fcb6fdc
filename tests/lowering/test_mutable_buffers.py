"""A KV cache: a tagged buffer is the delegate's state; an untagged one stays with the program."""

import torch
from backends_for_tests import FunctionPartitioner
from models import KVCache, ReadThenWrite, export

from torchdelegate import (
    DELEGATION_TAG,
    DelegationSpec,
    Partitioner,
    PartitionResult,
    tag_constant_data,
    tag_mutated_buffers,
    to_backend,
)


class AllCompute(Partitioner):
    def __init__(self, tag_state: bool) -> None:
        self.tag_state = tag_state

    def partition(self, exported_program: torch.export.ExportedProgram) -> PartitionResult:
        for node in exported_program.graph.nodes:
            if node.op == "call_function":
                node.meta[DELEGATION_TAG] = "t"
        if self.tag_state:
            tag_constant_data(exported_program)
            tag_mutated_buffers(exported_program)
        return PartitionResult(exported_program, {"t": DelegationSpec("TestTorchExport")})


def run_four_calls(program: torch.export.ExportedProgram, model: KVCache) -> torch.nn.Module:
    eager = KVCache()
    eager.load_state_dict(model.state_dict())
    module = program.module()
    for i in range(4):
        x, pos = torch.randn(1, 4), torch.tensor([i])
        torch.testing.assert_close(module(x, pos), eager(x, pos))
    return module, eager


def test_an_untagged_cache_stays_with_the_program_and_the_delegate_returns_its_new_value() -> None:
    model = KVCache()
    program = export(model, torch.randn(1, 4), torch.tensor([0]))
    lowered = to_backend(program, AllCompute(tag_state=False))
    assert lowered.graph_signature.buffers_to_mutate == {"index_put": "cache"}
    assert "cache" in lowered.state_dict
    module, eager = run_four_calls(lowered, model)
    torch.testing.assert_close(module.cache, eager.cache)
    assert torch.count_nonzero(program.state_dict["cache"]) == 0  # the caller's buffer is untouched


def test_a_tagged_cache_is_owned_by_the_delegate() -> None:
    model = KVCache()
    program = export(model, torch.randn(1, 4), torch.tensor([0]))
    lowered = to_backend(program, AllCompute(tag_state=True))
    assert lowered.graph_signature.buffers_to_mutate == {}
    assert lowered.state_dict == {}
    (delegate,) = [m for n, m in lowered.graph_module.named_children() if n.startswith("lowered_module")]
    assert delegate.original_module.graph_signature.buffers_to_mutate == {"index_put": "cache"}
    assert delegate.original_module.state_dict["cache"] is not program.state_dict["cache"]
    run_four_calls(lowered, model)
    assert torch.count_nonzero(program.state_dict["cache"]) == 0


def test_a_delegate_owning_a_buffer_also_returns_the_new_value_when_it_is_read_outside() -> None:
    model = ReadThenWrite()
    program = export(model, torch.randn(4))
    lowered = to_backend(program, FunctionPartitioner(lambda n: "t" if n.name in ("b_state", "mul", "add") else None))
    assert lowered.graph_signature.buffers_to_mutate == {}
    eager, module = ReadThenWrite(), lowered.module()
    for _ in range(4):
        x = torch.randn(4)
        torch.testing.assert_close(module(x), eager(x))


class WriteOnly(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("last", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.last.copy_(x * 2)
        return x + 1


def test_a_delegate_may_own_a_buffer_it_only_writes_and_return_nothing() -> None:
    program = export(WriteOnly(), torch.randn(4))
    lowered = to_backend(program, FunctionPartitioner(lambda n: "t" if n.name in ("b_last", "mul") else None))
    assert lowered.state_dict == {} and lowered.graph_signature.buffers_to_mutate == {}
    (call,) = [n for n in lowered.graph.nodes if n.op == "call_function"][:1]
    assert call.meta["val"] == () and not call.users
    (delegate,) = [m for n, m in lowered.graph_module.named_children() if n.startswith("lowered_module")]
    assert delegate.original_module.graph_signature.buffers_to_mutate == {"mul": "last"}
    x = torch.randn(4)
    torch.testing.assert_close(lowered.module()(x), x + 1)


def test_a_delegate_that_returns_nothing_survives_dead_code_elimination() -> None:
    program = export(WriteOnly(), torch.randn(4))
    lowered = to_backend(program, FunctionPartitioner(lambda n: "t" if n.name in ("b_last", "mul") else None))
    module = lowered.module()
    module.graph.eliminate_dead_code()
    assert any(n.op == "call_function" and "call_delegate" in n.name for n in module.graph.nodes)
    decomposed = lowered.run_decompositions()
    assert any("call_delegate" in n.name for n in decomposed.graph.nodes)
