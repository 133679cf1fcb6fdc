"""Partitions compiled one by one and then linked: what a backend returns is checked, and
``preprocessing`` refuses what it cannot do."""

from __future__ import annotations

import pytest
import torch
from backends_for_tests import every_op

import torchdelegate as td
from torchdelegate import BackendDetails, CompileSpec, PreprocessResult
from torchdelegate.backends.reference import ReferenceBackend


class LinksBadly(ReferenceBackend):
    backend_id = "TestLinksBadly"

    @classmethod
    def link_results(cls, results: list[PreprocessResult], compile_specs: list[list[CompileSpec]]) -> list:
        if compile_specs[0]:
            raise RuntimeError("no linker here")
        return []


class FailsInMultimethod(BackendDetails):
    backend_id = "TestFailsInMultimethod"

    @staticmethod
    def preprocess(edge_program, compile_specs):  # type: ignore[no-untyped-def]
        return PreprocessResult(b"")

    @classmethod
    def preprocess_multimethod(cls, edge_programs, compile_specs):  # type: ignore[no-untyped-def]
        raise RuntimeError("no multimethod compile here")


class Twice(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2 + 1


def _edge() -> td.EdgeProgramManager:
    return td.to_edge(torch.export.export(Twice(), (torch.randn(3),)))


def test_link_results_failing_or_returning_the_wrong_count_is_named() -> None:
    partitioner = every_op(LinksBadly.backend_id)
    with pytest.raises(td.PreprocessError, match=r"'TestLinksBadly': link_results returned list; expected a list of 1"):
        _edge().to_backend(partitioner)
    spec = td.DelegationSpec(LinksBadly.backend_id, [CompileSpec("x", b"1")])
    with pytest.raises(
        td.PreprocessError, match=r"'TestLinksBadly' failed to link its 1 partition\(s\): RuntimeError: no"
    ):
        _edge().to_backend(spec)


def test_an_overriding_preprocess_multimethod_failing_is_named() -> None:
    with pytest.raises(
        td.PreprocessError,
        match=r"'TestFailsInMultimethod' failed in preprocess_multimethod for method\(s\) 'forward': RuntimeError: no",
    ):
        _edge().to_backend(every_op(FailsInMultimethod.backend_id))


def test_preprocessing_refuses_what_it_cannot_do() -> None:
    with pytest.raises(ValueError, match=r"give one of executor, jobs and cluster, not jobs and cluster"):
        with td.preprocessing(jobs=2, cluster="tcp://127.0.0.1:8786"):
            pass
    with pytest.raises(ValueError, match=r"jobs must be a number of worker processes >= 1, got 0"):
        with td.preprocessing(jobs=0):
            pass
    with pytest.raises(TypeError, match=r"cache must be a CompileCache, a directory, a URL or False, got int"):
        with td.preprocessing(cache=3):  # type: ignore[arg-type]
            pass
    with pytest.raises(ValueError, match=r"max_bytes must be a number of bytes >= 0, got -1"):
        td.CompileCache("/tmp/unused", max_bytes=-1)
