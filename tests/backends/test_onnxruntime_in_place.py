"""The ONNX Runtime backend writes a KV cache where it lies: a buffer written at some positions of an
inner dimension is scattered into the program's own tensor, through IO binding, not copied back."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import torchdelegate as td

pytest.importorskip("onnxruntime")
import onnx  # noqa: E402

from torchdelegate.backends.onnxruntime import OnnxRuntimePartitioner  # noqa: E402
from torchdelegate.backends.onnxruntime.blob_header import model_of  # noqa: E402
from torchdelegate.backends.onnxruntime.cache_writes import cache_writes_in_place  # noqa: E402


class Cache(torch.nn.Module):
    """A cache of [batch, heads, positions, width] written at ``positions``, then read whole."""

    def __init__(self, read_before_write: bool = False) -> None:
        super().__init__()
        self.register_buffer("cache", torch.zeros(1, 3, 16, 8))
        self.read_before_write = read_before_write

    def forward(self, positions: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        before = self.cache.sum() if self.read_before_write else 0
        self.cache.index_copy_(2, positions, values)
        return self.cache.sum(dim=2) * 2 + before


def _lowered(tmp_path: Path, module: torch.nn.Module) -> Path:
    calls = {
        "prefill": (torch.arange(4), torch.randn(1, 3, 4, 8)),
        "decode": (torch.tensor([4]), torch.randn(1, 3, 1, 8)),
    }
    programs = {method: torch.export.export(module, args) for method, args in calls.items()}
    path = tmp_path / "cache.tdp"
    td.to_edge(programs).to_backend(OnnxRuntimePartitioner()).save(path)
    return path


def _calls() -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    calls = [("prefill", torch.arange(4), torch.randn(1, 3, 4, 8, generator=generator))]
    calls += [("decode", torch.tensor([p]), torch.randn(1, 3, 1, 8, generator=generator)) for p in range(4, 9)]
    return calls


def _written_in_place(program: td.Program) -> list[int]:
    """How many outputs each delegate writes into its input's memory."""
    program.initialize()
    return [len(delegate._handle.written) for delegate in program._delegates]


@pytest.mark.parametrize("read_before_write", [False, True])
def test_a_cache_written_in_place_gives_eager_outputs_and_state(tmp_path: Path, read_before_write: bool) -> None:
    """Where the model reads the cache before writing it, the write cannot share the cache's memory:
    it is copied back as before, with the same results."""
    eager = Cache(read_before_write)
    path = _lowered(tmp_path, Cache(read_before_write))
    with td.load(path) as program, torch.no_grad():
        assert _written_in_place(program) == ([0, 0] if read_before_write else [1, 1])
        for method, positions, values in _calls():
            torch.testing.assert_close(program.run(method, positions, values), eager(positions, values))
        again = program.run("decode", torch.tensor([9]), torch.ones(1, 3, 1, 8))
    torch.testing.assert_close(again, eager(torch.tensor([9]), torch.ones(1, 3, 1, 8)))


def test_the_cache_is_one_scatter_on_the_buffer_with_no_transposed_copy(tmp_path: Path) -> None:
    path = _lowered(tmp_path, Cache())
    with td.load(path) as program:
        for record in program.delegates:
            _, model = model_of(program.file.data(record.blob, "blob"), program.named_data)
            graph = onnx.ModelProto.FromString(bytes(model)).graph
            nodes = [node for top in graph.node for a in top.attribute if a.HasField("g") for node in a.g.node]
            nodes += list(graph.node)
            assert "Transpose" not in {node.op_type for node in nodes}
            scatters = [node for node in nodes if node.op_type == "ScatterND"]
            inputs = {value.name for value in graph.input}
            assert len(scatters) == 1 and scatters[0].input[0] in inputs


