"""Multi-method programs: to_edge, EdgeProgramManager.to_backend, preprocess_multimethod, named data."""

from __future__ import annotations

import hashlib
import warnings
from typing import Any

import pytest
import torch
from backends_for_tests import OpSetPartitioner, TorchExportBackend
from models import KVCache, TwoLinears, aten

from torchdelegate import (
    DELEGATION_TAG,
    BackendDetails,
    CapabilityPartitioner,
    DelegationSpec,
    EdgeProgramManager,
    NamedDataStore,
    Partitioner,
    PartitionError,
    PartitionResult,
    PreprocessError,
    PreprocessResult,
    to_edge,
    to_edge_transform_and_lower,
)


class Recording(BackendDetails):
    """Compiles like TorchExportBackend; records every preprocess_multimethod call."""

    calls: list[dict[str, int]] = []

    @classmethod
    def preprocess_multimethod(cls, edge_programs, compile_specs):  # type: ignore[no-untyped-def]
        cls.calls.append({m: len(p) for m, p in edge_programs.items()})
        return {
            m: [TorchExportBackend.preprocess(p, s) for p, s in zip(ps, compile_specs[m], strict=True)]
            for m, ps in edge_programs.items()
        }

    @staticmethod
    def preprocess(edge_program, compile_specs):  # type: ignore[no-untyped-def]
        raise AssertionError("preprocess_multimethod is overridden")

    init = TorchExportBackend.init
    execute = TorchExportBackend.execute


class RecordingA(Recording):
    calls: list[dict[str, int]] = []


class RecordingB(Recording):
    calls: list[dict[str, int]] = []


def two_methods() -> tuple[torch.nn.Module, EdgeProgramManager]:
    model = TwoLinears()
    programs = {
        "small": torch.export.export(model, (torch.randn(2, 4),)),
        "large": torch.export.export(model, (torch.randn(8, 4),)),
    }
    return model, to_edge(programs)


def check_runs(manager: EdgeProgramManager, model: torch.nn.Module) -> None:
    for method, rows in (("small", 2), ("large", 8)):
        x = torch.randn(rows, 4)
        torch.testing.assert_close(manager.exported_program(method).module()(x), model(x))


def test_to_edge_decomposes_functionalizes_and_keeps_method_order() -> None:
    model = KVCache()
    program = torch.export.export(model, (torch.randn(1, 4), torch.tensor([0])))
    assert any(n.target is aten.index_copy_.default for n in program.graph.nodes)
    edge = to_edge({"decode": program, "again": program})
    assert edge.methods == ["decode", "again"]
    decoded = edge.exported_program("decode")
    assert decoded.graph_signature.buffers_to_mutate == {"index_put": "cache"}
    assert decoded.state_dict["proj.weight"] is program.state_dict["proj.weight"]
    assert to_edge(program).methods == ["forward"]
    with pytest.raises(KeyError, match="no method 'forward'; the methods are 'decode', 'again'"):
        edge.exported_program()


def test_equal_state_from_separate_exports_is_stored_once() -> None:
    first, second = TwoLinears(), TwoLinears()
    second.load_state_dict(first.state_dict())
    edge = to_edge(
        {
            "a": torch.export.export(first, (torch.randn(2, 4),)),
            "b": torch.export.export(second, (torch.randn(2, 4),)),
        }
    )
    a, b = edge.exported_program("a"), edge.exported_program("b")
    assert all(a.state_dict[k] is b.state_dict[k] for k in a.state_dict)


def test_each_backend_is_called_once_with_every_method() -> None:
    model, edge = two_methods()
    Recording.calls.clear()
    lowered = edge.to_backend(
        OpSetPartitioner({aten.relu.default, aten.addmm.default, aten.permute.default}, "Recording")
    )
    assert Recording.calls == [{"small": 2, "large": 2}]
    check_runs(lowered, model)


