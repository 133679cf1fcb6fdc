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
    ("entry", "message"),
    [
        ({"offset": 8}, r"reads 64 bytes from offset 8 of named data 'k', which holds 64"),
        ({"offset": -1}, r"from offset -1"),
        ({"offset": True}, r"from offset True"),
        ({"offset": 0, "dtype": "int4"}, r"has dtype 'int4'"),
        ({"offset": 0, "shape": [4, -4]}, r"shape \[4, -4\]"),
    ],
)
def test_a_range_outside_its_named_data_or_of_no_size_is_refused(entry: dict[str, object], message: str) -> None:
    initializers = {"w": {"key": "k", "dtype": "float32", "shape": [4, 4], **entry}}
    with pytest.raises(FormatError, match=message):
        initializer_files(initializers, {"k": memoryview(bytes(64))})


def test_a_range_within_its_named_data_is_a_file_of_its_own() -> None:
    data = memoryview(bytes(range(64)))
    initializers = {"w": {"key": "k", "dtype": "float32", "shape": [2, 2], "offset": 16}, "v": {"key": "k"}}
    files, supplied = initializer_files(initializers, {"k": data})
    assert bytes(files["k@16"]) == bytes(range(16, 32)) and bytes(files["k"]) == bytes(range(64))
    assert supplied == {"w": ("k@16", 16), "v": ("k", 64)}
