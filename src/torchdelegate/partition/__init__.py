"""Partitioners: who decides which nodes go to which backend."""

from torchdelegate.exported.programs import DELEGATION_TAG
from torchdelegate.partition.capability import CapabilityPartitioner, OperatorSupport
from torchdelegate.partition.contract import NO_COPY, Partitioner, PartitionResult
from torchdelegate.partition.groups import (
    GroupBasedPartitioner,
    generate_grouped_partitions_from_list_of_nodes,
    generate_partitions_from_list_of_nodes,
)
from torchdelegate.partition.patterns import Pattern, PatternMatch, PatternPartitioner, find_pattern_matches
from torchdelegate.partition.plan import NodeDecision, PartitionPlan, PlannedPartition
from torchdelegate.partition.tagging import tag_constant_data, tag_mutated_buffers

__all__ = [
    "DELEGATION_TAG",
    "NO_COPY",
    "CapabilityPartitioner",
    "GroupBasedPartitioner",
    "NodeDecision",
    "OperatorSupport",
    "PartitionPlan",
    "Pattern",
    "PatternMatch",
    "PatternPartitioner",
    "PartitionResult",
    "Partitioner",
    "PlannedPartition",
    "find_pattern_matches",
    "generate_grouped_partitions_from_list_of_nodes",
    "generate_partitions_from_list_of_nodes",
    "tag_constant_data",
    "tag_mutated_buffers",
]
