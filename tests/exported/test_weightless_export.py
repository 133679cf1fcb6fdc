"""Export without weights: a model built over fake tensors, its program bound to safetensors files by
memory map — outputs equal to the eager model's, weights that are the file's pages, a bfloat16
checkpoint read as stored, and clear errors for a checkpoint that does not fit the model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from torchdelegate.errors import CheckpointError
from torchdelegate.exported import weightless_export
from torchdelegate.exported.safetensors_weights import SafetensorsWeights
from torchdelegate.exported.weightless_export import bind_weights, export_lazily, weightless


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(50, 16)
        self.norm = torch.nn.LayerNorm(16)
        self.up = torch.nn.Linear(16, 32)
        self.down = torch.nn.Linear(32, 8, bias=False)
        self.register_buffer("scale", torch.full((8,), 0.5))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(self.norm(self.embed(tokens))))) * self.scale


TOKENS = (torch.tensor([[1, 7, 3, 49]]),)


def _saved(path: Path, dtype: torch.dtype = torch.float32) -> Block:
    torch.manual_seed(0)
    model = Block().eval()
    save_file({k: v.to(dtype).contiguous() for k, v in model.state_dict().items()}, str(path))
    return model


def _mapped(tensor: torch.Tensor, weights: SafetensorsWeights, name: str) -> bool:
    """Whether ``tensor`` is the view of ``name``'s bytes in its file's mapping."""
    location = weights.locations[name]
    mapping = weights._maps[location.file]
    start = torch.frombuffer(mapping, dtype=torch.uint8, count=1).data_ptr()
    return bool(tensor.data_ptr() == start + location.start)


def test_a_lazily_exported_program_computes_what_the_eager_model_does(tmp_path: Path) -> None:
    model = _saved(tmp_path / "block.safetensors")
    program = export_lazily(Block, TOKENS, weights=tmp_path / "block.safetensors")
    assert torch.equal(program.module()(*TOKENS), model(*TOKENS))
    assert torch.equal(program.module()(*TOKENS), torch.export.export(model, TOKENS).module()(*TOKENS))


def test_bound_weights_are_views_of_the_files_pages_shared_by_every_method(tmp_path: Path) -> None:
    _saved(tmp_path / "model.safetensors")
    with weightless():
        model = Block().eval()
    programs = {
        "one": torch.export.export(model, TOKENS),
        "two": torch.export.export(model, (torch.tensor([[4, 4]]),)),
    }
    weights = SafetensorsWeights(tmp_path)  # a directory's model.safetensors
    bound = bind_weights(programs, weights)
    for name in ("up.weight", "embed.weight", "scale"):
        assert _mapped(bound["one"].state_dict[name], weights, name)
        assert bound["one"].state_dict[name] is bound["two"].state_dict[name]
    assert all(type(v).__name__ == "FakeTensor" for v in programs["one"].state_dict.values())  # the caller's: unchanged


def test_pages_read_are_let_go_on_release(tmp_path: Path) -> None:
    _saved(tmp_path / "block.safetensors")
    weights = SafetensorsWeights(tmp_path / "block.safetensors")
    assert weights["up.weight"].sum().item() == weights["up.weight"].sum().item()
    weights.release("up.weight")  # a hint: the values read again are the file's
    assert torch.equal(weights["up.weight"], _saved(tmp_path / "again.safetensors").up.weight)


def test_a_bfloat16_checkpoint_is_bound_as_stored_and_converted_where_the_graph_reads_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _saved(tmp_path / "block.safetensors", torch.bfloat16)
    rounded = model.to(torch.bfloat16).to(torch.float32)
    small = export_lazily(Block, TOKENS, weights=tmp_path / "block.safetensors")  # tensors of bytes: converted
    assert all(v.dtype == torch.float32 for v in small.state_dict.values())
    assert not [n for n in small.graph.nodes if n.target is torch.ops.aten._to_copy.default]
    monkeypatch.setattr(weightless_export, "SMALLEST_BOUND_AS_STORED", 0)  # as a model's large weights are
    program = export_lazily(Block, TOKENS, weights=tmp_path / "block.safetensors")
    assert program.state_dict["up.weight"].dtype == torch.bfloat16
    casts = [n for n in program.graph.nodes if n.target is torch.ops.aten._to_copy.default]
    assert len(casts) == len(program.state_dict)
    for lowered in (small, program):
        torch.testing.assert_close(lowered.module()(*TOKENS), rounded(*TOKENS), rtol=0, atol=1e-6)


def test_a_sharded_checkpoint_is_read_through_its_index(tmp_path: Path) -> None:
    model = _saved(tmp_path / "whole.safetensors")
    state = model.state_dict()
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[:3], "model-00002-of-00002.safetensors": names[3:]}
    for shard, held in shards.items():
        save_file({k: state[k].contiguous() for k in held}, str(tmp_path / shard))
    weight_map = {name: shard for shard, held in shards.items() for name in held}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (tmp_path / "whole.safetensors").unlink()
    program = export_lazily(Block, TOKENS, weights=tmp_path)
    assert torch.equal(program.module()(*TOKENS), model(*TOKENS))


def test_a_checkpoint_that_does_not_fit_the_model_is_refused_by_name(tmp_path: Path) -> None:
    model = _saved(tmp_path / "block.safetensors")
    state = {k: v for k, v in model.state_dict().items() if k != "down.weight"}
    save_file(state, str(tmp_path / "missing.safetensors"))
    with pytest.raises(CheckpointError, match=r"state 'down.weight' \(float32 \[8, 32\]\) is not in the checkpoint"):
        export_lazily(Block, TOKENS, weights=tmp_path / "missing.safetensors")
    save_file({**state, "down.weight": torch.zeros(8, 16)}, str(tmp_path / "shape.safetensors"))
    with pytest.raises(CheckpointError, match=r"is float32 \[8, 32\] in the program but float32 \[8, 16\] in the"):
        export_lazily(Block, TOKENS, weights=tmp_path / "shape.safetensors")
    (tmp_path / "broken.safetensors").write_bytes(b"\xff" * 16)
    with pytest.raises(CheckpointError, match="is not a safetensors file"):
        SafetensorsWeights(tmp_path / "broken.safetensors")
    torch.save(state, tmp_path / "saved.pt")
    with pytest.raises(CheckpointError, match="it is a zip archive, as torch.save writes; save the weights with"):
        SafetensorsWeights(tmp_path / "saved.pt")
    with pytest.raises(TypeError, match=r"given a Block already built, .* \(lambda: Block\(...\)\)"):
        export_lazily(model, TOKENS, weights=tmp_path / "block.safetensors")  # type: ignore[arg-type]
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no model.safetensors or model.safetensors.index.json"):
        SafetensorsWeights(tmp_path / "empty")


def test_a_buffer_the_files_lack_is_given_by_name(tmp_path: Path) -> None:
    model = _saved(tmp_path / "block.safetensors")
    state = {k: v for k, v in model.state_dict().items() if k != "scale"}
    save_file(state, str(tmp_path / "weights.safetensors"))
    program = export_lazily(
        Block, TOKENS, weights=tmp_path / "weights.safetensors", tensors={"scale": torch.full((8,), 0.5)}
    )
    assert torch.equal(program.module()(*TOKENS), model(*TOKENS))
