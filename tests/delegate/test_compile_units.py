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
    returned = r"'TestLinksBadly': link_results returned 0 result\(s\); expected a list of 1"
    with pytest.raises(td.PreprocessError, match=returned):
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


class WrapsTheDefault(ReferenceBackend):
    """Overrides preprocess_multimethod, does its own work, then takes the default: the one compile-unit path."""

    backend_id = "TestWrapsTheDefault"
    compile_cache_version = "wraps the default, 1"  # it compiles its own way: it names its own version
    seen: list[str] = []

    @classmethod
    def preprocess(cls, edge_program, compile_specs):  # type: ignore[no-untyped-def]
        cls.seen.append(td.current_partition())
        return super().preprocess(edge_program, compile_specs)

    @classmethod
    def preprocess_multimethod(cls, edge_programs, compile_specs):  # type: ignore[no-untyped-def]
        cls.seen.append(f"all of {sorted(edge_programs)}")
        return super().preprocess_multimethod(edge_programs, compile_specs)


def test_a_backend_that_calls_the_default_compiles_units_from_the_cache_each_named(cache_directory: object) -> None:
    partitioner = every_op(WrapsTheDefault.backend_id)
    WrapsTheDefault.seen = []
    first = _edge().to_backend(partitioner)
    assert WrapsTheDefault.seen == ["all of ['forward']", "partition 'ops' of method 'forward'"]
    second = _edge().to_backend(partitioner)
    assert [p.cache for p in first.report.methods["forward"].partitions] == ["miss"]
    assert [p.cache for p in second.report.methods["forward"].partitions] == ["hit"]
    assert WrapsTheDefault.seen[2:] == ["all of ['forward']"]  # the unit came from the cache
    x = torch.randn(3)
    torch.testing.assert_close(second.exported_program().module()(x), Twice()(x))


def test_current_partition_outside_a_lowering_names_a_sub_program() -> None:
    assert td.current_partition() == "sub-program"


def test_the_old_second_ladder_still_compiles_with_a_deprecation_warning() -> None:
    with pytest.warns(DeprecationWarning, match="SharedDataBackend is deprecated"):

        class OldStyle(td.SharedDataBackend):
            backend_id = "TestOldStyle"

            @classmethod
            def compile_partition(cls, program, compile_specs, store, where):  # type: ignore[no-untyped-def]
                store.add_named_data("w", b"\x01" * 8)
                return f"compiled {where}".encode()

            @classmethod
            def init(cls, processed, compile_specs, named_data):  # type: ignore[no-untyped-def]
                return None

    with pytest.warns(DeprecationWarning, match="preprocess_partition is deprecated"):

        class OldPartition(ReferenceBackend):
            backend_id = "TestOldPartition"

            @classmethod
            def preprocess_partition(cls, edge_program, compile_specs, where="sub-program"):  # type: ignore[no-untyped-def]
                return PreprocessResult(f"old {where}".encode())

        class OldExtending(OldStyle):
            backend_id = "TestOldExtending"

            @classmethod
            def preprocess_partition(cls, edge_program, compile_specs, where="sub-program"):  # type: ignore[no-untyped-def]
                result = super().preprocess_partition(edge_program, compile_specs, where)
                stored = result.data_store_output
                return PreprocessResult(b"extended " + result.processed_bytes, data_store_output=stored)

    (old,) = _edge().to_backend(every_op(OldStyle.backend_id)).delegates()["forward"]
    assert old.processed_bytes == b"compiled partition 'ops' of method 'forward'"
    (older,) = _edge().to_backend(every_op(OldPartition.backend_id)).delegates()["forward"]
    assert older.processed_bytes == b"old partition 'ops' of method 'forward'"
    (extended,) = _edge().to_backend(every_op(OldExtending.backend_id)).delegates()["forward"]
    assert extended.processed_bytes == b"extended compiled partition 'ops' of method 'forward'"
