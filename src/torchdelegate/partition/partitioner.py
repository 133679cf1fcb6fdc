"""What a partitioner is and what it returns."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field

from torch._ops import OpOverload
from torch.export import ExportedProgram
from torch.fx import Node

from torchdelegate.specs import DelegationSpec

DELEGATION_TAG = "delegation_tag"
"""The ``node.meta`` key a partitioner sets to put a node in a partition."""


@dataclass
class PartitionResult:
    """A partitioner's answer: the program with tagged nodes, and each tag's backend."""

    tagged_exported_program: ExportedProgram
    partition_tags: dict[str, DelegationSpec] = field(default_factory=dict)


class Partitioner(ABC):
    """Decides which nodes of a program a backend takes.

    ``partition`` sets ``node.meta["delegation_tag"]`` on the nodes of each partition (it is
    handed a structural copy of the caller's program, so tagging never touches the caller's
    graph) and returns the tags with their :class:`DelegationSpec`. It must not otherwise
    change the graph: lowering checks that, unless validation is disabled.
    """

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
