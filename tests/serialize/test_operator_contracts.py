"""A crafted file's graph reaches no memory outside its inputs: operators off the list are refused at
load, and the listed ones whose kernels trust their arguments run behind a checked contract."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from crafted import manifest_bytes, with_manifest
from models import export

import torchdelegate as td
from torchdelegate.backends.reference import ReferencePartitioner
from torchdelegate.serialize.operator_list import ATEN_OPERATORS


class Norm(torch.nn.Module):
    """A batch norm of 64 channels and a one-element buffer the graph reads elsewhere."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.BatchNorm1d(64)
        self.register_buffer("small", torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x * 2) + self.small


def _inputs() -> torch.Tensor:
    return torch.ones(2, 64, 3)


@pytest.fixture(scope="module")
def residual_file(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """A file whose method graph runs on torch itself: no delegate."""
    path = tmp_path_factory.mktemp("residual") / "m.tdp"
    td.to_edge(export(Norm().eval(), _inputs())).save(path)
    return path.read_bytes()


def _edited(data: bytes, edit: Callable[[dict[str, Any]], None]) -> bytes:
    manifest = json.loads(manifest_bytes(data))
    edit(manifest)
    return with_manifest(data, json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode())


def _node(manifest: dict[str, Any], target: str) -> dict[str, Any]:
    nodes = manifest["methods"][0]["graph"]["graph_module"]["graph"]["nodes"]
    return next(n for n in nodes if n["target"] == f"torch.ops.aten.{target}")


def _run(data: bytes, path: Path) -> torch.Tensor:
    path.write_bytes(data)
    with td.load(path) as program:
        return program.run("forward", _inputs())


def _as_call(manifest: dict[str, Any], target: str, *arguments: dict[str, Any]) -> None:
    """The graph's ``x * 2`` made a call of ``target`` on ``x`` with ``arguments`` after it."""
    node = _node(manifest, "mul.Tensor")
    node["target"] = f"torch.ops.aten.{target}"
    node["inputs"] = [node["inputs"][0], *({"name": "", "arg": a, "kind": 1} for a in arguments)]


def test_the_untouched_file_runs_as_eager(residual_file: bytes, tmp_path: Path) -> None:
    torch.testing.assert_close(_run(residual_file, tmp_path / "m.tdp"), Norm().eval()(_inputs()))


@pytest.mark.parametrize(
    ("target", "arguments"),
    [
        ("_reshape_alias.default", [{"as_ints": [65536]}, {"as_ints": [1]}]),
        ("set_.default", []),
        ("resize_.default", [{"as_ints": [65536]}]),
        ("as_strided_scatter.default", [{"as_ints": [65536]}, {"as_ints": [1]}]),
    ],
)
def test_an_operator_off_the_list_is_refused_at_load(
    residual_file: bytes, tmp_path: Path, target: str, arguments: list[dict[str, Any]]
) -> None:
    crafted = _edited(residual_file, lambda m: _as_call(m, target, *arguments))
    with pytest.raises(td.FormatError, match=rf"calls 'torch\.ops\.aten\.{target}', which is not an operator"):
        _run(crafted, tmp_path / "m.tdp")


def test_an_operator_of_torchs_own_namespaces_is_refused_unless_listed(residual_file: bytes, tmp_path: Path) -> None:
    """``inductor::resize_storage_bytes_`` freed an input's memory under the graph (a use after free)."""

    def resize(manifest: dict[str, Any]) -> None:
        _as_call(manifest, "mul.Tensor")
        _node(manifest, "mul.Tensor")["target"] = "torch.ops.inductor.resize_storage_bytes_.default"

    with pytest.raises(td.FormatError, match=r"resize_storage_bytes_\.default', which is not an operator"):
        _run(_edited(residual_file, resize), tmp_path / "m.tdp")


def test_a_view_reaching_past_its_input_is_refused_before_it_reads(residual_file: bytes, tmp_path: Path) -> None:
    """``as_strided`` with caller-given sizes returned 256 KiB of the loader's heap."""
    crafted = _edited(
        residual_file, lambda m: _as_call(m, "as_strided.default", {"as_ints": [2, 64, 3]}, {"as_ints": [1, 1, 65536]})
    )
    with pytest.raises(td.FormatError, match=r"as_strided: a view of sizes \[2, 64, 3\].*reaches outside its input"):
        _run(crafted, tmp_path / "m.tdp")


def test_a_view_within_its_input_runs(residual_file: bytes, tmp_path: Path) -> None:
    crafted = _edited(
        residual_file, lambda m: _as_call(m, "as_strided.default", {"as_ints": [2, 64, 3]}, {"as_ints": [0, 3, 1]})
    )
    x = _inputs()
    expected = Norm().eval()(x.as_strided([2, 64, 3], [0, 3, 1]) / 2)  # the graph's x * 2, made the view
    torch.testing.assert_close(_run(crafted, tmp_path / "m.tdp"), expected)


def test_per_channel_tensors_shorter_than_the_channels_are_refused(residual_file: bytes, tmp_path: Path) -> None:
    """Batch norm's kernel reads one weight per channel whatever the weight's length."""

    def short_weight(manifest: dict[str, Any]) -> None:
        node = _node(manifest, "_native_batch_norm_legit_no_training.default")
        small = next(
            spec["buffer"]["arg"]["name"]
            for spec in manifest["methods"][0]["graph"]["graph_module"]["signature"]["input_specs"]
            if spec.get("buffer", {}).get("buffer_name") == "small"
        )
        node["inputs"][1]["arg"] = {"as_tensor": {"name": small}}

    with pytest.raises(td.FormatError, match=r"_native_batch_norm_legit_no_training: weight has sizes \[1\]"):
        _run(_edited(residual_file, short_weight), tmp_path / "m.tdp")


def test_empty_gives_zeros_not_the_heap(residual_file: bytes, tmp_path: Path) -> None:
    def empty(manifest: dict[str, Any]) -> None:
        node = _node(manifest, "mul.Tensor")
        node["target"] = "torch.ops.aten.empty.memory_format"
        node["inputs"] = [{"name": "size", "arg": {"as_ints": [2, 64, 3]}, "kind": 1}]

    expected = Norm().eval()(torch.zeros(2, 64, 3) / 2)
    torch.testing.assert_close(_run(_edited(residual_file, empty), tmp_path / "m.tdp"), expected)


def test_a_debug_handle_map_nested_too_deep_is_a_format_error(tmp_path: Path) -> None:
    """900 levels parsed, then every recursive walk of it raised RecursionError far from the reader."""
    path = tmp_path / "m.tdp"
    td.to_edge(export(Norm().eval(), _inputs())).to_backend(ReferencePartitioner()).save(path)
    deep: list[Any] = [1]
    for _ in range(900):
        deep = [deep]

    def nest(manifest: dict[str, Any]) -> None:
        manifest["delegates"][0]["debug_handle_map"] = [[1, deep]]

    with pytest.raises(td.FormatError, match="nesting deeper than 128 levels"):
        _run(_edited(path.read_bytes(), nest), path)


def test_the_list_names_registered_aten_operators_only() -> None:
    for entry in sorted(ATEN_OPERATORS):
        name, overload = entry.split(".")
        assert isinstance(getattr(getattr(torch.ops.aten, name), overload), torch._ops.OpOverload), entry


@pytest.mark.parametrize("passed", ["as_strided.default", "copy.default"])
def test_an_aten_operator_passed_as_an_argument_is_refused(residual_file: bytes, tmp_path: Path, passed: str) -> None:
    """A control-flow operator calls the operator it is given, past the contract's and the None checks:
    wrap_with_set_grad_enabled(False, aten.copy, None, None) crashed the loader."""

    def passing(manifest: dict[str, Any]) -> None:
        node = _node(manifest, "mul.Tensor")
        node["target"] = "torch.ops.higher_order.wrap_with_set_grad_enabled"
        node["inputs"] = [
            {"name": "", "arg": {"as_bool": False}, "kind": 1},
            {"name": "", "arg": {"as_operator": f"torch.ops.aten.{passed}"}, "kind": 1},
            {"name": "", "arg": {"as_none": True}, "kind": 1},
            {"name": "", "arg": {"as_none": True}, "kind": 1},
        ]

    with pytest.raises(td.FormatError, match=rf"passes 'torch\.ops\.aten\.{passed}', which is not an operator"):
        _run(_edited(residual_file, passing), tmp_path / "m.tdp")


@pytest.mark.parametrize(
    ("op", "arguments", "message"),
    [
        # each found by fuzz/residual_ops.py: a crash (SIGSEGV) or a tensor with a negative size
        (
            torch.ops.aten._fft_c2r.default,
            (torch.ones(2, dtype=torch.complex64), [-1, 2**31 - 1, 0, 4], 65536, 0),
            "dims",
        ),
        (torch.ops.aten._fft_c2r.default, (torch.ones(3, dtype=torch.complex64), [0], 0, 1000), "does not make 1000"),
        (torch.ops.aten._native_batch_norm_legit.no_stats, (torch.ones(3, 5), None, None, False, 0.1, 1e-5), "no stat"),
        (torch.ops.aten.expand.default, (torch.ones(()), [-1, 0, 5]), r"sizes \[-1, 0, 5\] do not expand"),
        (
            torch.ops.aten._adaptive_avg_pool3d.default,
            (torch.ones(0, 0, 0, 0), [0, -1, 5]),
            r"size \[0, -1, 5\] is neg",
        ),
        (torch.ops.aten._pdist_forward.default, (torch.ones(5, 3, 0), 2.0), "2-D float tensor"),
        (torch.ops.aten._fft_r2c.default, (torch.ones(2, 4, 1), [2, -2], 0, True), "counted from 0"),
        (torch.ops.aten.grid_sampler_2d.default, (torch.ones(3, 3, 2, 2), torch.ones(3, 3, 2, 2), -1, 2, True), "mode"),
        (torch.ops.aten.reflection_pad2d.default, (torch.ones(0, 1, 2, 5), [-2, 2, -65536, -2]), "sizes \\[0, 1, -6"),
        (torch.ops.aten.range.step, (3, 10, 0.5, torch.int64), "a step of 0.5 is 0 as a torch.int64"),
    ],
)
def test_arguments_a_kernel_would_take_on_trust_are_refused(op: Any, arguments: tuple[Any, ...], message: str) -> None:
    from torchdelegate.serialize.node_checks import checked_call

    with pytest.raises(td.FormatError, match=message):
        checked_call(op)(*arguments)


def test_a_tensor_argument_given_as_none_is_refused_at_load(residual_file: bytes, tmp_path: Path) -> None:
    """Kernels dereference a required tensor unchecked: aten.copy(None, None) crashed the process."""
    crafted = _edited(residual_file, lambda m: _as_call(m, "copy.default", {"as_none": True}))
    with pytest.raises(td.FormatError, match=r"calls aten\.copy without its tensor argument 'src'"):
        _run(crafted, tmp_path / "m.tdp")


def test_a_missing_tensor_read_from_a_tuple_is_refused_when_it_runs() -> None:
    from torchdelegate.serialize.node_checks import checked_call

    copy = checked_call(torch.ops.aten.copy.default, ("self", "src"))
    torch.testing.assert_close(copy(torch.zeros(2), torch.ones(2)), torch.ones(2))
    with pytest.raises(td.FormatError, match=r"aten\.copy: tensor argument 'self' is missing"):
        copy(None, None, False)


def test_size_arithmetic_past_64_bits_is_refused_before_it_runs_for_minutes(
    residual_file: bytes, tmp_path: Path
) -> None:
    """Python's integers have no bound: _operator.pow(10, 300000000) in a graph computed for minutes."""

    def power(manifest: dict[str, Any]) -> None:
        nodes = manifest["methods"][0]["graph"]["graph_module"]["graph"]["nodes"]
        arguments = [
            {"name": "", "arg": {"as_int": 10}, "kind": 1},
            {"name": "", "arg": {"as_int": 300000000}, "kind": 1},
        ]
        pow_node = {"target": "_operator.pow", "name": "big", "metadata": {}, "inputs": arguments}
        nodes.insert(0, pow_node | {"outputs": [{"as_sym_int": {"as_name": "big"}}]})
        node = _node(manifest, "mul.Tensor")
        node["target"] = "torch.ops.aten.mul.Scalar"
        node["inputs"] = [node["inputs"][0], {"name": "", "arg": {"as_sym_int": {"as_name": "big"}}, "kind": 1}]

    started = time.monotonic()
    with pytest.raises(td.FormatError, match=r"10 \*\* 300000000 is past 64 bits"):
        _run(_edited(residual_file, power), tmp_path / "m.tdp")
    assert time.monotonic() - started < 30


class Histogram(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.histogram(x, bins=4)[0]


def test_a_program_calling_an_unlisted_operator_is_refused_at_save_not_at_load(tmp_path: Path) -> None:
    """A file no reader would run is never written: the user learns it where the program is."""
    manager = td.to_edge(export(Histogram(), torch.randn(8)))
    with pytest.raises(td.SerializationError, match=r"method 'forward': the graph calls 'torch\.ops\.aten\.histogram"):
        manager.save(tmp_path / "h.tdp")
    assert not (tmp_path / "h.tdp").exists()


class Legitimate(torch.nn.Module):
    """Operators to_edge leaves whole that a new user's models called, refused by the first list."""

    def __init__(self) -> None:
        super().__init__()
        self.bilinear = torch.nn.Bilinear(4, 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        spectrum = torch.fft.fft2(x).abs()
        rows, columns = torch.tril_indices(4, 4)
        picked = x[:, rows, columns].sum() + torch.triu_indices(3, 3).sum()
        special = torch.polygamma(1, x.abs() + 1).sum() + torch.dist(x, spectrum)
        noisy = torch.nn.functional.rrelu(x, training=False)
        return self.bilinear(noisy[:, 0], x[:, 1]).sum() + spectrum.sum() + picked + special


def test_operators_to_edge_leaves_in_models_load_and_run_as_eager(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model, x = Legitimate().eval(), torch.randn(2, 4, 4)
    td.to_edge(export(model, x)).save(tmp_path / "m.tdp")
    with td.load(tmp_path / "m.tdp") as program:
        torch.testing.assert_close(program.run("forward", x), model(x))


class Positives(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[x > 0] * 2


def test_a_data_dependent_size_loads_and_runs(tmp_path: Path) -> None:
    """Its range's expressions name LessThan, which the reader refused (from a new user's trial)."""
    x = torch.tensor([1.0, -2.0, 3.0, -4.0, 5.0, 0.5])
    td.to_edge(export(Positives(), x)).save(tmp_path / "m.tdp")
    with td.load(tmp_path / "m.tdp") as program:
        torch.testing.assert_close(program.run("forward", x), Positives()(x))
