"""to_backend(edge_program, partitioner): partitions become delegates that really run."""

import copy
import gc
import operator

import torch
from backends_for_tests import FunctionPartitioner, OpSetPartitioner, TorchExportBackend
from models import LINEAR_OPS, SharedConstant, TwoLinears, aten, export
from programs import assert_unchanged, snapshot

from torchdelegate import LoweredBackendModule, call_delegate, run_original_subprograms, to_backend


def delegates(program: torch.export.ExportedProgram) -> list[LoweredBackendModule]:
    return [m for _, m in program.graph_module.named_children() if isinstance(m, LoweredBackendModule)]


def test_two_partitions_split_by_an_unsupported_op() -> None:
    model = TwoLinears()
    program = export(model, torch.randn(2, 4))
    lowered = to_backend(program, OpSetPartitioner(LINEAR_OPS))

    calls = [n for n in lowered.graph.nodes if n.target is call_delegate]
    assert len(calls) == 2
    assert [
        n.target
        for n in lowered.graph.nodes
        if n.op == "call_function" and n.target not in (call_delegate, operator.getitem)
    ] == [aten.sigmoid.default]
    # The second delegate reads the first one's output too (the residual).
    assert [a.name for a in calls[1].args[1:]] == ["sigmoid", "relu"]
    x = torch.randn(2, 4)
    torch.testing.assert_close(lowered.module()(x), model(x))
    lowered.validate()


def test_tagged_params_move_into_the_delegate() -> None:
    program = export(TwoLinears(), torch.randn(2, 4))
    lowered = to_backend(program, OpSetPartitioner(LINEAR_OPS, tag_constants=True))
    assert lowered.state_dict == {}
    assert [s.arg.name for s in lowered.graph_signature.input_specs] == ["x"]
    first, second = delegates(lowered)
    assert set(first.original_module.state_dict) == {"l1.weight", "l1.bias"}
    assert set(second.original_module.state_dict) == {"l2.weight", "l2.bias"}
    assert first.original_module.state_dict["l1.weight"] is program.state_dict["l1.weight"]


def test_untagged_params_stay_and_are_passed_in() -> None:
    model = TwoLinears()
    program = export(model, torch.randn(2, 4))
    lowered = to_backend(program, OpSetPartitioner(LINEAR_OPS, tag_constants=False))
    assert set(lowered.state_dict) == {"l1.weight", "l1.bias", "l2.weight", "l2.bias"}
    assert all(lowered.state_dict[k] is program.state_dict[k] for k in lowered.state_dict)
    first = delegates(lowered)[0]
    assert first.original_module.state_dict == {}
    assert [s.arg.name for s in first.original_module.graph_signature.input_specs] == ["p_l1_weight", "p_l1_bias", "x"]
    x = torch.randn(2, 4)
    torch.testing.assert_close(lowered.module()(x), model(x))


def test_a_constant_shared_by_two_partitions_and_a_residual_node_is_never_copied() -> None:
    model = SharedConstant()
    program = export(model, torch.randn(3, 4))
    lowered = to_backend(program, OpSetPartitioner({aten.mm.default}, tag_constants=False))
    # mm's users are tagged but tanh is not, so the weight is not tagged: passed in to both.
    assert lowered.state_dict["w"] is program.state_dict["w"]

    def tag_weight_too(node: torch.fx.Node) -> str | None:
        # The two matmuls go to two partitions; the weight is tagged, so both carry it inside.
        return {"mm": "first", "mm_1": "second", "p_w": "first"}.get(node.name)

    lowered = to_backend(program, FunctionPartitioner(tag_weight_too))
    weights = [d.original_module.state_dict["w"] for d in delegates(lowered)]
    assert len(weights) == 2
    pointer = program.state_dict["w"].data_ptr()
    assert all(w.data_ptr() == pointer for w in weights)
    assert lowered.state_dict["w"].data_ptr() == pointer  # tanh still reads it
    x = torch.randn(3, 4)
    for got, want in zip(lowered.module()(x), model(x), strict=True):
        torch.testing.assert_close(got, want)