def test_one_partitioner_sending_nodes_to_two_backends_calls_each_once_with_its_own() -> None:
    class TwoBackends(Partitioner):
        def partition(self, exported_program):  # type: ignore[no-untyped-def]
            for node in exported_program.graph.nodes:
                if node.target is aten.relu.default:
                    node.meta[DELEGATION_TAG] = "a"
                elif node.target is aten.sigmoid.default:
                    node.meta[DELEGATION_TAG] = "b"
            return PartitionResult(
                exported_program, {"a": DelegationSpec("RecordingA"), "b": DelegationSpec("RecordingB")}
            )

    model, edge = two_methods()
    RecordingA.calls.clear()
    RecordingB.calls.clear()
    lowered = edge.to_backend(TwoBackends())
    assert RecordingA.calls == [{"small": 1, "large": 1}] and RecordingB.calls == [{"small": 1, "large": 1}]
    backends = {m: [d.backend_id for d in ds] for m, ds in lowered.delegates().items()}
    assert backends == {"small": ["RecordingA", "RecordingB"], "large": ["RecordingA", "RecordingB"]}
    check_runs(lowered, model)


def test_a_delegation_spec_for_all_methods_and_a_per_method_dict() -> None:
    model, edge = two_methods()
    Recording.calls.clear()
    whole = edge.to_backend(DelegationSpec("Recording"))
    assert Recording.calls == [{"small": 1, "large": 1}]
    assert {m: len(d) for m, d in whole.delegates().items()} == {"small": 1, "large": 1}
    check_runs(whole, model)
    only_large = edge.to_backend({"large": DelegationSpec("Recording")})
    assert only_large.exported_program("small") is edge.exported_program("small")
    assert {m: len(d) for m, d in only_large.delegates().items()} == {"small": 0, "large": 1}
    with pytest.raises(PartitionError, match="no method 'medium'; the methods are 'small', 'large'"):
        edge.to_backend({"medium": DelegationSpec("Recording")})


def test_a_partitioner_list_is_applied_in_order_first_claims_first() -> None:
    model, edge = two_methods()
    first = OpSetPartitioner({aten.relu.default}, "RecordingA")
    rest = OpSetPartitioner(lambda n: isinstance(n.target, torch._ops.OpOverload), "RecordingB")
    lowered = edge.to_backend([first, rest])
    for delegates in lowered.delegates().values():
        assert sorted(d.backend_id for d in delegates).count("RecordingA") == 1
        relu_owner = [d for d in delegates if any(n.target is aten.relu.default for n in d.original_module.graph.nodes)]
        assert [d.backend_id for d in relu_owner] == ["RecordingA"]
    check_runs(lowered, model)


def test_wrong_results_name_the_backend_the_method_and_what_was_expected() -> None:
    class TooFew(BackendDetails):
        @classmethod
        def preprocess_multimethod(cls, edge_programs, compile_specs):  # type: ignore[no-untyped-def]
            return {m: [PreprocessResult(b"")] for m in edge_programs}

        @staticmethod
        def preprocess(edge_program, compile_specs):  # type: ignore[no-untyped-def]
            return PreprocessResult(b"")

    class WrongType(TooFew):
        @classmethod
        def preprocess_multimethod(cls, edge_programs, compile_specs):  # type: ignore[no-untyped-def]
            return {m: ["blob"] * len(p) for m, p in edge_programs.items()}

    class MissingMethod(TooFew):
        @classmethod
        def preprocess_multimethod(cls, edge_programs, compile_specs):  # type: ignore[no-untyped-def]
            return {"small": [PreprocessResult(b"")] * len(edge_programs["small"])}

    _, edge = two_methods()
    partitioner = OpSetPartitioner({aten.relu.default, aten.add.Tensor}, "TooFew")  # two partitions
    with pytest.raises(
        PreprocessError,
        match=r"'TooFew': preprocess_multimethod returned 1 results for method 'small'; expected a list of 2",
    ):
        edge.to_backend(partitioner)
    with pytest.raises(
        PreprocessError, match=r"'WrongType' returned str for method 'small'; expected a PreprocessResult"
    ):
        edge.to_backend(OpSetPartitioner({aten.relu.default}, "WrongType"))
    with pytest.raises(
        PreprocessError, match=r"'MissingMethod': preprocess_multimethod returned \['small'\]; expected .*'large'"
    ):
        edge.to_backend(OpSetPartitioner({aten.relu.default}, "MissingMethod"))


