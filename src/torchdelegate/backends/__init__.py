"""Backends shipped with torchdelegate; each module is one backend and its partitioner."""
