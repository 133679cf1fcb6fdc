"""Quantized programs (torchao 8da4w, int4 and int8 weight-only) lowered, saved and run in a fresh process.

Two architectures: a tiny Llama quantized by torchao itself before export (as a user who
quantized their model does), and a tiny Qwen2 (biased projections, an MLP whose inputs are not
a power of two) exported in fp32 and quantized by ``torchdelegate.quantize`` (as a deployer who
starts from fp32 does). Outputs are compared with the quantized eager model's.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("onnxruntime")
torchao_quantization = pytest.importorskip("torchao.quantization")

from language_models import static_cache_module, tiny_llama, tiny_qwen2  # noqa: E402

import torchdelegate as td  # noqa: E402
from torchdelegate.backends.onnxruntime import OnnxRuntimePartitioner  # noqa: E402
from torchdelegate.backends.reference import ReferencePartitioner  # noqa: E402

TESTS = Path(__file__).parent.parent
CACHE = 16
PROMPT = 6
RECIPES = ["8da4w", "int4", "int8"]
OURS = ["8da4w-asym"]  # torchao has no config of its own for it (8da8w: its head, below)
DYNAMIC = {"8da4w", "8da4w-asym", "8da8w", "int8"}  # ONNX Runtime runs 8-bit weights on int8 arithmetic
# ONNX Runtime runs 8da4w's products on int8 arithmetic that quantizes activations in blocks of 32,
# where torchao quantizes each row: logits move by this much (docs/QUANTIZATION.md).
ORT_DYNAMIC_BOUND = 0.05
EXACT = 1e-3


def _torchao_config(recipe: str) -> Any:
    from torchao.quantization.granularity import PerAxis, PerGroup

    if recipe == "8da4w":
        return torchao_quantization.Int8DynamicActivationIntxWeightConfig(
            weight_dtype=torch.int4, weight_granularity=PerGroup(32)
        )
    if recipe == "int4":
        return torchao_quantization.IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32))
    return torchao_quantization.IntxWeightOnlyConfig(weight_dtype=torch.int8, granularity=PerAxis(0))


def _calls() -> list[dict[str, Any]]:
    prompt = torch.randint(0, 256, (1, PROMPT), generator=torch.Generator().manual_seed(3))
    calls = [{"method": "prefill", "args": [], "kwargs": {"input_ids": prompt, "cache_position": torch.arange(PROMPT)}}]
    for step, token in enumerate((5, 17, 250)):
        kwargs = {"input_ids": torch.tensor([[token]]), "cache_position": torch.tensor([PROMPT + step])}
        calls.append({"method": "decode", "args": [], "kwargs": kwargs})
    return calls


def _export(module: torch.nn.Module) -> dict[str, torch.export.ExportedProgram]:
    calls = _calls()
    with torch.no_grad():  # strict, as transformers exports this module (non-strict fails in torch 2.13)
        return {c["method"]: torch.export.export(module, (), c["kwargs"], strict=True) for c in calls[:2]}


def _eager(programs: dict[str, torch.export.ExportedProgram]) -> list[torch.Tensor]:
    """The quantized programs run by torch, sharing one cache as the loaded program's methods do."""
    modules = {m: p.module() for m, p in programs.items()}
    cache = {k: v for k, v in modules["prefill"].named_buffers()}
    for name, buffer in modules["decode"].named_buffers():
        buffer.data = cache[name].data
    with torch.no_grad():
        return [modules[c["method"]](**c["kwargs"]) for c in _calls()]


def _fresh_outputs(path: Path, tmp_path: Path) -> list[torch.Tensor]:
    """The saved program's outputs for the calls, from a process that built nothing."""
    torch.save(_calls(), tmp_path / "calls.pt")
    jobs = [{"program": str(path), "calls": str(tmp_path / "calls.pt"), "outputs": str(tmp_path / "out.pt")}]
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    subprocess.run([sys.executable, str(TESTS / "zoo" / "fresh.py"), str(tmp_path / "jobs.json")], check=True)
    answer = torch.load(tmp_path / "out.pt", weights_only=True)
    assert "error" not in answer, answer
    return [leaves[0] for leaves in answer["outputs"]]


