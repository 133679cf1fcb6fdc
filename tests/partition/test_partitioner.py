"""Partitioner(spec): a default DelegationSpec, and the partitioners written before it still work."""

from __future__ import annotations

import pytest
import torch
from backends_for_tests import OpSetPartitioner, TorchExportBackend
from models import LINEAR_OPS, TwoLinears, export

from torchdelegate import (
    DELEGATION_TAG,
    CapabilityPartitioner,
    DelegationSpec,
    Partitioner,
    PartitionResult,
    tag_constant_data,
    to_backend,
)
from torchdelegate.backends.reference import ReferencePartitioner


class SpecPartitioner(Partitioner):
    """Written the ExecuTorch way: the spec goes to Partitioner.__init__, partition() reads self.spec."""

    def __init__(self, backend_id: str) -> None:
        super().__init__(DelegationSpec(backend_id))

    def partition(self, exported_program: torch.export.ExportedProgram) -> PartitionResult:
        for node in exported_program.graph.nodes:
            if node.op == "call_function":
                node.meta[DELEGATION_TAG] = "all"
        tag_constant_data(exported_program)
        return PartitionResult(exported_program, {"all": self.spec})


class NoInit(Partitioner):
    """Defines no __init__ and never had a spec."""

    def partition(self, exported_program: torch.export.ExportedProgram) -> PartitionResult:
        return PartitionResult(exported_program, {})


def test_a_spec_given_to_init_is_the_partitioners_spec_and_lowers() -> None:
    partitioner = SpecPartitioner(TorchExportBackend.backend_id)
    assert partitioner.spec == DelegationSpec(TorchExportBackend.backend_id)
    model = TwoLinears()
    x = torch.randn(2, 4)
    lowered = to_backend(export(model, x), partitioner)
    torch.testing.assert_close(lowered.module()(x), model(x))


def test_a_partitioner_without_init_still_lowers_and_has_no_spec() -> None:
    partitioner = NoInit()
    assert not hasattr(partitioner, "spec")
    with pytest.raises(AttributeError, match=r"NoInit has no default DelegationSpec: pass one to Partitioner.__init__"):
        _ = partitioner.spec
    program = export(TwoLinears(), torch.randn(2, 4))
    lowered = to_backend(program, partitioner)
    assert lowered.graph_module.code == program.graph_module.code


def test_partitioners_that_set_self_spec_themselves_keep_it() -> None:
    """Subclasses written before Partitioner took a spec assign it, without calling super().__init__."""
    partitioner = OpSetPartitioner(LINEAR_OPS)
    assert partitioner.spec.backend_id == TorchExportBackend.backend_id
    partitioner.spec = DelegationSpec("TestCompileOnly")
    assert partitioner.spec.backend_id == "TestCompileOnly"
    assert ReferencePartitioner().spec.backend_id == "reference"


def test_a_spec_that_is_not_a_delegation_spec_is_refused() -> None:
    """An ExecuTorch partitioner passes a dict of options; ours says where they go."""

    class OptionsDict(NoInit):
        def __init__(self) -> None:
            super().__init__({"backend": "x"})  # type: ignore[arg-type]

    with pytest.raises(TypeError, match=r"OptionsDict.spec must be a DelegationSpec, got dict; backend options go in"):
        OptionsDict()
    partitioner = NoInit()
    with pytest.raises(TypeError, match=r"NoInit.spec must be a DelegationSpec, got str"):
        partitioner.spec = "reference"  # type: ignore[assignment]


def test_a_capability_partitioner_for_one_backend_has_its_spec() -> None:
    spec = DelegationSpec("reference")
    assert CapabilityPartitioner(LINEAR_OPS, spec).spec is spec
    several = CapabilityPartitioner([(LINEAR_OPS, spec), (lambda node: True, DelegationSpec("TestCompileOnly"))])
    assert not hasattr(several, "spec")
