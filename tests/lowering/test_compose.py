"""Lowered modules compose: called from other modules, exported again, structured inputs and outputs,
and the named data each delegate owns travels with it into every file."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from backends_for_tests import TorchExportBackend

import torchdelegate as td
from torchdelegate import DelegationSpec, LoweredBackendModule, SerializationError
from torchdelegate.backends.reference import ReferencePartitioner


class Encoder(torch.nn.Module):
    """Weights of 16 KiB: above every backend's threshold for keeping data inside the blob."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.proj(x))


def _lowered_encoder(backend_id: str) -> LoweredBackendModule:
    program = td.to_edge(torch.export.export(Encoder(), (torch.randn(2, 64),))).exported_program()
    return td.to_backend(backend_id, program, [])


class CallsADelegate(torch.nn.Module):
    def __init__(self, lowered: LoweredBackendModule) -> None:
        super().__init__()
        self.encoder = lowered
        self.head = torch.nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x) * 2)


def _save_and_run(manager: td.EdgeProgramManager, path: Path, *inputs: torch.Tensor) -> object:
    manager.save(path)
    with td.load(path) as loaded:
        return loaded.run("forward", *inputs)


@pytest.mark.parametrize("backend_id", ["reference", "onnxruntime"])
@pytest.mark.parametrize("strict", [False, True])
def test_a_module_calling_a_lowered_module_exports_as_a_delegate_call_and_runs_after_saving(
    backend_id: str, strict: bool, tmp_path: Path
) -> None:
    model = CallsADelegate(_lowered_encoder(backend_id)).eval()
    x = torch.randn(2, 64)
    expected = model(x)
    program = torch.export.export(model, (x,), strict=strict)
    (call,) = td.delegate_calls(program)
    assert getattr(program.graph_module, call.args[0].target) is model.encoder
    assert not any("onnxruntime" in str(n.target) for n in program.graph.nodes)
    edge = td.to_edge(program)
    torch.testing.assert_close(_save_and_run(edge, tmp_path / "edge.tdp", x), expected)
    # further lowering: the head goes to another delegate; both delegates' data reach the file
    lowered = edge.to_backend(ReferencePartitioner())
    assert len(lowered.delegates()["forward"]) == 2
    torch.testing.assert_close(_save_and_run(lowered, tmp_path / "lowered.tdp", x), expected)


def test_the_function_forms_results_wrapped_in_a_manager_save_every_delegates_named_data(tmp_path: Path) -> None:
    model = CallsADelegate(_lowered_encoder("reference")).eval()
    x = torch.randn(2, 64)
    program = td.to_edge(torch.export.export(Encoder(), (x,))).exported_program()
    methods = td.to_backend({"forward": program}, {"forward": ReferencePartitioner()})
    manager = td.EdgeProgramManager(methods)
    assert len(manager.named_data) > 0
    torch.testing.assert_close(_save_and_run(manager, tmp_path / "a.tdp", x), program.module()(x))
    single = td.EdgeProgramManager({"forward": td.to_backend(program, ReferencePartitioner())})
    torch.testing.assert_close(_save_and_run(single, tmp_path / "b.tdp", x), program.module()(x))
    del model


def test_saving_a_delegate_whose_named_data_nobody_holds_fails_naming_the_delegate_and_the_key(
    tmp_path: Path,
) -> None:
    lowered = _lowered_encoder("reference")
    orphan = LoweredBackendModule(  # the blob names weights, but the module was given no data
        lowered.backend_id, lowered.processed_bytes, lowered.compile_specs, lowered.original_module, name="orphan"
    )
    program = torch.export.export(CallsADelegate(orphan), (torch.randn(2, 64),))
    with pytest.raises(SerializationError, match=r"delegate 'orphan' on 'reference' needs named data '[0-9a-f]{64}'"):
        td.to_edge(program).save(tmp_path / "orphan.tdp")
    assert not (tmp_path / "orphan.tdp").exists()