class PerMethodWeights(Recording):
    """Each result stores the partition's weights under "<method>/<fqn>": same bytes, other keys."""

    @classmethod
    def preprocess_multimethod(cls, edge_programs, compile_specs):  # type: ignore[no-untyped-def]
        results = {}
        for method, programs in edge_programs.items():
            results[method] = []
            for program in programs:
                store = NamedDataStore()
                for fqn, tensor in program.state_dict.items():
                    store.add_named_data(f"{cls.key_prefix(method)}{fqn}", tensor, alignment=16)
                results[method].append(TorchExportBackend.preprocess(program, []))
                results[method][-1].data_store_output = store.get_named_data_store_output()
        return results

    @staticmethod
    def key_prefix(method: str) -> str:
        return f"{method}/"


class SharedKeyWeights(PerMethodWeights):
    @staticmethod
    def key_prefix(method: str) -> str:
        return ""


def test_named_data_is_deduplicated_across_methods() -> None:
    model, edge = two_methods()
    lowered = edge.to_backend(OpSetPartitioner({aten.permute.default, aten.addmm.default}, "PerMethodWeights"))
    summary = lowered.named_data_summary()
    weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    assert (summary.entries, summary.unique_buffers) == (8, 4)
    assert summary.unique_bytes == weights and summary.saved_bytes == weights
    assert lowered.named_data.owners["large/l1.weight"] == "large:tag0 on PerMethodWeights"
    same_keys = edge.to_backend(OpSetPartitioner({aten.permute.default, aten.addmm.default}, "SharedKeyWeights"))
    assert same_keys.named_data_summary().entries == 4
    assert "4 named data entries in 4 unique buffers" in str(same_keys.named_data_summary())
    check_runs(lowered, model)


def test_a_key_stored_with_other_bytes_names_both_delegates() -> None:
    class Conflicting(PerMethodWeights):
        @classmethod
        def preprocess_multimethod(cls, edge_programs, compile_specs):  # type: ignore[no-untyped-def]
            results = {}
            for method, programs in edge_programs.items():
                store = NamedDataStore()
                store.add_named_data("config", hashlib.sha256(method.encode()).digest())
                results[method] = [PreprocessResult(b"", data_store_output=store.get_named_data_store_output())]
                results[method] += [PreprocessResult(b"") for _ in programs[1:]]
            return results

    _, edge = two_methods()
    both = r"\(by small:tag0 on Conflicting, now by large:tag0 on Conflicting\)"
    with pytest.raises(PreprocessError, match=r"'config' is stored twice with different bytes " + both):
        edge.to_backend(OpSetPartitioner({aten.relu.default}, "Conflicting"))


def test_the_original_manager_is_unchanged() -> None:
    model, edge = two_methods()
    before = {m: (edge.exported_program(m), edge.exported_program(m).graph_module.code) for m in edge.methods}
    lowered = edge.to_backend(OpSetPartitioner({aten.relu.default}, "Recording"))
    assert lowered is not edge and len(edge.named_data) == 0
    for method, (program, code) in before.items():
        assert edge.exported_program(method) is program and program.graph_module.code == code
    assert {m: len(d) for m, d in edge.delegates().items()} == {"small": 0, "large": 0}
    check_runs(edge, model)


def test_transform_runs_passes_on_copies() -> None:
    _, edge = two_methods()

    def relu_to_gelu(program: torch.export.ExportedProgram) -> None:
        for node in program.graph.nodes:
            if node.target is aten.relu.default:
                node.target = aten.gelu.default

    transformed = edge.transform([relu_to_gelu])
    for method in edge.methods:
        targets = {n.target for n in transformed.exported_program(method).graph.nodes}
        assert aten.gelu.default in targets and aten.relu.default not in targets
        assert aten.relu.default in {n.target for n in edge.exported_program(method).graph.nodes}
    only_small = edge.transform({"small": [relu_to_gelu]})
    assert only_small.exported_program("large") is edge.exported_program("large")


class LinearKeeper(Partitioner):
    """Asks for aten.linear to stay whole; claims it only when ``claim``."""

    def __init__(self, claim: bool) -> None:
        self.claim = claim

    def ops_to_not_decompose(self, exported_program):  # type: ignore[no-untyped-def]
        return [aten.linear.default], None

    def partition(self, exported_program):  # type: ignore[no-untyped-def]
        if self.claim:
            for node in exported_program.graph.nodes:
                if node.target is aten.linear.default:
                    node.meta[DELEGATION_TAG] = f"linear_{node.name}"
        tags = {
            n.meta[DELEGATION_TAG]: DelegationSpec("Recording")
            for n in exported_program.graph.nodes
            if DELEGATION_TAG in n.meta
        }
        return PartitionResult(exported_program, tags)


