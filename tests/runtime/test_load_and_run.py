"""Loading a saved program and running it: eager's outputs, shared state, init/destroy, errors."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from backends_for_tests import CountingReference, counting_partitioner
from models import TinyDecoder, TwoLinears, decoder_methods, export
from programs import eager_generation, fresh_decoder, program_generation, save_decoder

import torchdelegate as td
from torchdelegate.backends.reference import ReferencePartitioner

TESTS = Path(__file__).parent.parent


def test_two_methods_sharing_weights_make_a_small_file_that_a_fresh_process_runs(tmp_path: Path) -> None:
    path = save_decoder(tmp_path / "decoder.tdp")
    weights = fresh_decoder().weight_bytes()
    assert path.stat().st_size <= 1.01 * weights + 64 * 1024, (path.stat().st_size, weights)
    script = textwrap.dedent(
        f"""
        import sys, numpy as np, torch
        sys.path.insert(0, {str(TESTS)!r})
        import torchdelegate
        from programs import program_generation
        with torchdelegate.load({str(path)!r}) as program:
            outputs = program_generation(program)
        np.save({str(tmp_path / "out.npy")!r}, np.stack([o[-1].numpy() for o in outputs]))
        """
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=300)
    expected = np.stack([o[-1].numpy() for o in eager_generation()])
    np.testing.assert_allclose(np.load(tmp_path / "out.npy"), expected, atol=1e-4, rtol=1e-4)


def test_prefill_then_decode_steps_match_eager_because_methods_share_the_cache(tmp_path: Path) -> None:
    path = save_decoder(tmp_path / "decoder.tdp")
    with td.load(path) as program:
        assert program.method_names == ["prefill", "decode"]
        outputs = program_generation(program)
    for got, expected in zip(outputs, eager_generation(), strict=True):
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_each_program_inits_each_delegate_once_over_mapped_named_data_and_destroys_it_once(tmp_path: Path) -> None:
    path = save_decoder(tmp_path / "decoder.tdp", counting_partitioner())
    CountingReference.inits = CountingReference.destroys = CountingReference.mapped_views = 0
    program = td.load(path)
    assert CountingReference.inits == 0  # nothing runs at load
    delegates = len(program.delegates)
    program_generation(program)
    program_generation(program)
    assert CountingReference.inits == delegates
    assert CountingReference.mapped_views > 0
    program.close()
    program.close()
    assert CountingReference.destroys == delegates
    with pytest.raises(td.ProgramClosedError, match="closed"):
        program.run("decode", torch.tensor([1]), torch.tensor([3]))
    with td.load(path) as second:  # a second Program inits its own handles, here before any call
        second.initialize()
        assert CountingReference.inits == 2 * delegates
        second.initialize()
        program_generation(second)
    assert (CountingReference.inits, CountingReference.destroys) == (2 * delegates, 2 * delegates)
    with pytest.raises(td.ProgramClosedError, match="closed"):
        second.initialize()


def test_a_backend_nobody_registered_is_named_at_load(tmp_path: Path) -> None:
    path = save_decoder(tmp_path / "decoder.tdp", counting_partitioner())
    script = f"import torchdelegate; torchdelegate.load({str(path)!r})"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "BackendNotFoundError" in done.stderr
    assert "'TestCounting'" in done.stderr and "torchdelegate.backends" in done.stderr


def test_an_unavailable_backend_is_an_error_at_load(tmp_path: Path) -> None:
    path = save_decoder(tmp_path / "decoder.tdp", counting_partitioner())
    CountingReference.available = False
    try:
        with pytest.raises(td.BackendUnavailableError, match=r"'TestCounting' is not available"):
            td.load(path)
    finally:
        CountingReference.available = True


def test_the_reference_backend_is_found_through_its_entry_point_in_a_fresh_process(tmp_path: Path) -> None:
    model = TwoLinears()
    x = torch.randn(3, 4)
    td.to_edge(export(model, x)).to_backend(ReferencePartitioner()).save(tmp_path / "m.tdp")
    np.save(tmp_path / "x.npy", x.numpy())
    script = textwrap.dedent(
        f"""
        import numpy as np, torch, torchdelegate, sys
        assert "torchdelegate.backends.reference" not in sys.modules
        with torchdelegate.load({str(tmp_path / "m.tdp")!r}) as program:
            y = program.run("forward", torch.from_numpy(np.load({str(tmp_path / "x.npy")!r})))
        np.save({str(tmp_path / "y.npy")!r}, y.numpy())
        """
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=300)
    np.testing.assert_allclose(np.load(tmp_path / "y.npy"), model(x).detach().numpy(), atol=1e-6)


class KeywordModel(torch.nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor, *, scale: torch.Tensor) -> torch.Tensor:
        return (x[: y.shape[0]] + y) * scale


@pytest.fixture
def keyword_program(tmp_path: Path):  # type: ignore[no-untyped-def]
    rows = torch.export.Dim("rows", min=2, max=6)
    program = torch.export.export(
        KeywordModel(),
        (torch.randn(6, 3), torch.randn(4, 3)),
        {"scale": torch.randn(3)},
        dynamic_shapes={"x": None, "y": {0: rows}, "scale": None},
    )
    td.to_edge(program).to_backend(ReferencePartitioner()).save(tmp_path / "k.tdp")
    with td.load(tmp_path / "k.tdp") as loaded:
        yield loaded


def test_arguments_bind_like_the_exported_module(keyword_program) -> None:  # type: ignore[no-untyped-def]
    x, y, scale = torch.randn(6, 3), torch.randn(5, 3), torch.randn(3)
    expected = KeywordModel()(x, y, scale=scale)
    torch.testing.assert_close(keyword_program.run("forward", x, y, scale=scale), expected)
    torch.testing.assert_close(keyword_program.run("forward", x, y=y, scale=scale), expected)
    torch.testing.assert_close(keyword_program.method("forward")(scale=scale, y=y, x=x), expected)


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        ((torch.randn(6, 3),), {"scale": torch.randn(3)}, r"missing argument 'y'"),
        ((torch.randn(6, 3), torch.randn(4, 3)), {}, r"missing argument 'scale'"),  # exported by keyword
        ((torch.randn(6, 3), torch.randn(4, 3)), {"scale": torch.randn(3), "z": 1}, r"no argument 'z'"),
        (
            (torch.randn(6, 3), torch.randn(4, 3).double()),
            {"scale": torch.randn(3)},
            r"'y' must have dtype torch.float32",
        ),
        ((torch.randn(6, 3), torch.randn(4, 3, 1)), {"scale": torch.randn(3)}, r"'y' must have 2 dimensions, got 3"),
        ((torch.randn(7, 3), torch.randn(4, 3)), {"scale": torch.randn(3)}, r"'x': dimension 0 must be 6"),
        (
            (torch.randn(6, 3), torch.randn(9, 3)),
            {"scale": torch.randn(3)},
            r"'y': dimension 0 is 9, outside the range .2, 6.",
        ),
        (
            (torch.randn(6, 3), [1.0]),
            {"scale": torch.randn(3)},
            r"argument 'y' must be a single value .a tensor or a number., got a list",
        ),
        ((torch.randn(6, 3), torch.randn(4, 3), torch.randn(3), 1), {}, r"takes 3 arguments, got 4"),
    ],
)
def test_bad_inputs_name_the_argument(keyword_program, args, kwargs, message) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(td.ProgramInputError, match=message):
        keyword_program.run("forward", *args, **kwargs)


def test_unknown_method_lists_the_methods(keyword_program) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(KeyError, match=r"no method 'decode'.*\['forward'\]"):
        keyword_program.run("decode", torch.randn(1))


def test_loading_does_not_read_weights(tmp_path: Path) -> None:
    """Named data and read-only state are views of the file: nothing is copied at load."""
    path = save_decoder(tmp_path / "decoder.tdp")
    with td.load(path) as program:
        keys = list(program.named_data.keys())
        assert keys
        assert all(program.named_data.get_data(k).readonly for k in keys)
        total = sum(len(program.named_data.get_data(k)) for k in keys)
        assert total >= fresh_decoder().weight_bytes()
    assert os.path.getsize(path) >= total


def test_an_input_specialized_at_export_must_be_given_the_same_value(tmp_path: Path) -> None:
    class Repeat(torch.nn.Module):
        def forward(self, x: torch.Tensor, n: int) -> torch.Tensor:
            return x * n

    td.to_edge(torch.export.export(Repeat(), (torch.ones(2), 3))).save(tmp_path / "r.tdp")
    with td.load(tmp_path / "r.tdp") as program:
        assert program.run("forward", torch.ones(2), 3).tolist() == [3.0, 3.0]
        with pytest.raises(td.ProgramInputError, match="argument 'n' was the constant 3 when exported, got 5"):
            program.run("forward", torch.ones(2), 5)


def test_an_op_of_the_method_failing_names_the_method_and_the_cause(tmp_path: Path) -> None:
    methods = decoder_methods(TinyDecoder(vocab=16, d=8, max_len=8), prompt_length=4)
    td.to_edge(methods).save(tmp_path / "d.tdp")  # nothing delegated: the embedding runs in the method's graph
    with td.load(tmp_path / "d.tdp") as program:
        with pytest.raises(td.MethodExecutionError, match=r"method 'decode': an op of its graph .*IndexError"):
            program.run("decode", torch.tensor([99]), torch.tensor([4]))  # token 99 of a 16-token vocabulary
        program.run("decode", torch.tensor([3]), torch.tensor([4]))  # the program is still usable


def test_a_method_taking_a_tensor_on_another_device_says_so(tmp_path: Path) -> None:
    class AddOne(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + 1

    td.to_edge(torch.export.export(AddOne(), (torch.randn(2, device="meta"),))).save(tmp_path / "meta.tdp")
    with td.load(tmp_path / "meta.tdp") as program:
        assert program.method("forward").signature() == ["x: float32[2] on meta"]
        with pytest.raises(td.ProgramInputError, match=r"method 'forward': argument 'x' must be on meta, got cpu"):
            program.run("forward", torch.randn(2))


@pytest.mark.parametrize("where", ["method graph", "reference blob"])
def test_an_operator_whose_library_is_not_loaded_is_named_not_called_damage(tmp_path: Path, where: str) -> None:
    library = torch.library.Library("td_unloaded", "DEF")
    library.define("twice(Tensor x) -> Tensor")
    library.impl("twice", lambda x: x * 2, "CompositeExplicitAutograd")

    class CustomOp(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.ops.td_unloaded.twice(x.sin()) + 1

    x = torch.randn(3)
    edge = td.to_edge({"forward": torch.export.export(CustomOp(), (x,))})
    (edge if where == "method graph" else edge.to_backend(ReferencePartitioner())).save(tmp_path / "op.tdp")
    library._destroy()  # as in a process that never imported the library defining the operator
    with pytest.raises(td.OperatorNotFoundError) as raised:
        with td.load(tmp_path / "op.tdp") as program:
            program.run("forward", x)
    assert not isinstance(raised.value, td.FormatError)
    assert str(raised.value).endswith(
        "the graph calls torch.ops.td_unloaded.twice.default, which this process has not registered (the file "
        "itself is sound); import the library that defines the 'td_unloaded' operators before loading"
    )


def test_a_torch_export_file_says_to_lower_it_and_a_call_without_a_method_name_says_which_to_give(
    tmp_path: Path,
) -> None:
    x = torch.randn(2, 4)
    torch.export.save(export(TwoLinears(), x), tmp_path / "model.pt2")
    with pytest.raises(td.FormatError, match="it is a torch.export.save file: lower it first"):
        td.load(tmp_path / "model.pt2")
    torch.save(TwoLinears().state_dict(), tmp_path / "weights.pt")
    with pytest.raises(td.FormatError, match=r"it is a torch.save file \(a pickled module, state dict or tensors\)"):
        td.load(tmp_path / "weights.pt")
    td.to_edge(export(TwoLinears(), x)).to_backend(ReferencePartitioner()).save(tmp_path / "m.tdp")
    with (
        td.load(tmp_path / "m.tdp") as program,
        pytest.raises(TypeError, match=r"run\(METHOD.*\['forward'\]; got a Tensor"),
    ):
        program.run(x)