def _quantized_bytes(programs: dict[str, torch.export.ExportedProgram]) -> int:
    """The distinct tensors of the quantized programs but their KV cache: integers, scales, float weights."""
    written = set().union(*(p.graph_signature.buffers_to_mutate.values() for p in programs.values()))
    tensors = {}
    for program in programs.values():
        for name, tensor in program.state_dict.items():
            if name not in written:
                tensors[name] = tensor.untyped_storage().nbytes()
    return sum(tensors.values())


def _lowered_and_checked(
    programs: dict[str, torch.export.ExportedProgram], partitioners: list[Any], bound: float, tmp_path: Path
) -> td.EdgeProgramManager:
    expected = _eager(programs)
    lowered = td.to_edge_transform_and_lower(programs, partitioner=partitioners)
    path = tmp_path / "quantized.tdp"
    lowered.save(path)
    assert path.stat().st_size <= 1.02 * _quantized_bytes(programs) + 256 * 1024
    for got, want in zip(_fresh_outputs(path, tmp_path), expected, strict=True):
        torch.testing.assert_close(got, want, atol=bound, rtol=0)
    return lowered


def _integer_products(lowered: td.EdgeProgramManager) -> int:
    """How many quantized products ONNX Runtime's blobs run on MatMulNBits."""
    from torchdelegate.backends.onnxruntime.blob_header import unpacked

    headers = [unpacked(memoryview(d.processed_bytes))[0] for d in _delegates(lowered) if d.backend_id == "onnxruntime"]
    return sum(header.get("fusions", {}).get("MatMulNBits", 0) for header in headers)


def _delegates(lowered: td.EdgeProgramManager) -> list[Any]:
    return [d for ds in lowered.delegates().values() for d in ds]


@pytest.mark.parametrize("recipe", RECIPES)
def test_a_llama_quantized_by_torchao_runs_its_products_on_onnx_runtime_integer_kernel(
    recipe: str, tmp_path: Path
) -> None:
    from torchao.quantization import quantize_

    model = tiny_llama()
    quantize_(model, _torchao_config(recipe))
    programs = _export(static_cache_module(model, CACHE))
    bound = ORT_DYNAMIC_BOUND if recipe in DYNAMIC else EXACT
    lowered = _lowered_and_checked(programs, [OnnxRuntimePartitioner(), ReferencePartitioner()], bound, tmp_path)
    assert {d.backend_id for d in _delegates(lowered)} == {"onnxruntime"}
    assert _integer_products(lowered) == 2 * 15  # 7 per layer and the head, in each method
    ops = {str(n.target) for m in lowered.methods for n in lowered.exported_program(m).graph.nodes}
    assert not any("torchao" in op for op in ops)  # nothing quantized is left to torch
    # query, key and value in one kernel call, gate and up in another: 4 per layer and the head
    assert _kernel_calls(tmp_path / "quantized.tdp") == [9, 9]
    # the attention reads query, key and value packed as that call makes them: only gate and up are split
    layers = model.config.num_hidden_layers
    assert _kernel_calls(tmp_path / "quantized.tdp", "Split") == [layers, layers]
    assert _kernel_calls(tmp_path / "quantized.tdp", "GroupQueryAttention") == [layers, layers]


def _kernel_calls(path: Path, operator: str = "MatMulNBits") -> list[int]:
    """How many ``operator`` nodes each ONNX Runtime delegate of a saved program runs."""
    from onnx_graphs import delegate_nodes

    with td.load(path) as program:
        return [sum(n.op_type == operator for n in delegate_nodes(program, i)) for i in range(len(program.delegates))]


@pytest.mark.parametrize("recipe", RECIPES + OURS)
def test_a_fp32_qwen2_quantized_by_torchdelegate_lowers_to_onnx_runtime_then_reference(
    recipe: str, tmp_path: Path
) -> None:
    fp32 = _export(static_cache_module(tiny_qwen2(), CACHE))
    programs = td.quantize(fp32, recipe)
    bound = ORT_DYNAMIC_BOUND if recipe in DYNAMIC else EXACT
    lowered = _lowered_and_checked(programs, [OnnxRuntimePartitioner(), ReferencePartitioner()], bound, tmp_path)
    assert _integer_products(lowered) == 2 * 15


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_reference_backend_runs_quantized_programs_with_torchs_arithmetic(recipe: str, tmp_path: Path) -> None:
    programs = td.quantize(_export(static_cache_module(tiny_llama(), CACHE)), recipe)
    lowered = _lowered_and_checked(programs, [ReferencePartitioner()], EXACT, tmp_path)
    state = [t for d in _delegates(lowered) for t in d.original_module.state_dict.values()]
    assert any(t.dtype == torch.int8 for t in state)  # the weights stay integers


