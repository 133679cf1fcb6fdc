"""The zoo in the test suite: the catalogue's shape, and a subset of models, one per kind, lowered
with each backend list, saved, loaded in a fresh process and compared with eager (``make zoo``
runs them all)."""

from __future__ import annotations

from pathlib import Path

import pytest

import torchdelegate as td

pytest.importorskip("transformers")
from zoo.models import BY_NAME, KINDS, PREFILL_DECODE, TORCH_NN, ZOO  # noqa: E402
from zoo.run import BACKEND_LISTS, MethodResult, Result, render, run_models  # noqa: E402

# One per kind at least: a text encoder, a prefill + decode LM, an encoder-decoder, a vision
# transformer and a conv net, an audio encoder, and torch.nn programs (nn.Sequential among them).
SUBSET = ["distilbert", "llama", "bart", "vit", "resnet", "whisper-encoder", "sequential-mlp", "interpolate"]


def test_catalogue_has_35_architectures_covering_every_kind() -> None:
    names = [model.name for model in ZOO]
    assert len(names) >= 35
    assert len(set(names)) == len(names)
    assert {model.kind for model in ZOO} == set(KINDS)
    assert sum(model.methods == PREFILL_DECODE for model in ZOO) >= 3
    assert any(model.family == "nn.Sequential" for model in ZOO)
    assert {BY_NAME[name].kind for name in SUBSET} == set(KINDS)


def test_a_prefill_decode_model_builds_one_module_for_both_methods() -> None:
    case = BY_NAME["llama"].build()
    assert tuple(case.modules) == PREFILL_DECODE
    assert case.modules["prefill"] is case.modules["decode"]  # one cache, shared
    assert [call.method for call in case.calls][:2] == ["prefill", "decode"]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, tuple[str, ...]], Result]:
    """The subset run once through the zoo's own steps, all programs in one fresh process."""
    if not td.get_backend("onnxruntime").is_available():
        pytest.skip("onnxruntime is not installed")
    found = run_models([BY_NAME[name] for name in SUBSET], tmp_path_factory.mktemp("zoo"))
    return {(r.model, tuple(r.backends)): r for r in found}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backends", BACKEND_LISTS, ids="+".join)
@pytest.mark.parametrize("name", SUBSET)
def test_loaded_in_a_fresh_process_matches_eager(
    results: dict[tuple[str, tuple[str, ...]], Result], name: str, backends: tuple[str, ...]
) -> None:
    result = results[(name, backends)]
    assert result.passed, f"{name} with {' then '.join(backends)} failed at {result.step}: {result.error}"
    assert set(result.methods) == set(BY_NAME[name].methods)
    for method in result.methods.values():
        assert backends[0] in method.delegates  # the first backend took part of every method
    if BY_NAME[name].kind != TORCH_NN and "onnxruntime" in backends:
        assert result.share("flops") >= 0.99  # issue 17: transformers on ONNX Runtime


def test_zoo_page_shows_every_result_and_groups_failures() -> None:
    methods = {"forward": MethodResult({"onnxruntime": 2, "reference": 1}, 10, 8, 1000, 990, {"reference": {"x": 2}})}
    passed = Result(
        "tiny",
        "vision",
        "ViT",
        ["onnxruntime", "reference"],
        passed=True,
        methods=methods,
        file_bytes=300,
        weight_bytes=200,
        lowering_seconds=1.25,
    )
    failed = [
        Result(name, TORCH_NN, "nn.Sequential", ["reference"], step="lower", error="SpecViolationError: input")
        for name in ("a", "b")
    ]
    about = {"date": "2026-01-01", "seconds": 12.0, "workers": 2, "machine": {"torch": "2.13.0"}}
    page = render([passed, *failed], about)
    assert "| tiny | vision | onnxruntime then reference | pass | forward: 2 onnxruntime, 1 reference " in page
    assert "| 80.0% | 99.0% | 1.50 | 1.2 |" in page
    assert "- at lower: `SpecViolationError: input` — 2: a (reference), b (reference)" in page
    assert "torch 2.13.0" in page


def test_results_survive_json(tmp_path: Path) -> None:
    methods = {"decode": MethodResult({"reference": 1}, 5, 0, 10, 0, {})}
    result = Result("m", "decoder LM", "Llama", ["reference"], passed=True, methods=methods, max_abs_error=1e-7)
    assert Result.from_json(result.to_json()) == result
