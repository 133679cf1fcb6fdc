"""What a partitioner is and what it returns."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from torch._ops import OpOverload, OpOverloadPacket
from torch.export import ExportedProgram
from torch.fx import Node

from torchdelegate.delegate.specs import DelegationSpec
from torchdelegate.exported.programs import DELEGATION_TAG as DELEGATION_TAG  # where partitioners find it
from torchdelegate.exported.programs import is_tuple_item as is_tuple_item  # the rule lives with the programs
from torchdelegate.partition.plan import PartitionPlan

"""The ``node.meta`` key a partitioner sets to put a node in a partition."""


def tags_in(nodes: Iterable[Node]) -> dict[Node, str]:
    """Each of ``nodes`` a partitioner tagged, with its tag (``node.meta[DELEGATION_TAG]``)."""
    return {node: node.meta[DELEGATION_TAG] for node in nodes if node.meta.get(DELEGATION_TAG) is not None}


def overloads_of(op: Any) -> list[OpOverload] | None:
    """The overloads ``op`` stands for (a packet such as ``aten.linear`` stands for all of its), or None
    if it is not a torch op. Partitioners name ops either way."""
    if isinstance(op, OpOverloadPacket):
        return [getattr(op, name) for name in op.overloads()]
    if isinstance(op, OpOverload):
        return [op]
    return None


NO_COPY = "no_copy"
"""The ``node.meta`` key a partitioner sets (to True) on a tagged parameter, buffer or constant
that must live only in the delegate of its tag: lowering refuses any other user of it."""


@dataclass
class PartitionResult:
    """A partitioner's answer: the program with tagged nodes, and each tag's backend.

    ``plan`` is optional: a partitioner that knows why it left each node (a capability
    partitioner) returns its plan, and lowering's report then gives those reasons."""

    tagged_exported_program: ExportedProgram
    partition_tags: dict[str, DelegationSpec] = field(default_factory=dict)
    plan: PartitionPlan | None = None


class Partitioner(ABC):
    """Decides which nodes of a program a backend takes.

    ``partition`` sets ``node.meta["delegation_tag"]`` on the nodes of each partition (it is
    handed a structural copy of the caller's program, so tagging never touches the caller's
    graph) and returns the tags with their :class:`DelegationSpec`. It must not otherwise
    change the graph: lowering checks that, unless validation is disabled.

    ``Partitioner(spec)`` keeps a default :class:`DelegationSpec` as :attr:`spec`: the one a
    partitioner for a single backend gives its tags. Subclasses that set ``self.spec``
    themselves, or define no ``__init__`` at all, keep working; reading ``spec`` when none was
    given is an ``AttributeError`` (so ``hasattr(partitioner, "spec")`` says whether it has one).
    """

    def __init__(self, spec: DelegationSpec | None = None) -> None:
        if spec is not None:
            self.spec = spec

    @property
    def spec(self) -> DelegationSpec:
        """The default :class:`DelegationSpec` of this partitioner's tags."""
        spec = self.__dict__.get("_spec")
        if spec is None:
            raise AttributeError(
                f"{type(self).__name__} has no default DelegationSpec: pass one to Partitioner.__init__ "
                "(super().__init__(DelegationSpec(backend_id))) or set self.spec"
            )
        return spec

    @spec.setter
    def spec(self, value: DelegationSpec) -> None:
        if not isinstance(value, DelegationSpec):
            raise TypeError(
                f"{type(self).__name__}.spec must be a DelegationSpec, got {type(value).__name__}; "
                "backend options go in DelegationSpec(backend_id, [CompileSpec(key, value), ...])"
            )
        self.__dict__["_spec"] = value

    @abstractmethod
    def partition(self, exported_program: ExportedProgram) -> PartitionResult:
        """Tag the nodes that go to a backend."""

    def ops_to_not_decompose(
        self, exported_program: ExportedProgram
    ) -> tuple[list[OpOverload], Callable[[Node], bool] | None]:
        """Ops to keep whole through decomposition, and an optional per-node filter."""
        return [], None

    def __call__(self, exported_program: ExportedProgram) -> PartitionResult:
        return self.partition(exported_program)