def test_quantize_matches_torchao_and_leaves_the_callers_programs_as_they_were() -> None:
    from torchao.quantization import quantize_

    model = tiny_llama()
    fp32 = _export(static_cache_module(model, CACHE))
    names = {m: [n.name for n in p.graph.nodes] for m, p in fp32.items()}
    state = {m: dict(p.state_dict) for m, p in fp32.items()}
    ours = td.quantize(fp32, "8da4w")
    assert {m: [n.name for n in p.graph.nodes] for m, p in fp32.items()} == names
    assert all(p.state_dict == state[m] for m, p in fp32.items())
    quantize_(model, _torchao_config("8da4w"))
    theirs = _export(static_cache_module(model, CACHE))
    for got, want in zip(_eager(ours), _eager(theirs), strict=True):
        torch.testing.assert_close(got, want, atol=0, rtol=0)
    name = "model.model.layers.0.mlp.up_proj.weight"
    prefill, decode = (ours[m].state_dict for m in ("prefill", "decode"))
    assert prefill[f"{name}_qdata"].data_ptr() == decode[f"{name}_qdata"].data_ptr()  # quantized once for both
    assert name not in prefill


def test_the_command_offers_every_recipe_and_the_default_first() -> None:
    from torchdelegate.cli.lower import QUANTIZE_RECIPES
    from torchdelegate.quantization.recipe_table import DEFAULT_RECIPE, RECIPES

    assert set(QUANTIZE_RECIPES) == set(RECIPES) and QUANTIZE_RECIPES[0] == DEFAULT_RECIPE


def test_a_keep_float_pattern_that_matches_nothing_is_warned_about() -> None:
    program = torch.export.export(_Twice().eval(), (torch.randn(3, 64),))
    with pytest.warns(UserWarning, match="keep_float pattern 'lm_haed' matched no linear layer"):
        td.quantize(program, "int8", keep_float=["lm_haed", "fc"])


def test_keep_float_leaves_the_head_in_float_and_group_size_is_applied() -> None:
    programs = td.quantize(
        _export(static_cache_module(tiny_llama(), CACHE)), "int4", group_size=16, keep_float=["lm_head"]
    )
    state = programs["decode"].state_dict
    assert state["model.lm_head.weight"].dtype == torch.float32
    assert state["model.model.layers.0.self_attn.q_proj.weight_scale"].shape == (64, 4)


@pytest.mark.parametrize(
    ("recipe", "options", "message"),
    [
        ("int3", {}, "unknown quantization recipe 'int3'; the recipes are 8da4w"),
        ("int4", {"group_size": 48}, "group size 48 does not divide its 64 inputs"),
        ("int4", {"group_size": 0}, "group size 0: give a positive integer number of inputs per scale"),
    ],
)
def test_bad_quantization_requests_are_refused_naming_what_to_change(
    recipe: str, options: dict[str, Any], message: str
) -> None:
    programs = _export(static_cache_module(tiny_llama(), CACHE))
    with pytest.raises(td.QuantizationError, match=message.replace("(", r"\(")):
        td.quantize(programs, recipe, **options)


