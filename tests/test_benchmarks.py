"""The side-by-side benchmark's own parts that run without ExecuTorch: our side and the page.

A full ``make bench`` takes most of an hour, so its pieces are checked here: the partition
rule both sides share, our side's lowering measurement, and the results page (tables,
targets, plots) from a run's data.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
from results import targets, write_results
from stack import seeded_stack
from torchdelegate_side import lower
from workloads import SUPPORTED, op_name, tag_runs

import torchdelegate as td


def test_every_run_of_supported_ops_is_one_convex_partition() -> None:
    model, x = seeded_stack(2, 64)
    graph = td.to_edge(torch.export.export(model, (x,))).exported_program().graph
    tags = tag_runs(graph)
    tagged = [n for n in graph.nodes if "delegation_tag" in n.meta]
    assert tags and sorted({n.meta["delegation_tag"] for n in tagged}) == tags
    assert all(op_name(n.target) in SUPPORTED for n in tagged)
    order = {node: index for index, node in enumerate(graph.nodes)}
    for tag in tags:
        members = [order[n] for n in tagged if n.meta["delegation_tag"] == tag]
        between = [n for n in graph.nodes if min(members) < order[n] < max(members) and n.op == "call_function"]
        assert all(n.meta.get("delegation_tag") == tag for n in between)


def test_our_lowering_measurement_makes_one_delegate_per_run() -> None:
    figures = lower(argparse.Namespace(layers=2, width=64))
    model, x = seeded_stack(2, 64)
    graph = td.to_edge(torch.export.export(model, (torch.randn(1, 8, 64),))).exported_program().graph
    assert figures["partitions"] == len(tag_runs(graph)) > 0
    assert figures["seconds"] > 0 and figures["weights"] == sum(p.numel() * 4 for p in model.state_dict().values())


def _run(seconds_ours: list[float], seconds_theirs: list[float], file_ratio: float) -> dict:
    weights = 1_000_000

    def lowering(nodes: int, seconds: list[float]) -> list[dict]:
        return [
            {"nodes": nodes, "partitions": 3, "seconds": s, "rss_growth": 10_000, "weights": weights} for s in seconds
        ]

    def runtime(latency: float, resident: int) -> list[dict]:
        return [{"latency_us": [latency, latency + 1], "rss_growth": resident, "max_abs_diff": 0.0}] * 2

    return {
        "date": "2000-01-01",
        "command": "compare.py",
        "machine": dict.fromkeys(
            ["cpu", "cores", "memory", "os", "python", "torch", "onnxruntime", "executorch", "executorch torch"], "x"
        ),
        "weights": weights,
        "lowering": [
            {
                "layers": layers,
                "sides": {
                    "torchdelegate": lowering(100 * layers, [s * layers for s in seconds_ours]),
                    "ExecuTorch": lowering(100 * layers, [s * layers**2 for s in seconds_theirs]),
                },
            }
            for layers in (2, 8, 32)
        ],
        "files": {
            "torchdelegate onnxruntime": {
                "file_bytes": int(weights * file_ratio),
                "weights": weights,
                "delegates": {"prefill": 1, "decode": 1},
            },
            "ExecuTorch + XNNPACK": {"file_bytes": weights + 9000, "weights": weights},
        },
        "runtime": {
            "eager torch": runtime(900.0, 2 * weights),
            "torchdelegate onnxruntime": runtime(80.0, 1_100_000),
            "ExecuTorch + XNNPACK": runtime(100.0, 2 * weights),
        },
    }


def test_targets_are_computed_from_the_run() -> None:
    met = targets(_run([0.01, 0.012], [0.02], file_ratio=1.004))
    assert [m for _, _, m in met] == [True, True, True, True, True]
    assert met[0][1] == f"{0.02 * 32**2 / statistics.median([0.01 * 32, 0.012 * 32]):.0f}×"
    missed = targets(_run([0.01], [0.0001], file_ratio=1.5))
    assert [m for _, _, m in missed] == [False, True, False, True, True]
    assert "1.5000 (torchdelegate onnxruntime)" == missed[2][1]


def test_the_results_page_has_tables_targets_and_plots(tmp_path: Path) -> None:
    data = _run([0.01, 0.012], [0.02], file_ratio=1.004)
    page = write_results(data, tmp_path)
    text = page.read_text()
    assert page.name == "2000-01-01.md" and "| lowering ≥ 30× faster than ExecuTorch at L=32 |" in text
    assert "seconds grow as nodes^1.00" in text and "seconds grow as nodes^2.00" in text
    for image in ("2000-01-01-lowering.png", "2000-01-01-runtime.png"):
        assert f"({image})" in text and (tmp_path / image).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((tmp_path / "2000-01-01.json").read_text()) == data


def _llm_run(ours_decode_ms: float, ours_rss: float) -> dict:
    weights = 800_000_000

    def lowered(lower_peak: float, file_ratio: float) -> dict:
        return {
            "weights": weights,
            "export_s": 20.0,
            "lower_save_s": 60.0,
            "peak_growth": {"export": 0.1 * weights, "lower": lower_peak * weights, "save": 0.05 * weights},
            "lower_save_peak_growth": lower_peak * weights,
            "file_bytes": int(file_ratio * weights),
        }

    def ran(decode_ms: float, rss: float) -> list[dict]:
        figures = {"load_first_prefill_ms": 100.0, "warm_prefill_ms": 40.0, "decode_ms": decode_ms}
        memory = {"rss_growth": rss, "pss_growth": rss, "peak_growth": rss, "anonymous_growth": rss}
        return [{**figures, **{name: share * weights for name, share in memory.items()}}] * 3

    return {
        "date": "2000-01-01",
        "command": "llm.py",
        "size": "base",
        "strict": True,
        "machine": dict.fromkeys(["cpu", "cores", "memory", "os", "python", "torch", "onnxruntime", "executorch"], "x")
        | {"executorch torch": "x"},
        "lower": {"torchdelegate": lowered(0.2, 1.0006), "executorch": lowered(2.0, 1.0005)},
        "prepare": {"prepare_s": 6.0, "entries": ["onnxruntime model ..."], "cache_bytes": int(1.9 * weights)},
        "run": {
            "torchdelegate": ran(ours_decode_ms, ours_rss),
            "executorch": ran(20.0, 1.87),
            "prepared": ran(ours_decode_ms, 0.05),
        },
    }


def test_the_llm_page_compares_every_row_and_checks_the_issues_figures(tmp_path: Path) -> None:
    from llm import targets as llm_targets
    from llm import write_page

    met = dict((name, ok) for name, _, ok in llm_targets(_llm_run(ours_decode_ms=17.0, ours_rss=1.1)))
    assert met["decode ≤ 0.9 × ExecuTorch's"] and met["RSS growth after running both methods ≤ 1.2 × weights"]
    assert not met["warm prefill ≤ 0.8 × ExecuTorch's"]  # 40 ms on both sides
    missed = dict((name, ok) for name, _, ok in llm_targets(_llm_run(ours_decode_ms=19.0, ours_rss=3.7)))
    assert (
        not missed["decode ≤ 0.9 × ExecuTorch's"]
        and not missed["RSS growth after running both methods ≤ 1.2 × weights"]
    )
    page = write_page(_llm_run(17.0, 1.1), tmp_path)
    text = page.read_text()
    assert page.name == "2000-01-01-llm-base.md"
    assert "| decode, one token (ms, median of 40) | 17.0 | 20.0 | 0.85 |" in text
    assert "| file ÷ weights | 1.0006 | 1.0005 | 1.00 |" in text
    assert "| prepared (ours): anonymous memory growth after running both ÷ weights | 0.05 | 1.87 | 0.03 |" in text
    assert (
        "`torchdelegate prepare` on this machine (6.0 s, once; the machine cache then held 1.90 × the weights)" in text
    )
    assert (tmp_path / "2000-01-01-llm-base.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_race_page_shows_every_tool_s_figures_from_a_run() -> None:
    """benchmarks/llm_race.py's page, from the data of a run this repository keeps."""
    from llm_race import page

    runs = sorted(Path(__file__).parents[1].glob("benchmarks/results/*-llm-race-base.json"))
    assert runs, "no llm race results kept in benchmarks/results"
    data = json.loads(runs[-1].read_text())
    lines = page(data, runs[-1].stem)
    header = next(line for line in lines if line.startswith("| precision |"))
    for column in ("file MB", "time to first token ms", "decode tokens/s", "process wall s", "peak RSS MB"):
        assert column in header
    rows = [line for line in lines if line.startswith("| fp32 |") or line.startswith("| 4-bit |")]
    tools = " ".join(rows)
    assert "torchdelegate fp32 (defaults)" in tools and "llama.cpp Q4_0" in tools and "GenAI int4" in tools
    assert any(line.startswith("![") for line in lines)  # the plot


def test_the_bigger_than_ram_checkpoint_is_one_transformers_reads_and_llm_export_reads_lazily(tmp_path: Path) -> None:
    """benchmarks/bigger_than_ram.py's writer, at a tiny shape: shards within their size, an index naming
    every tensor, values transformers loads, and names ``llm export``'s lazy read matches."""
    import transformers
    from bigger_than_ram import tensor_names, write_checkpoint

    from torchdelegate.llm.checkpoint import read_checkpoint

    shape = {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "vocab_size": 300,
        "max_position_embeddings": 64,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-5,
    }
    directory = tmp_path / "checkpoint"
    written = write_checkpoint(directory, shape, "bfloat16", shard_bytes=60_000)
    shards = sorted(directory.glob("model-*.safetensors"))
    assert written["shards"] == len(shards) > 1 and all(p.stat().st_size < 60_000 + 4096 for p in shards[:-1])
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(name for name, _ in tensor_names(shape))
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16)
    assert model.model.norm.weight.eq(1).all() and model.lm_head.weight.std() > 0.01
    assert read_checkpoint(directory).eager_reason is None