def test_delegates_init_once_execute_per_call_and_destroy_when_released() -> None:
    model = TwoLinears()
    program = export(model, torch.randn(2, 4))
    gc.collect()  # earlier tests' delegates must not be destroyed during this one
    TorchExportBackend.calls.clear()
    lowered = to_backend(program, OpSetPartitioner(LINEAR_OPS))
    module = lowered.module()
    for _ in range(3):
        module(torch.randn(2, 4))
    assert TorchExportBackend.calls.count("init") == 2
    assert TorchExportBackend.calls.count("execute") == 6
    del module, lowered
    gc.collect()
    assert TorchExportBackend.calls.count("destroy") == 2


def test_run_original_subprograms_matches_the_backend() -> None:
    model = TwoLinears()
    program = export(model, torch.randn(2, 4))
    TorchExportBackend.calls.clear()
    module = to_backend(program, OpSetPartitioner(LINEAR_OPS)).module()
    x = torch.randn(2, 4)
    with run_original_subprograms():
        original = module(x)
    assert TorchExportBackend.calls == []
    torch.testing.assert_close(module(x), original)


def test_delegate_names_are_deterministic_and_topological() -> None:
    program = export(TwoLinears(), torch.randn(2, 4))
    first = to_backend(program, OpSetPartitioner(LINEAR_OPS))
    second = to_backend(program, OpSetPartitioner(LINEAR_OPS))
    assert first.graph_module.code == second.graph_module.code
    names = [n.target for n in first.graph.nodes if n.op == "get_attr"]
    assert names == ["lowered_module_0", "lowered_module_1"]
    assert [d.meta["tag"] for d in delegates(first)] == ["tag0", "tag1"]
    text = str(first)
    assert "lowered_module_0" in text and "call_delegate" in text


def test_lowering_a_lowered_program_again_keeps_its_delegates() -> None:
    model = TwoLinears()
    program = export(model, torch.randn(2, 4))
    once = to_backend(program, OpSetPartitioner({aten.relu.default}))
    twice = to_backend(once, OpSetPartitioner({aten.sigmoid.default}))
    assert [n.target for n in twice.graph.nodes if n.op == "get_attr"] == ["lowered_module_0", "lowered_module_1"]
    assert delegates(twice)[0] is delegates(once)[0]
    x = torch.randn(2, 4)
    torch.testing.assert_close(twice.module()(x), model(x))


def test_the_callers_program_is_unchanged_after_lowering() -> None:
    program = export(TwoLinears(), torch.randn(2, 4))
    before = snapshot(program)
    lowered = to_backend(program, OpSetPartitioner(LINEAR_OPS))
    lowered.module()(torch.randn(2, 4))
    assert_unchanged(program, before)


def test_a_lowered_program_can_be_decomposed_and_traced_again() -> None:
    model = TwoLinears()
    program = export(model, torch.randn(2, 4))
    lowered = to_backend(program, OpSetPartitioner(LINEAR_OPS)).run_decompositions()
    assert sum(1 for n in lowered.graph.nodes if n.target is call_delegate) == 2
    x = torch.randn(2, 4)
    torch.testing.assert_close(lowered.module()(x), model(x))


def test_dynamic_batch_sizes_run_through_delegates() -> None:
    model = TwoLinears()
    batch = torch.export.Dim("batch", min=1, max=64)
    program = export(model, torch.randn(2, 4), dynamic_shapes=({0: batch},))
    lowered = to_backend(program, OpSetPartitioner(LINEAR_OPS))
    module = lowered.module()
    for n in (1, 5, 33):
        x = torch.randn(n, 4)
        torch.testing.assert_close(module(x), model(x))