class _Twice(torch.nn.Module):
    """One linear layer called twice: both calls read one weight."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.fc(x)))


@pytest.mark.parametrize("level", ["all", "disable"])
def test_a_weight_two_layers_read_is_packed_once_and_any_optimization_level_runs_it(level: str) -> None:
    """At level ``disable`` ONNX Runtime folds no constant: the kernel's scales are float32 initializers,
    which it packs at any level."""
    torch.manual_seed(0)
    program = td.quantize(torch.export.export(_Twice().eval(), (torch.randn(3, 64),)), "8da4w")
    x = torch.randn(3, 64)
    with torch.no_grad():
        expected = program.module()(x)
    specs = [td.CompileSpec("graph_optimization_level", level.encode())]
    lowered = td.to_edge_transform_and_lower(program, partitioner=[OnnxRuntimePartitioner(compile_specs=specs)])
    assert _integer_products(lowered) == 2
    torch.testing.assert_close(lowered.exported_program().module()(x), expected, atol=ORT_DYNAMIC_BOUND, rtol=0)


def test_a_weight_past_the_largest_packed_size_runs_as_blocks_of_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An LLM's head packs to hundreds of MB, which ONNX Runtime packs once per branch before it drops
    the second copy: past ``LARGEST_PACKED`` a weight runs as blocks of rows, outputs unchanged, the
    blocks of a weight two layers read made once."""
    from torchdelegate.backends.onnxruntime import blockwise

    torch.manual_seed(0)
    program = td.quantize(torch.export.export(_Twice().eval(), (torch.randn(3, 64),)), "8da4w")
    x = torch.randn(3, 64)
    whole = td.to_edge_transform_and_lower(program, partitioner=[OnnxRuntimePartitioner()])
    monkeypatch.setattr(blockwise, "LARGEST_PACKED", 700)  # 64 rows of 32 bytes: blocks of 22, 22 and 20 rows
    blocks = td.to_edge_transform_and_lower(program, partitioner=[OnnxRuntimePartitioner()])
    blocks.save(tmp_path / "blocks.tdp")
    assert _kernel_calls(tmp_path / "blocks.tdp") == [6]
    with td.load(tmp_path / "blocks.tdp") as loaded:
        out = loaded.run("forward", x)
    out = out[0] if isinstance(out, (list, tuple)) else out
    torch.testing.assert_close(out, whole.exported_program().module()(x), atol=1e-6, rtol=0)


def test_the_blockwise_operator_computes_what_torchaos_ops_compute() -> None:
    from torchdelegate.quantization.linear import with_blockwise_linears

    torch.manual_seed(0)
    for recipe in RECIPES + OURS:
        program = td.quantize(torch.export.export(_Twice().eval(), (torch.randn(5, 64),)), recipe)
        rewritten, layers = with_blockwise_linears(program)
        assert layers == 2
        x = torch.randn(5, 64) * 3
        with torch.no_grad():
            torch.testing.assert_close(rewritten.module()(x), program.module()(x), atol=1e-6, rtol=1e-6)


def _gathers(lowered: td.EdgeProgramManager) -> int:
    """How many quantized embeddings ONNX Runtime's blobs run on GatherBlockQuantized."""
    from torchdelegate.backends.onnxruntime.blob_header import unpacked

    headers = [unpacked(memoryview(d.processed_bytes))[0] for d in _delegates(lowered) if d.backend_id == "onnxruntime"]
    return sum(header.get("fusions", {}).get("GatherBlockQuantized", 0) for header in headers)


def test_embeddings_quantized_by_torchdelegate_run_on_onnx_runtime_gather_of_integers(tmp_path: Path) -> None:
    """The table is read as integers by GatherBlockQuantized (no float table in the file: its size
    is the quantized tensors'), with outputs those of the quantized program run by torch. (int4
    tables: the tied test below.)"""
    embeddings = "int8"
    fp32 = _export(static_cache_module(tiny_llama(), CACHE))
    programs = td.quantize(fp32, "int8", embeddings=embeddings)
    state = programs["decode"].state_dict
    assert "model.model.embed_tokens.weight" not in state
    assert state["model.model.embed_tokens.weight_qdata"].dtype == torch.int8
    groups = 64 // 32 if embeddings == "int4" else 1
    assert state["model.model.embed_tokens.weight_scale"].shape == (512, groups)
    lowered = _lowered_and_checked(
        programs, [OnnxRuntimePartitioner(), ReferencePartitioner()], ORT_DYNAMIC_BOUND, tmp_path
    )
    assert {d.backend_id for d in _delegates(lowered)} == {"onnxruntime"}
    assert _gathers(lowered) == 2 and _integer_products(lowered) == 2 * 15