def test_to_edge_transform_and_lower_keeps_the_ops_a_partitioner_asks_for() -> None:
    model = TwoLinears()
    program = torch.export.export(model, (torch.randn(2, 4),))
    lowered = to_edge_transform_and_lower(program, partitioner=[LinearKeeper(claim=True)])
    (delegates,) = lowered.delegates().values()
    assert [[n.target for n in d.original_module.graph.nodes if n.op == "call_function"] for d in delegates] == [
        [aten.linear.default],
        [aten.linear.default],
    ]
    x = torch.randn(2, 4)
    torch.testing.assert_close(lowered.exported_program().module()(x), model(x))


def test_an_op_kept_whole_but_unclaimed_is_decomposed_with_a_warning() -> None:
    model = TwoLinears()
    program = torch.export.export(model, (torch.randn(2, 4),))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lowered = to_edge_transform_and_lower(
            {"forward": program}, partitioner={"forward": [LinearKeeper(claim=False)]}, transform_passes=[]
        )
    assert any("aten.linear.default kept whole for a backend that did not claim" in str(w.message) for w in caught)
    targets = {n.target for n in lowered.exported_program().graph.nodes}
    assert aten.linear.default not in targets and aten.addmm.default in targets


def test_a_buffer_two_methods_share_cannot_be_one_delegates_private_state() -> None:
    from torchdelegate import tag_constant_data, tag_mutated_buffers

    class OwnEverything(Partitioner):
        def partition(self, exported_program):  # type: ignore[no-untyped-def]
            for node in exported_program.graph.nodes:
                if node.op == "call_function":
                    node.meta[DELEGATION_TAG] = "all"
            tag_constant_data(exported_program)
            tag_mutated_buffers(exported_program)
            return PartitionResult(exported_program, {"all": DelegationSpec("Recording")})

    model = KVCache()
    program = torch.export.export(model, (torch.randn(1, 4), torch.tensor([0])))
    edge = to_edge({"prefill": program, "decode": program})
    with pytest.raises(
        PartitionError,
        match=r"buffer 'cache' would be the private state of delegate 'prefill:all', but method 'decode' uses it too",
    ):
        edge.to_backend(OwnEverything())
    with pytest.raises(PartitionError, match="private state of delegate 'decode:all', but method 'prefill'"):
        edge.to_backend({"decode": OwnEverything()})  # prefill, left to torch, still uses it
    to_edge(program).to_backend(OwnEverything())  # a single method may own its cache


