"""One Program, many threads: 8 threads x 200 calls give the single-threaded results; a
stateful method's calls are serialized; ``close()`` during calls waits, then refuses."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from backends_for_tests import CountingReference, counting_partitioner
from models import CumprodBetweenLinears, attention_block, export

import torchdelegate as td
from torchdelegate.backends.onnxruntime import OnnxRuntimePartitioner
from torchdelegate.backends.reference import ReferencePartitioner

THREADS, CALLS = 8, 200


def _in_threads(work: Callable[[int], Any]) -> list[Any]:
    """``work(thread)`` in each of THREADS threads, started together; their results or exceptions."""
    results: list[Any] = [None] * THREADS
    barrier = threading.Barrier(THREADS)

    def run(index: int) -> None:
        barrier.wait()
        try:
            results[index] = work(index)
        except BaseException as error:  # reported by the caller
            results[index] = error

    threads = [threading.Thread(target=run, args=(i,)) for i in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    return results


def test_eight_threads_of_two_hundred_calls_give_the_single_threaded_results(tmp_path: Path) -> None:
    model = CumprodBetweenLinears()  # ONNX Runtime takes the linears, reference the cumprod between them
    x = torch.randn(3, 8)
    td.to_edge(export(model, x)).to_backend([OnnxRuntimePartitioner(), ReferencePartitioner()]).save(tmp_path / "b.tdp")
    inputs = [torch.randn(3, 8) for _ in range(THREADS)]
    with td.load(tmp_path / "b.tdp") as program, torch.no_grad():
        assert {d.backend_id for d in program.delegates} == {"onnxruntime", "reference"}
        expected = [program.run("forward", x) for x in inputs]
        start = time.perf_counter()

        def work(index: int) -> int:
            for _ in range(CALLS):
                assert torch.equal(program.run("forward", inputs[index]), expected[index])
            return CALLS

        results = _in_threads(work)
        seconds = time.perf_counter() - start
    assert results == [CALLS] * THREADS, [r for r in results if r != CALLS][:1]
    print(f"{THREADS} threads x {CALLS} calls in {seconds:.2f} s")


class Counter(torch.nn.Module):
    """Each call adds one to a buffer and returns the count: calls that interleave would repeat a count."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("count", torch.zeros((), dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count.add_(1.0)
        return self.count * 1.0 + x * 0.0


def test_calls_of_a_stateful_method_are_serialized(tmp_path: Path) -> None:
    td.to_edge(export(Counter(), torch.zeros(()))).to_backend(ReferencePartitioner()).save(tmp_path / "c.tdp")
    with td.load(tmp_path / "c.tdp") as program:
        results = _in_threads(lambda _: [int(program.run("forward", torch.zeros(()))) for _ in range(CALLS)])
    counts = sorted(c for calls in results for c in calls)
    assert counts == list(range(1, THREADS * CALLS + 1)), "two calls saw the same state"


def test_close_while_eight_threads_run_waits_for_them_then_refuses(tmp_path: Path) -> None:
    block = attention_block()
    x = torch.randn(1, 6, 32)
    td.to_edge(export(block, x)).to_backend(counting_partitioner()).save(tmp_path / "b.tdp")
    CountingReference.inits = CountingReference.destroys = 0
    program = td.load(tmp_path / "b.tdp")
    with torch.no_grad():
        expected = program.run("forward", x)
    running = threading.Barrier(THREADS + 1)

    def work(index: int) -> tuple[int, str]:
        done = 0
        try:
            while True:
                with torch.no_grad():
                    assert torch.equal(program.run("forward", x), expected)
                done += 1
                if done == 5:
                    running.wait()
        except td.ProgramClosedError as error:
            return done, str(error)

    outcome: list[Any] = []
    closer = threading.Thread(target=lambda: (running.wait(), program.close(), outcome.append("closed")))
    closer.start()
    results = _in_threads(work)
    closer.join(timeout=60)
    assert outcome == ["closed"]
    for result in results:
        assert isinstance(result, tuple), result
        assert result[0] >= 5 and "is closed; load it again" in result[1]
    assert CountingReference.destroys == CountingReference.inits > 0
