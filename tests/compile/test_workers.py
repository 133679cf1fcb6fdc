"""Partitions compiled on worker processes and on a Dask cluster: the same file bytes as here."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
from backends_for_tests import DyingReference

import torchdelegate as td
from torchdelegate import CompileSpec, DelegationSpec
from torchdelegate.backends.reference import ReferencePartitioner
from torchdelegate.partition.capability import CapabilityPartitioner

pytest.importorskip("onnxruntime")
from torchdelegate.backends.onnxruntime import OnnxRuntimePartitioner  # noqa: E402


class Branches(torch.nn.Module):
    """Four independent ONNX Runtime partitions (nextafter between them goes to the reference backend)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
            x = torch.nextafter(x, x + 1)
        return x


INPUT = (torch.randn(2, 64),)
BACKENDS = [OnnxRuntimePartitioner(), ReferencePartitioner()]


def _lower(path: Path, **options: object) -> bytes:
    with td.preprocessing(**options):
        lowered = td.to_edge_transform_and_lower(torch.export.export(Branches(), INPUT), partitioner=BACKENDS)
    lowered.save(path)
    return hashlib.sha256(path.read_bytes()).digest()


def test_jobs_compile_on_worker_processes_to_the_same_bytes(tmp_path: Path) -> None:
    assert _lower(tmp_path / "jobs.tdp", jobs=2, cache=False) == _lower(tmp_path / "here.tdp", cache=False)
    torch.testing.assert_close(td.load(tmp_path / "jobs.tdp").run("forward", *INPUT), Branches()(*INPUT))


def test_a_quantized_program_compiles_on_workers_that_never_quantized(tmp_path: Path) -> None:
    """torchao's operators exist in a worker only once it imports torchao: the request says so, and the
    worker does it without torch's warnings about it."""
    pytest.importorskip("torchao")
    program = td.quantize(torch.export.export(Branches(), INPUT), "8da4w")

    def lowered(path: Path, **options: object) -> bytes:
        with td.preprocessing(**options):
            td.to_edge_transform_and_lower(program, partitioner=BACKENDS).save(path)
        return path.read_bytes()

    assert lowered(tmp_path / "jobs.tdp", jobs=1, cache=False) == lowered(tmp_path / "here.tdp", cache=False)


class TwoSized(torch.nn.Module):
    """Two inputs whose sizes export ties together: its program carries guard code."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nextafter(x, y.t()) + 1


def test_a_program_with_guard_code_compiles_on_workers_to_the_same_bytes(tmp_path: Path) -> None:
    """A sub-program read back on a worker has lost export's guard code; its blob is written without it here too."""
    n = torch.export.Dim("n", min=2, max=64)
    inputs = (torch.randn(4, 8), torch.randn(8, 4))
    program = torch.export.export(TwoSized(), inputs, dynamic_shapes=({0: n}, {1: n}))
    assert program._guards_code, "the export this test needs has guard code"

    def lowered(path: Path, **options: object) -> bytes:
        with td.preprocessing(**options):
            td.to_edge_transform_and_lower(program, partitioner=[ReferencePartitioner()]).save(path)
        return path.read_bytes()

    assert lowered(tmp_path / "jobs.tdp", jobs=1, cache=False) == lowered(tmp_path / "here.tdp", cache=False)


def _dying(how: str) -> CapabilityPartitioner:
    spec = DelegationSpec(DyingReference.backend_id, [CompileSpec("die", how.encode())])
    return CapabilityPartitioner([(lambda node: True, spec)])


def test_a_worker_that_dies_is_replaced_and_its_partition_compiled_again(tmp_path: Path) -> None:
    marker = tmp_path / "died-once"
    with td.preprocessing(jobs=1, cache=False):
        lowered = td.to_edge_transform_and_lower(
            torch.export.export(Branches(), INPUT), partitioner=[_dying(f"once:{marker}")]
        )
    assert marker.exists()
    torch.testing.assert_close(lowered.exported_program().module()(*INPUT), Branches()(*INPUT))


def test_a_partition_whose_worker_dies_twice_is_named(tmp_path: Path) -> None:
    with td.preprocessing(jobs=1, cache=False), pytest.raises(td.PreprocessError) as info:
        td.to_edge_transform_and_lower(torch.export.export(Branches(), INPUT), partitioner=[_dying("always")])
    message = str(info.value)
    assert "partition 'TestDying_0' of method 'forward' was compiled twice and its worker died both times" in message


def test_a_backend_failing_on_a_worker_is_named_with_its_error(tmp_path: Path) -> None:
    with td.preprocessing(jobs=1, cache=False), pytest.raises(td.PreprocessError) as info:
        td.to_edge_transform_and_lower(torch.export.export(Branches(), INPUT), partitioner=[_dying("raise")])
    message = str(info.value)
    assert message.startswith(
        "backend 'TestDying' failed to preprocess partition 'TestDying_0' of method 'forward' on a "
    )
    assert "ValueError: this partition cannot be compiled (on process " in message


def test_a_process_pool_given_that_breaks_is_named(tmp_path: Path) -> None:
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("forkserver"))
    with pool, td.preprocessing(executor=pool, cache=False), pytest.raises(td.PreprocessError) as info:
        td.to_edge_transform_and_lower(torch.export.export(Branches(), INPUT), partitioner=[_dying("always")])
    assert "the worker process compiling partition 'TestDying_0' of method 'forward' died and the process pool " in str(
        info.value
    )


@pytest.fixture(scope="module")
def cluster():
    distributed = pytest.importorskip("distributed")
    import dask

    with dask.config.set({"distributed.scheduler.allowed-failures": 0}):
        with (
            distributed.LocalCluster(
                n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1", dashboard_address=None
            ) as local,
            distributed.Client(local) as client,
        ):
            yield client


def test_a_dask_cluster_compiles_to_the_same_bytes(cluster, tmp_path: Path) -> None:
    remote = _lower(tmp_path / "cluster.tdp", executor=cluster.get_executor(pure=False), cache=False)
    assert remote == _lower(tmp_path / "here.tdp", cache=False)
    by_address = _lower(tmp_path / "address.tdp", cluster=cluster.scheduler.address, cache=False)
    assert by_address == remote


def test_a_dask_worker_that_dies_twice_names_the_partition_and_the_worker(cluster) -> None:
    with (
        td.preprocessing(executor=cluster.get_executor(pure=False), cache=False),
        pytest.raises(td.PreprocessError) as info,
    ):
        td.to_edge_transform_and_lower(torch.export.export(Branches(), INPUT), partitioner=[_dying("always")])
    message = str(info.value)
    assert "partition 'TestDying_0' of method 'forward' was compiled twice and its worker died both times" in message
    assert "tcp://127.0.0.1:" in message