def test_the_rewrite_leaves_the_callers_program_unchanged() -> None:
    program = torch.export.export(Cache(), (torch.tensor([1]), torch.randn(1, 3, 1, 8))).run_decompositions({})
    before = str(program.graph)
    rewritten = cache_writes_in_place(program)
    assert str(program.graph) == before
    targets = [node.target for node in rewritten.graph.nodes if node.op == "call_function"]
    assert torch.ops.aten.index_put.default in targets and torch.ops.aten.index_copy.default not in targets
    positions, values = torch.tensor([2]), torch.randn(1, 3, 1, 8)
    expected = Cache()(positions, values)
    torch.testing.assert_close(rewritten.module()(positions, values), expected)


def test_arrays_a_caller_reuses_and_changes_in_place_are_read_afresh_at_each_call(tmp_path: Path) -> None:
    """A decode loop passes the same arrays each step with new values written into them (the binding
    is kept, the memory read again); a new array, or one of another layout, is bound in its place."""
    import numpy as np

    eager = Cache()
    with td.load(_lowered(tmp_path, Cache())) as program, torch.no_grad():
        decode = program.method("decode")
        positions, values = np.zeros(1, np.int64), np.zeros((1, 3, 1, 8), np.float32)
        for position in range(5):
            positions[0], values[...] = position, position + 1.0
            expected = eager(torch.from_numpy(positions.copy()), torch.from_numpy(values.copy()))
            np.testing.assert_allclose(decode(positions, values), expected.numpy(), rtol=1e-6)
        wide = np.full((1, 3, 2, 8), 7.0, np.float32)
        for other in (np.full((1, 3, 1, 8), 6.0, np.float32), wide[:, :, :1], wide[:, :, 1:].copy()):
            positions[0] += 1
            expected = eager(torch.from_numpy(positions.copy()), torch.from_numpy(other.copy()))
            np.testing.assert_allclose(decode(positions, other), expected.numpy(), rtol=1e-6)


class Steps(torch.nn.Module):
    """A cache of [1, positions, width] written at ``positions`` from rows reshaped by their number."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cache", torch.zeros(1, 16, 8))

    def forward(self, positions: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        self.cache.index_copy_(1, positions, rows.reshape(1, positions.shape[0], 8) * 2)
        return self.cache.sum(dim=1)


def test_a_step_that_reuses_its_arrays_and_size_binds_nothing_again(tmp_path: Path) -> None:
    """A method exported for any number of positions (an LLM's decode exported as its prefill) hands its
    delegate the symbolic size as a Python int: the same size again, with the same arrays, binds nothing
    anew; another size is bound, and back again, each call computing what eager computes."""
    import numpy as np

    length = torch.export.Dim("length", min=1, max=8)
    example = (torch.arange(4), torch.randn(4, 8))
    program = torch.export.export(Steps(), example, dynamic_shapes=({0: length}, {0: length}))
    path = tmp_path / "steps.tdp"
    td.to_edge({"decode": program}).to_backend(OnnxRuntimePartitioner()).save(path)
    eager = Steps()
    with td.load(path) as loaded, torch.no_grad():
        decode = loaded.method("decode")
        one = np.zeros(1, np.int64), np.zeros((1, 8), np.float32)
        two = np.zeros(2, np.int64), np.zeros((2, 8), np.float32)
        decode(*one)
        (delegate,) = loaded._delegates
        binding = delegate._handle._binding
        assert binding is not None and any(isinstance(value, int) for value in binding._kept), binding._kept
        bound = []
        rebind = binding._bind
        binding._bind = lambda inputs: bound.append(len(inputs)) or rebind(inputs)  # type: ignore[method-assign]
        for step, (positions, rows) in enumerate([one, one, one, two, two, one, one]):
            positions[:] = np.arange(step, step + len(positions))
            rows[...] = step + 1.0
            expected = eager(torch.from_numpy(positions.copy()), torch.from_numpy(rows.copy()))
            np.testing.assert_allclose(decode(positions, rows), expected.numpy(), rtol=1e-6)
        assert len(bound) == 2, bound  # at the change of size, and back
