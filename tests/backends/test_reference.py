"""The reference backend: takes what other backends left, shares weights, runs after loading."""

from pathlib import Path

import pytest
import torch
from backends_for_tests import OpSetPartitioner
from models import SharedConstant, TwiceInner, TwoLinears, export

import torchdelegate as td
from torchdelegate.backends.reference import ReferenceBackend, ReferencePartitioner
from torchdelegate.delegate.trust import trusting

aten = torch.ops.aten


def test_last_in_a_list_it_claims_what_the_first_backend_left_without_cycles(tmp_path: Path) -> None:
    model = TwoLinears()
    x = torch.randn(2, 4)
    lowered = td.to_edge(export(model, x)).to_backend(
        [OpSetPartitioner({aten.sigmoid.default}), ReferencePartitioner()]
    )
    backends = [d.backend_id for d in lowered.delegates()["forward"]]
    assert backends == ["reference", "TestTorchExport", "reference"]
    graph = lowered.exported_program().graph
    assert not [n for n in graph.nodes if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)]
    torch.testing.assert_close(lowered.exported_program().module()(x), model(x))
    lowered.save(tmp_path / "m.tdp")
    with td.load(tmp_path / "m.tdp") as program:
        torch.testing.assert_close(program.run("forward", x), model(x))


def test_a_weight_read_by_two_partitions_is_one_named_data_entry() -> None:
    model = SharedConstant()
    x = torch.randn(4, 4)
    lowered = td.to_edge(export(model, x)).to_backend(
        [OpSetPartitioner({aten.sigmoid.default}), ReferencePartitioner()]
    )
    assert len(lowered.delegates()["forward"]) == 3
    summary = lowered.named_data_summary()
    assert summary.unique_buffers == 1 and summary.unique_bytes == 64
    for got, expected in zip(lowered.exported_program().module()(x), model(x), strict=True):
        torch.testing.assert_close(got, expected)


class NativeInner(ReferenceBackend):
    """The reference backend declaring ``runs_native_code``: AOTInductor's trust, without its compile."""

    backend_id = "test_reference_native_inner"
    runs_native_code = True


def test_check_blob_gives_a_nested_delegate_the_trust_init_would() -> None:
    x = torch.randn(2, 4)
    inner = td.to_backend(NativeInner.backend_id, td.to_edge(export(TwoLinears(), x)).exported_program(), [])

    outer = td.to_edge(torch.export.export(TwiceInner(inner), (x,))).to_backend(td.DelegationSpec("reference"))
    (delegate,) = outer.delegates()["forward"]
    blob, named = memoryview(delegate.processed_bytes), td.NamedDataMap(delegate.named_data_store_output)
    ReferenceBackend.check_blob(blob, [], named)  # this process's own lowering: any backend
    with trusting(frozenset({NativeInner.backend_id})):
        ReferenceBackend.check_blob(blob, [], named)
    with trusting(frozenset({"reference"})), pytest.raises(td.UntrustedCodeError, match=r"\(nested\): backend 'test_"):
        ReferenceBackend.check_blob(blob, [], named)  # the outer backend's trust is not the inner one's
