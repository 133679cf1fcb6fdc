"""This torchdelegate's version: what ``--version`` prints and what compile cache keys cover."""

__version__ = "0.1.0"