class _Lookup(torch.nn.Module):
    """A table of 300 rows of ``width`` values, looked up and doubled."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.table = torch.nn.Embedding(300, width)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.table(tokens) * 2


def test_an_int8_table_whose_rows_128_does_not_divide_runs_on_the_gather_of_integers(tmp_path: Path) -> None:
    """Rows of 96 values (SmolLM2's 576 alike): one scale per row, repeated over blocks of 32. Left to
    a float dequantization, ONNX Runtime would fold the whole table into floats when it loads it."""

    torch.manual_seed(0)
    tokens = torch.randint(0, 300, (2, 7))
    program = td.quantize(torch.export.export(_Lookup(96).eval(), (tokens,)), "int8", embeddings="int8")
    lowered = td.to_edge_transform_and_lower(program, partitioner=[OnnxRuntimePartitioner()])
    assert _gathers(lowered) == 1
    lowered.save(tmp_path / "lookup.tdp")
    with td.load(tmp_path / "lookup.tdp") as loaded, torch.no_grad():
        torch.testing.assert_close(loaded.run("forward", tokens), program.module()(tokens), atol=1e-6, rtol=1e-6)


def test_a_tied_table_is_stored_once_when_the_head_and_the_lookup_quantize_it_alike(tmp_path: Path) -> None:
    """8da4w's head and int4 tables are both int4 in groups of 32: one copy; an int8 table differs."""
    from language_models import tiny_gpt2

    fp32 = _export(static_cache_module(tiny_gpt2(), CACHE))
    names = {"model.transformer.wte.weight_qdata", "model.transformer.wte.weight_embedding_qdata"}
    apart = td.quantize(fp32, "8da4w", embeddings="int8")["decode"].state_dict
    assert names <= set(apart)
    programs = td.quantize(fp32, "8da4w", embeddings="int4")
    state = programs["decode"].state_dict
    assert names & set(state) == {"model.transformer.wte.weight_qdata"}
    assert "model.transformer.wte.weight" not in state
    lowered = _lowered_and_checked(programs, [OnnxRuntimePartitioner(), ReferencePartitioner()], 0.1, tmp_path)
    assert _gathers(lowered) == 2 * 2  # the tokens' table and the positions'


def test_the_default_recipe_gives_the_head_int8_weights_and_a_tied_table_is_stored_once(tmp_path: Path) -> None:
    """8da4w-asym: the decoder's layers int4 with zero points (query and key still one kernel call,
    gate and up another); its value projections, its last layer and the head 8da8w; the head's int8
    table is the lookup's (one scale per row both), stored once and read by both kernels."""
    from language_models import tiny_gpt2

    model = tiny_llama()
    programs = td.quantize(_export(static_cache_module(model, CACHE)), "8da4w-asym", embeddings="int8")
    state = programs["decode"].state_dict
    layer = "model.model.layers.0.self_attn.q_proj.weight"
    assert state[f"{layer}_scale"].shape == (64, 2) and state[f"{layer}_zero_point"].any()
    assert state["model.lm_head.weight_scale"].shape[-1] == 1  # one scale per row
    last = model.config.num_hidden_layers - 1
    eight_bits = ["model.lm_head.weight", "model.model.layers.0.self_attn.v_proj.weight"]
    eight_bits += [f"model.model.layers.{last}.{layer}.weight" for layer in ("self_attn.q_proj", "mlp.down_proj")]
    for eight_bit in eight_bits:
        assert int(state[f"{eight_bit}_qdata"].abs().max()) > 8, eight_bit
    assert int(state["model.model.layers.0.mlp.down_proj.weight_qdata"].abs().max()) <= 8
    lowered = _lowered_and_checked(programs, [OnnxRuntimePartitioner(), ReferencePartitioner()], 0.1, tmp_path)
    assert _integer_products(lowered) == 2 * 15
    assert _kernel_calls(tmp_path / "quantized.tdp") == [10, 10]  # 5 in the first layer, 4 in the last, the head

    tied = td.quantize(_export(static_cache_module(tiny_gpt2(), CACHE)), "8da4w-asym", embeddings="int8")
    state = tied["decode"].state_dict  # the tied table lowered is the test above's
    assert "model.transformer.wte.weight_qdata" in state and "model.transformer.wte.weight_embedding_qdata" not in state


def test_the_embedding_operator_computes_what_torchaos_ops_compute() -> None:
    from torchdelegate.quantization.embedding import with_blockwise_embeddings

    torch.manual_seed(0)
    tokens = torch.randint(0, 300, (2, 7))
    for embeddings in ("int8", "int4"):
        program = td.quantize(torch.export.export(_Lookup(64).eval(), (tokens,)), "int8", embeddings=embeddings)
        rewritten, lookups = with_blockwise_embeddings(program)
        assert lookups == 1
        with torch.no_grad():
            torch.testing.assert_close(rewritten.module()(tokens), program.module()(tokens), atol=0, rtol=0)
    with pytest.raises(td.QuantizationError, match="unknown embedding quantization 'int2'; give int8"):
        td.quantize(torch.export.export(_Lookup(64).eval(), (tokens,)), "int8", embeddings="int2")
