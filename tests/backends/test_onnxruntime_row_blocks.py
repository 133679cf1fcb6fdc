"""A float weight past the largest packed size runs as products over blocks of its rows, each block a
range of the one named data that holds the weight: outputs as eager's, the weight stored once, and a
range that passes its named data refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("onnxruntime")

import torchdelegate as td  # noqa: E402
from torchdelegate.backends.onnxruntime import OnnxRuntimePartitioner, row_blocks  # noqa: E402
from torchdelegate.backends.onnxruntime.blob_header import initializer_files, model_of  # noqa: E402
from torchdelegate.errors import FormatError  # noqa: E402

VOCABULARY, WIDTH = 200, 16  # a 12.8 KB table, read by the lookup and, tied, by the head


class _Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = torch.nn.Embedding(VOCABULARY, WIDTH)
        self.norm = torch.nn.LayerNorm(WIDTH)
        self.head = torch.nn.Linear(WIDTH, VOCABULARY, bias=False)
        self.head.weight = self.embedding.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.embedding(ids)))


@pytest.fixture
def small_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Weights past 8 KB run as blocks of 4 KB (64 rows of this table): 4 blocks, the last of 8 rows."""
    monkeypatch.setattr(row_blocks, "LARGEST_PACKED", 8 * 1024)
    monkeypatch.setattr(row_blocks, "ROW_BLOCK", 4 * 1024)


def test_a_tied_head_runs_as_blocks_of_the_tables_rows_read_from_where_the_table_is_stored(
    small_blocks: None, tmp_path: Path
) -> None:
    model = _Tied().eval()
    calls = {"prefill": torch.randint(0, VOCABULARY, (1, 5)), "decode": torch.randint(0, VOCABULARY, (1, 1))}
    programs = {name: torch.export.export(model, (ids,)) for name, ids in calls.items()}
    path = tmp_path / "tied.tdp"
    td.to_edge(programs).to_backend(OnnxRuntimePartitioner()).save(path)
    table_bytes = VOCABULARY * WIDTH * 4
    assert path.stat().st_size < 1.5 * table_bytes + 64 * 1024  # the table once, not once more in blocks
    with td.load(path) as program, torch.no_grad():
        for name, ids in calls.items():
            torch.testing.assert_close(program.run(name, ids), model(ids), atol=1e-5, rtol=1e-5)
        header, _ = model_of(program.file.data(program.delegates[0].blob, "blob"), program.named_data)
    entries = header["initializers"]
    blocks = sorted((e["offset"], e["shape"][0]) for e in entries.values() if "offset" in e)
    assert blocks == [(0, 64), (64 * WIDTH * 4, 64), (128 * WIDTH * 4, 64), (192 * WIDTH * 4, 8)]
    table = [e for e in entries.values() if "offset" not in e and e["shape"] == [VOCABULARY, WIDTH]]
    assert len(table) == 1  # the lookup reads the whole table, the blocks ranges of that same named data
    assert {e["key"] for e in entries.values() if "offset" in e} == {table[0]["key"]}


@pytest.mark.parametrize(
    ("entries", "message"),
    [
        ({"w": {"offset": 64}}, r"reads past the end of named data 'k' \(64 bytes\) from offset 64"),
        ({"w": {"offset": 8}}, r"reads from offset 8"),  # not where a writer puts a block: 64-byte aligned
        ({"w": {"offset": -64}}, r"reads from offset -64"),
        ({"w": {"offset": True}}, r"reads from offset True"),
        ({"w": {"offset": 0, "dtype": "int4"}}, r"reads a range as dtype 'int4'"),
        ({"w": {"offset": 0, "shape": [4, -4]}}, r"shape \[4, -4\]"),
        ({"w": {"offset": 0, "shape": [2**64] * 3}}, r"reads a range as dtype 'float32' and shape"),
        # a key that passes for a range's location, and one location given two ranges
        ({"w": {"offset": 0}, "v": {"key": "k@0"}}, r"names named data 'k@0' \(with '@'\)"),
        ({"w": {"offset": 0}, "v": {"offset": 0, "shape": [2, 4]}}, r"read 'k@0' as two lengths"),
    ],
)
def test_a_range_outside_its_named_data_or_of_no_size_is_refused(entries: dict[str, dict], message: str) -> None:
    initializers = {name: {"key": "k", "dtype": "float32", "shape": [4, 4], **e} for name, e in entries.items()}
    data = {"k": memoryview(bytes(64)), "k@0": memoryview(bytes(64))}
    with pytest.raises(FormatError, match=message):
        initializer_files(initializers, data)


def test_a_range_within_its_named_data_is_a_file_of_its_own() -> None:
    data = memoryview(bytes(range(128)))
    initializers = {"w": {"key": "k", "dtype": "float32", "shape": [2, 2], "offset": 64}, "v": {"key": "k"}}
    files, supplied = initializer_files(initializers, {"k": data})
    assert bytes(files["k@64"]) == bytes(range(64, 80)) and bytes(files["k"]) == bytes(range(128))
    assert supplied == {"w": ("k@64", 16), "v": ("k", 128)}


class _Twice(torch.nn.Module):
    """One large weight read by two products (and by nothing else)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(VOCABULARY, WIDTH))

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(a, self.weight) - torch.nn.functional.linear(b.sin(), self.weight)


def test_two_products_of_one_weight_read_the_same_blocks(small_blocks: None, tmp_path: Path) -> None:
    model = _Twice().eval()
    a, b = torch.randn(1, 3, WIDTH), torch.randn(1, 3, WIDTH)  # 2-D ones would be a Gemm
    path = tmp_path / "twice.tdp"
    td.to_edge(torch.export.export(model, (a, b))).to_backend(OnnxRuntimePartitioner()).save(path)
    with td.load(path) as program, torch.no_grad():
        torch.testing.assert_close(program.run("forward", a, b), model(a, b), atol=1e-5, rtol=1e-5)
        header, _ = model_of(program.file.data(program.delegates[0].blob, "blob"), program.named_data)
    assert len([e for e in header["initializers"].values() if "offset" in e]) == 4  # one set of blocks


@pytest.mark.parametrize("attributes", [{}, {"transB": 1, "transBatchB": 1}, {"transB": 1, "alpha": 0.5}])
def test_a_product_that_is_not_x_times_the_transposed_weight_is_left_whole(
    small_blocks: None, attributes: dict[str, object]
) -> None:
    """``FusedMatMul`` without ``transB`` reads its weight as it is (ONNX Runtime's default is 0)."""
    ir = pytest.importorskip("onnx_ir")
    import numpy as np

    weight = ir.Value(name="w", const_value=ir.tensor(np.ones((WIDTH, VOCABULARY), np.float32), name="w"))
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([1, WIDTH]))
    product = ir.node("FusedMatMul", [x, weight], attributes, domain="com.microsoft")
    graph = ir.Graph([x], product.outputs, nodes=[product], initializers=[weight])
    model = ir.Model(graph, ir_version=10)
    assert row_blocks.row_block_products(ir, model) == {}
    assert [node.op_type for node in model.graph] == ["FusedMatMul"]