class Cache(torch.nn.Module):
    """``write`` stores x at a position; ``read`` returns the cache: two methods, one buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cache", torch.zeros(2, 4))

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        self.cache.index_copy_(0, pos, x.relu())
        return self.cache.sum(0)


class ReadCache(torch.nn.Module):
    """The reading method: the same buffer under the same name (methods share state by name)."""

    def __init__(self, owner: Cache) -> None:
        super().__init__()
        self.register_buffer("cache", owner.cache)

    def forward(self, scale: torch.Tensor) -> torch.Tensor:
        return (self.cache * scale).relu()


def cache_methods() -> tuple[torch.export.ExportedProgram, torch.export.ExportedProgram]:
    cache = Cache()
    write = torch.export.export(cache, (torch.randn(1, 4), torch.tensor([0])))
    read = torch.export.export(ReadCache(cache), (torch.ones(1),))
    return write, read


@pytest.mark.parametrize(
    "lowering",
    [
        lambda edge: edge.to_backend({"write": DelegationSpec("Recording")}),
        lambda edge: edge.to_backend({"read": DelegationSpec("Recording")}),
        lambda edge: edge.to_backend(
            OpSetPartitioner({aten.relu.default, aten.mul.Tensor, aten.sum.dim_IntList}, "Recording")
        ),
        lambda edge: edge.to_backend({"write": [OpSetPartitioner({aten.relu.default}, "Recording")], "read": []}),
    ],
)
def test_methods_share_a_buffer_whatever_is_lowered(lowering) -> None:  # type: ignore[no-untyped-def]
    write, read = cache_methods()
    edge = to_edge({"write": write, "read": read})
    lowered = lowering(edge)
    write_module, read_module = (lowered.exported_program(m).module() for m in ("write", "read"))
    x = torch.tensor([[1.0, -2.0, 3.0, 4.0]])
    write_module(x, torch.tensor([1]))
    torch.testing.assert_close(read_module(torch.ones(1)), torch.tensor([[0.0] * 4, [1.0, 0.0, 3.0, 4.0]]))
    assert torch.count_nonzero(write.state_dict["cache"]) == 0  # the caller's buffer is untouched


def test_every_stage_sees_the_named_data_of_the_whole_call() -> None:
    model, edge = two_methods()
    first = OpSetPartitioner({aten.permute.default, aten.addmm.default}, "PerMethodWeights")
    second = OpSetPartitioner({aten.relu.default}, "TestNamedWeights")
    lowered = edge.to_backend([second, first])
    keys = {len(d._named_data.get_named_data_store_output()) for ds in lowered.delegates().values() for d in ds}
    assert keys == {len(lowered.named_data)}
    check_runs(lowered, model)


def test_ops_to_not_decompose_accepts_packets() -> None:
    class Packet(LinearKeeper):
        def ops_to_not_decompose(self, exported_program):  # type: ignore[no-untyped-def]
            return [aten.linear], None

    program = torch.export.export(TwoLinears(), (torch.randn(2, 4),))
    lowered = to_edge_transform_and_lower(program, partitioner=[Packet(claim=True)])
    assert len(lowered.delegates()["forward"]) == 2


def test_to_edge_transform_and_lower_gives_every_stage_the_whole_named_data() -> None:
    model = TwoLinears()
    programs = {
        "small": torch.export.export(model, (torch.randn(2, 4),)),
        "large": torch.export.export(model, (torch.randn(8, 4),)),
    }
    first = OpSetPartitioner({aten.relu.default}, "TestNamedWeights")
    second = OpSetPartitioner({aten.permute.default, aten.addmm.default}, "PerMethodWeights")
    lowered = to_edge_transform_and_lower(programs, partitioner=[first, second])
    keys = {len(d._named_data.get_named_data_store_output()) for ds in lowered.delegates().values() for d in ds}
    assert keys == {len(lowered.named_data)}
    check_runs(lowered, model)


class FailsInLargeMethod(BackendDetails):
    """Compiles the ``small`` method's partitions, then fails on the ``large`` method's."""

    @staticmethod
    def preprocess(edge_program, compile_specs):  # type: ignore[no-untyped-def]
        if any(n.meta.get("val") is not None and n.meta["val"].shape[:1] == (8,) for n in edge_program.graph.nodes):
            raise RuntimeError("cannot compile the large batch")
        return PreprocessResult(b"ok")


def test_a_manager_whose_lowering_fails_halfway_is_unchanged_and_usable() -> None:
    from backends_for_tests import NamedWeightsBackend

    model, edge = two_methods()
    # a manager that already holds delegates and named data from an earlier lowering
    edge = edge.to_backend(OpSetPartitioner({aten.addmm.default}, NamedWeightsBackend.backend_id))
    programs = {m: edge.exported_program(m) for m in edge.methods}
    codes = {m: p.graph_module.code for m, p in programs.items()}
    tensors = {m: {k: (t, t.clone()) for k, t in p.state_dict.items()} for m, p in programs.items()}
    named, named_bytes = edge.named_data, [bytes(b) for b in edge.named_data.buffers]
    delegates = {m: [d.backend_id for d in ds] for m, ds in edge.delegates().items()}
    assert named and all(delegates.values())
    failed = r"'FailsInLargeMethod' failed to preprocess partition '\w+' of method 'large'"
    with pytest.raises(PreprocessError, match=failed):
        edge.to_backend(OpSetPartitioner({aten.relu.default}, "FailsInLargeMethod"))
    assert edge.methods == list(programs)
    for method, program in programs.items():
        assert edge.exported_program(method) is program and program.graph_module.code == codes[method]
        for name, (tensor, value) in tensors[method].items():
            assert program.state_dict[name] is tensor and torch.equal(tensor, value)
    assert edge.named_data is named and [bytes(b) for b in named.buffers] == named_bytes
    assert {m: [d.backend_id for d in ds] for m, ds in edge.delegates().items()} == delegates
    check_runs(edge, model)
    check_runs(edge.to_backend(OpSetPartitioner({aten.relu.default}, "Recording")), model)


class BiasAndNoBias(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.with_bias = torch.nn.Linear(4, 4)
        self.without_bias = torch.nn.Linear(4, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.without_bias(self.with_bias(x).relu())


def test_ops_to_not_decompose_keeps_an_op_whole_only_on_the_nodes_its_filter_accepts() -> None:
    class BiasedLinearsOnly(LinearKeeper):
        def ops_to_not_decompose(self, exported_program):  # type: ignore[no-untyped-def]
            return [aten.linear.default], lambda node: len(node.args) > 2 and node.args[2] is not None

    model = BiasAndNoBias()
    program = torch.export.export(model, (torch.randn(2, 4),))
    before = program.graph_module.code
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lowered = to_edge_transform_and_lower(program, partitioner=[BiasedLinearsOnly(claim=True)])
    assert not [w for w in caught if "kept whole" in str(w.message)]  # the refused linear was never kept
    (delegate,) = lowered.delegates()["forward"]
    claimed = [n for n in delegate.original_module.graph.nodes if n.op == "call_function"]
    assert [n.target for n in claimed] == [aten.linear.default] and len(claimed[0].args) == 3
    residual = {n.target for n in lowered.exported_program().graph.nodes if n.op == "call_function"}
    assert aten.linear.default not in residual and aten.mm.default in residual
    assert program.graph_module.code == before and not any(
        "torchdelegate_keep_whole" in n.meta for n in program.graph.nodes
    )
    x = torch.randn(2, 4)
    torch.testing.assert_close(lowered.exported_program().module()(x), model(x))


class _Recurrent(torch.nn.Module):
    """The zoo's LSTM: two stacked layers over five steps, then a linear head. Its ``linear``s but the
    head's exist only inside ``aten.lstm``'s decomposition."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = torch.nn.LSTM(16, 32, num_layers=2, batch_first=True)
        self.head = torch.nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(x)[0])


