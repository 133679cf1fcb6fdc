"""The reference backend: takes what other backends left, shares weights, runs after loading."""

from pathlib import Path

import torch
from backends_for_tests import OpSetPartitioner
from models import SharedConstant, TwoLinears, export

import torchdelegate as td
from torchdelegate.backends.reference import ReferencePartitioner

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