def test_deepcopy_shares_the_blob_but_not_the_handle() -> None:
    program = export(TwoLinears(), torch.randn(2, 4))
    lowered = to_backend(program, OpSetPartitioner(LINEAR_OPS))
    delegate = delegates(lowered)[0]
    x = torch.randn(2, 4)
    expected = delegate(x)
    TorchExportBackend.calls.clear()
    clone = copy.deepcopy(delegate)
    assert clone.processed_bytes is delegate.processed_bytes
    assert clone.original_module is delegate.original_module
    torch.testing.assert_close(clone(x), expected)
    assert TorchExportBackend.calls == ["init", "execute"]


def test_delegates_read_the_named_data_of_the_whole_lowering() -> None:
    model = TwoLinears()
    program = export(model, torch.randn(2, 4))
    lowered = to_backend(program, OpSetPartitioner(LINEAR_OPS, backend_id="TestNamedWeights"))
    first, second = delegates(lowered)
    assert len(first.named_data_store_output) == 4 and second.named_data_store_output is None
    x = torch.randn(2, 4)
    torch.testing.assert_close(lowered.module()(x), model(x))


def test_new_delegates_are_numbered_after_the_ones_kept() -> None:
    model = TwoLinears()
    program = export(model, torch.randn(2, 4))
    once = to_backend(program, OpSetPartitioner({aten.relu.default, aten.sigmoid.default}))
    assert [n.target for n in once.graph.nodes if n.op == "get_attr"] == ["lowered_module_0"]
    # The second lowering swallows the first delegate into a bigger one.
    swallow = FunctionPartitioner(lambda n: "all" if n.op == "call_function" else None, "TestCompileOnly")
    twice = to_backend(once, swallow)
    assert [n.target for n in twice.graph.nodes if n.op == "get_attr"] == ["lowered_module_0"]


def test_sub_programs_carry_only_their_own_range_constraints() -> None:
    class TwoInputs(torch.nn.Module):
        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return x.relu().sum() + y.sigmoid().sum()

    dims = ({0: torch.export.Dim("a", max=32)}, {0: torch.export.Dim("b", max=32)})
    program = export(TwoInputs(), torch.randn(3, 4), torch.randn(5, 4), dynamic_shapes=dims)
    assert len(program.range_constraints) == 2
    lowered = to_backend(program, OpSetPartitioner({aten.relu.default}))
    (delegate,) = delegates(lowered)
    assert len(delegate.original_module.range_constraints) == 1


DETERMINISM_SCRIPT = """
import hashlib, sys
sys.path.insert(0, {tests!r})
import torch
from backends_for_tests import OpSetPartitioner
from models import LINEAR_OPS, TwoLinears, export
from torchdelegate import LoweredBackendModule, to_backend
torch.manual_seed(0)
lowered = to_backend(export(TwoLinears(), torch.randn(2, 4)), OpSetPartitioner(LINEAR_OPS))
parts = [lowered.graph_module.code, str(lowered.graph_signature)]
for name, module in lowered.graph_module.named_children():
    if isinstance(module, LoweredBackendModule):
        sub = module.original_module
        parts += [name, module.meta["tag"], sub.graph_module.code, str(sub.graph_signature)]
print(hashlib.sha256("\\n".join(parts).encode()).hexdigest())
"""


def test_lowering_is_the_same_whatever_the_hash_seed() -> None:
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = DETERMINISM_SCRIPT.format(tests=str(Path(__file__).parents[1]))
    digests = {
        subprocess.run(
            [sys.executable, "-c", script],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        for seed in ("0", "12345")
    }
    assert len(digests) == 1


def test_the_garbage_collector_runs_during_backend_code_and_after_lowering() -> None:
    import gc

    from torchdelegate import BackendDetails, PreprocessResult

    seen = []

    class GcWatcher(BackendDetails):
        backend_id = "TestGcWatcher"

        @staticmethod
        def preprocess(edge_program, compile_specs):  # type: ignore[no-untyped-def]
            seen.append(gc.isenabled())
            return PreprocessResult(b"")

    program = export(TwoLinears(), torch.randn(2, 4))
    assert gc.isenabled()
    to_backend(program, OpSetPartitioner(LINEAR_OPS, backend_id="TestGcWatcher"))
    assert seen == [True, True] and gc.isenabled()