class _LinearsTaking(CapabilityPartitioner):
    """Claims ``aten.linear`` kept whole, on the nodes ``accepts`` takes: the filter ExecuTorch's backends give."""

    def __init__(self, accepts: Any) -> None:
        super().__init__({aten.linear.default}, DelegationSpec("reference"))
        self.accepts = accepts

    def ops_to_not_decompose(self, exported_program):  # type: ignore[no-untyped-def]
        return [aten.linear.default], self.accepts


def _delegated_linears(lowered: EdgeProgramManager) -> list[tuple[int, int]]:
    """(in, out) features of each delegated linear, in delegate order."""
    return [
        tuple(n.args[1].meta["val"].shape[::-1])  # type: ignore[union-attr]
        for d in lowered.delegates()["forward"]
        for n in d.original_module.graph.nodes
        if n.target is aten.linear.default
    ]


def test_the_op_filter_sees_the_linears_an_lstms_decomposition_makes() -> None:
    model = _Recurrent().eval()
    x = torch.randn(2, 5, 16)
    program = torch.export.export(model, (x,))
    assert sum(n.target is aten.linear.default for n in program.graph.nodes) == 1  # the head's; the rest is aten.lstm

    every = to_edge_transform_and_lower(program, partitioner=[_LinearsTaking(lambda node: True)])
    # per layer, one input projection over all 5 steps and one hidden projection per step; then the head
    assert sorted(_delegated_linears(every)) == sorted(
        [(16, 128), *[(32, 128)] * 5, (32, 128), *[(32, 128)] * 5, (32, 8)]
    )
    assert not any(n.target is aten.linear.default for n in every.exported_program().graph.nodes)
    torch.testing.assert_close(every.exported_program().module()(x), model(x))

    def from_the_input(node: Any) -> bool:
        return node.args[1].meta["val"].shape[1] == 16

    first_layer = to_edge_transform_and_lower(program, partitioner=[_LinearsTaking(from_the_input)])
    assert _delegated_linears(first_layer) == [(16, 128)]  # the first layer's input projection
    residual = {n.target for n in first_layer.exported_program().graph.nodes if n.op == "call_function"}
    assert aten.linear.default not in residual  # the refused ones decomposed
    torch.testing.assert_close(first_layer.exported_program().module()(x), model(x))
