"""What an installed wheel must do with the extras installed so far: run by .ci/package in a
fresh environment that holds the wheel and its declared dependencies only, never the checkout.

    python smoke.py core|quantize|distributed|viz|bench|onnxruntime|all|llm|serve|docs

Each stage lowers, saves, loads and runs what its extra is for, and compares with eager torch.
"""

from __future__ import annotations

import sys
from pathlib import Path

import smoke_commands
import torch
from smoke_commands import HERE, command

import torchdelegate as td


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = torch.nn.Linear(64, 128), torch.nn.Linear(128, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.relu(self.first(x)))


def _lowered_and_run(partitioners: list[td.Partitioner], name: str, quantize: str | None = None) -> None:
    """The model lowered with ``partitioners``, saved, loaded and run: equal to eager (or close, quantized)."""
    torch.manual_seed(0)
    model, x = _Model().eval(), torch.randn(4, 64)
    program = torch.export.export(model, (x,))
    if quantize is not None:
        program = td.quantize(program, quantize)
    lowered = td.to_edge_transform_and_lower(program, partitioner=partitioners)
    assert td.delegate_calls(lowered.exported_program()), f"{name}: nothing was delegated"
    lowered.save(HERE / f"{name}.tdp")
    with td.load(HERE / f"{name}.tdp") as loaded:
        got = loaded.run("forward", x)
    with torch.no_grad():
        expected = model(x)
    tolerance = 0.1 if quantize else 1e-4
    torch.testing.assert_close(got, expected, atol=tolerance, rtol=tolerance)
    print(f"{name}: lowered, saved, loaded, equal to eager")


def core() -> None:
    assert (Path(td.__file__).parent / "py.typed").is_file(), "py.typed is not installed"
    missing = [name for name in td.__all__ if not hasattr(td, name)]
    assert not missing, f"torchdelegate.__all__ names what it lacks: {missing}"
    from torchdelegate.backends.reference import ReferencePartitioner

    _lowered_and_run([ReferencePartitioner()], "reference")
    command("demo", "--tokens", "12", "--rounds", "1")


def onnxruntime() -> None:
    from torchdelegate.backends.onnxruntime import OnnxRuntimePartitioner

    _lowered_and_run([OnnxRuntimePartitioner()], "onnxruntime")


def quantize() -> None:
    """torchao's 8da4w, run by the reference backend: ONNX Runtime is not installed yet."""
    from torchdelegate.backends.reference import ReferencePartitioner

    _lowered_and_run([ReferencePartitioner()], "8da4w", quantize="8da4w")


def all() -> None:  # noqa: A001 - the extra's name
    """Every backend extra: the quantized program lowered to ONNX Runtime's integer kernel too."""
    from torchdelegate.backends.onnxruntime import OnnxRuntimePartitioner
    from torchdelegate.backends.reference import ReferencePartitioner

    _lowered_and_run([OnnxRuntimePartitioner(), ReferencePartitioner()], "8da4w-onnxruntime", quantize="8da4w")


def llm() -> None:
    command("demo", "--checkpoint", "checkpoint")
    command("llm", "export", "checkpoint", "-o", "demo.tdp", "--max-cache", "64")
    printed = command("llm", "generate", "demo.tdp", "-p", "The teacher said", "--max-new-tokens", "8")
    assert printed.startswith(" that he"), printed  # the demo model's greedy continuation


def serve() -> None:
    """``llm serve`` on the file the llm stage wrote."""
    smoke_commands.serve("demo.tdp")


def distributed() -> None:
    from dask.distributed import LocalCluster

    from torchdelegate.backends.reference import ReferencePartitioner

    with LocalCluster(n_workers=1, threads_per_worker=1, processes=True, dashboard_address=None) as cluster:
        with td.preprocessing(cluster=cluster.scheduler_address):
            _lowered_and_run([ReferencePartitioner()], "dask")


def viz() -> None:
    import model_explorer  # what inspect --open starts

    command("inspect", "reference.tdp", "--model-explorer", "explorer")
    assert any(Path("explorer").iterdir()), "inspect --model-explorer wrote nothing"
    print(f"viz: {model_explorer.__name__} imports")


def docs() -> None:
    import sphinx

    print(f"docs: Sphinx {sphinx.__version__}")


def bench() -> None:
    import matplotlib

    print(f"bench: matplotlib {matplotlib.__version__}")


if __name__ == "__main__":
    globals()[sys.argv[1]]()
