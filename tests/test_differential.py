"""Differential property test: random programs, random partitions, eager as the oracle.

For each generated program and partitioner: lowering succeeds or raises a documented
error (a ``TorchDelegateError``), and never changes the input program; the lowered
program run from Python, and the same program saved and loaded, give eager's outputs over
two calls (so buffer updates are checked through what the second call reads); lowering the
same input twice gives the same file bytes (when its backends' blobs are deterministic).

``make test`` runs ``TORCHDELEGATE_EXAMPLES`` examples (default 100); ``make soak`` many
thousands. Hypothesis keeps its database in ``.hypothesis/`` (not in git).
"""

from __future__ import annotations

import copy
import hashlib
import os
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, reject, settings
from programs import assert_unchanged, snapshot
from random_programs import Recipe, RecipeModule, partitioners, recipes
from torch.export import ExportedProgram

import torchdelegate as td
from torchdelegate import Partitioner, TorchDelegateError

# Backends whose preprocess gives the same blob for the same sub-program. The test backend's
# blob is torch.export.save's archive, which holds a random id and object ids.
DETERMINISTIC = frozenset({"reference"})
EXAMPLES = int(os.environ.get("TORCHDELEGATE_EXAMPLES", "100"))
# The mode through the compile cache and worker processes: each example lowers four times.
COMPILE_PATH_EXAMPLES = max(EXAMPLES // 8, 10)
SEEN: dict[str, Any] = {"examples": 0, "programs": set(), "outcomes": Counter()}


def summary() -> str:
    """The figures of this run, printed at the end of pytest's report (conftest.py)."""
    outcomes = ", ".join(f"{k} {v}" for k, v in sorted(SEEN["outcomes"].items()))
    return f"differential: {SEEN['examples']} examples, {len(SEEN['programs'])} distinct programs; {outcomes}"


def _report_summary(request: pytest.FixtureRequest) -> None:
    """Keep the run's figures on the test's report, which reaches pytest's summary from any worker."""
    properties = request.node.user_properties
    properties[:] = [p for p in properties if p[0] != "differential"] + [("differential", summary())]


def _two_calls(call: Any, inputs: dict[str, torch.Tensor]) -> list[Any]:
    return [call(**inputs), call(**inputs)]


def _unliftable(program: ExportedProgram) -> bool:
    try:
        program.module()
    except SyntaxError:
        return False
    return True


def _lower(program: ExportedProgram, partitioner: Partitioner, **preprocessing: Any) -> td.EdgeProgramManager:
    with td.preprocessing(**{"cache": False, **preprocessing}):
        return td.to_edge(program).to_backend(partitioner)


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.filter_too_much,
        HealthCheck.function_scoped_fixture,  # `request` only carries the run's summary out
    ],
)
@given(recipe=recipes(), choice=partitioners())
def test_lowered_saved_and_loaded_programs_compute_what_eager_computes(
    recipe: Recipe, choice: tuple[str, Partitioner], request: pytest.FixtureRequest
) -> None:
    try:
        _check_one(recipe, choice)
    finally:
        _report_summary(request)


def _check_one(recipe: Recipe, choice: tuple[str, Partitioner]) -> None:
    """Export, lower, save and load one random program; every form computes what eager does."""
    kind, partitioner = choice
    module = RecipeModule(recipe)
    inputs = recipe.example_inputs()
    try:
        program = torch.export.export(copy.deepcopy(module), (), inputs)
    except Exception:  # torch.export's limits are not ours to test
        SEEN["outcomes"]["not exportable"] += 1
        reject()
    SEEN["examples"] += 1
    SEEN["programs"].add(hashlib.sha256(program.graph_module.code.encode()).hexdigest())
    with torch.no_grad():
        expected = _two_calls(copy.deepcopy(module), inputs)
    before = snapshot(program)
    try:
        lowered = _lower(program, partitioner)
    except TorchDelegateError as error:
        assert_unchanged(program, before)
        assert kind == "scatter", f"a valid {kind} partition was refused: {error}"
        SEEN["outcomes"][f"{kind}: refused ({type(error).__name__})"] += 1
        return
    assert_unchanged(program, before)
    delegates = len(lowered.delegates()["forward"])
    SEEN["outcomes"][f"{kind}: lowered" + (" (no delegate)" if not delegates else "")] += 1
    with torch.no_grad(), tempfile.TemporaryDirectory() as directory:
        first, second = Path(directory) / "first.tdp", Path(directory) / "second.tdp"
        lowered.save(first)  # before running it: a program saves its buffers as they are
        if all(d.backend_id in DETERMINISTIC for d in lowered.delegates()["forward"]):
            _lower(program, partitioner).save(second)
            assert first.read_bytes() == second.read_bytes(), "the same input gave two different files"
        if _unliftable(program):  # torch's module() cannot unlift state named like `lambda`
            torch.testing.assert_close(_two_calls(lowered.exported_program().module(), inputs), expected)
        with td.load(first) as loaded:
            torch.testing.assert_close(_two_calls(lambda **x: loaded.run("forward", **x), inputs), expected)
    assert_unchanged(program, before)


@pytest.fixture(scope="module")
def worker_processes() -> Any:
    from torchdelegate.compile.options import LocalPool

    pool = LocalPool(2)
    yield pool.executor
    pool.close()


@settings(
    max_examples=COMPILE_PATH_EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
@given(recipe=recipes(), choice=partitioners())
def test_the_file_is_the_same_through_the_compile_cache_and_worker_processes(
    recipe: Recipe, choice: tuple[str, Partitioner], worker_processes: Any
) -> None:
    """Cold and warm through a compile cache, and compiled on worker processes: the same file as a
    plain lowering (for deterministic backends), and eager's outputs from each."""
    _, partitioner = choice
    module = RecipeModule(recipe)
    inputs = recipe.example_inputs()
    try:
        program = torch.export.export(copy.deepcopy(module), (), inputs)
        plain = _lower(program, partitioner)
    except Exception:
        reject()  # torch.export's limits, or a partition the first test sees refused
    with torch.no_grad():
        expected = _two_calls(copy.deepcopy(module), inputs)
    with tempfile.TemporaryDirectory() as directory:
        cache = Path(directory) / "cache"
        paths = {name: Path(directory) / f"{name}.tdp" for name in ("plain", "cold", "warm", "workers")}
        plain.save(paths["plain"])
        _lower(program, partitioner, cache=cache).save(paths["cold"])
        warm = _lower(program, partitioner, cache=cache)
        assert all(d.meta["compile_cache"] in ("hit", None) for d in warm.delegates()["forward"])
        warm.save(paths["warm"])
        _lower(program, partitioner, executor=worker_processes).save(paths["workers"])
        if all(d.backend_id in DETERMINISTIC for d in plain.delegates()["forward"]):
            files = {name: path.read_bytes() for name, path in paths.items()}
            assert len(set(files.values())) == 1, f"different files: {sorted(files)}"
        for path in paths.values():
            with torch.no_grad(), td.load(path) as loaded:
                torch.testing.assert_close(_two_calls(lambda **x: loaded.run("forward", **x), inputs), expected)