def test_saving_a_delegate_whose_blob_its_backend_cannot_read_fails_naming_the_delegate(tmp_path: Path) -> None:
    lowered = _lowered_encoder("onnxruntime")
    damaged = LoweredBackendModule(
        "onnxruntime", b"\xff" * 32, [], lowered.original_module, lowered.named_data_store_output, name="damaged"
    )
    program = torch.export.export(CallsADelegate(damaged), (torch.randn(2, 64),))
    with pytest.raises(SerializationError, match=r"delegate 'damaged' on 'onnxruntime': its blob cannot be read"):
        td.to_edge(program).save(tmp_path / "damaged.tdp")


class Structured(torch.nn.Module):
    def forward(self, pair: tuple[torch.Tensor, torch.Tensor], extra: dict[str, torch.Tensor]) -> dict[str, object]:
        a, b = pair
        return {"sum": a + b + extra["bias"], "parts": [a * 2, b - extra["bias"]]}


def test_a_delegate_with_structured_inputs_and_outputs_gives_flat_tensors_to_execute_and_structure_back(
    tmp_path: Path,
) -> None:
    inputs = ((torch.randn(3), torch.randn(3)), {"bias": torch.randn(3)})
    program = torch.export.export(Structured(), inputs)
    lowered = td.to_backend(TorchExportBackend.backend_id, program, [])
    expected = Structured()(*inputs)
    TorchExportBackend.calls.clear()
    torch.testing.assert_close(lowered(*inputs), expected)
    assert TorchExportBackend.calls[-1] == "execute"

    class Caller(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = lowered

        def forward(self, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
            out = self.inner((a, b), {"bias": bias})
            return out["sum"] * out["parts"][1]

    caller = Caller()
    flat = (*inputs[0], inputs[1]["bias"])
    exported = torch.export.export(caller, flat)
    (call,) = td.delegate_calls(exported)
    assert len(call.args) == 1 + 3  # the module, then three flat tensors
    torch.testing.assert_close(_save_and_run(td.to_edge(exported), tmp_path / "s.tdp", *flat), caller(*flat))


def test_call_delegate_takes_the_sub_programs_structured_inputs_as_the_module_does_and_exports(
    tmp_path: Path,
) -> None:
    inputs = ((torch.randn(3), torch.randn(3)), {"bias": torch.randn(3)})
    lowered = td.to_backend(TorchExportBackend.backend_id, torch.export.export(Structured(), inputs), [])
    expected = Structured()(*inputs)
    flat_expected = (expected["sum"], *expected["parts"])
    torch.testing.assert_close(td.call_delegate(lowered, *inputs), flat_expected)  # outputs stay flat

    class Caller(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = lowered

        def forward(self, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
            total, first, second = td.call_delegate(self.inner, [a, b], {"bias": bias})
            return total * first + second

    flat = (*inputs[0], inputs[1]["bias"])
    exported = torch.export.export(Caller(), flat)
    (call,) = td.delegate_calls(exported)
    assert len(call.args) == 1 + 3
    torch.testing.assert_close(exported.module()(*flat), Caller()(*flat))
    with pytest.raises(TypeError, match=r"takes \(args, kwargs\) structured as \(\(\(\*, \*\), {.bias.: \*}\), {}\)"):
        td.call_delegate(lowered, inputs[0])


def test_a_delegate_called_with_the_wrong_structure_says_what_it_takes() -> None:
    inputs = ((torch.randn(3), torch.randn(3)), {"bias": torch.randn(3)})
    lowered = td.to_backend(TorchExportBackend.backend_id, torch.export.export(Structured(), inputs), [])
    with pytest.raises(
        TypeError, match=r"takes \(args, kwargs\) structured as \(\(\(\*, \*\), {.bias.: \*}\), {}\)"
    ) as info:
        lowered(inputs[0])
    assert "Call it as its sub-program is called" in str(info.value)


def test_nested_delegation_saves_and_runs(tmp_path: Path) -> None:
    model = CallsADelegate(_lowered_encoder("onnxruntime")).eval()
    x = torch.randn(2, 64)
    edge = td.to_edge(torch.export.export(model, (x,)))
    nested = edge.to_backend(DelegationSpec("reference"))  # the whole graph, delegate call included
    (outer,) = nested.delegates()["forward"]
    assert td.delegate_calls(outer.original_module), "the inner delegate call is inside the outer delegate"
    torch.testing.assert_close(_save_and_run(nested, tmp_path / "nested.tdp", x), model(x))
