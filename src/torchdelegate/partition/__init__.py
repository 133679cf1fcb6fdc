"""Partitioners: who decides which nodes go to which backend."""

from torchdelegate.partition.partitioner import DELEGATION_TAG, Partitioner, PartitionResult

__all__ = ["DELEGATION_TAG", "PartitionResult", "Partitioner"]
