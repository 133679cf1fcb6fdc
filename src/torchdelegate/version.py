"""This torchdelegate's version: what ``--version`` prints and what compile cache keys cover."""

__version__ = "0.2.0.dev0"
