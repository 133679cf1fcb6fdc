"""Warnings and logs torch emits about its own internals, silenced where torchdelegate calls into them.

torch's program rewrites (``run_decompositions``, the export serializer) copy tree specs
through an API torch itself deprecated; the warning names nothing the user wrote or can change.
Where our own error reports a failure (a file torch cannot load, an op that fails on fake
tensors), torch's log of the same failure, traceback and all, is noise around it. And the first
import of torchao (ours, to quantize, or transformers', which imports it wherever it is installed)
logs about GPU kernels a CPU build cannot load and about torchao's types registered with torch
through an API torch deprecated: nothing a user of our commands wrote or can change.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterable, Iterator


@contextlib.contextmanager
def torch_internal_warnings_silenced() -> Iterator[None]:
    """Within this block, torch's deprecated tree-spec warnings are not shown; other warnings are."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*treespec.*", category=FutureWarning)
        yield


@contextlib.contextmanager
def loggers_quieted(names: Iterable[str], level: int = logging.CRITICAL) -> Iterator[None]:
    """Within this block, the named loggers pass only records of ``level`` and above."""
    loggers = [logging.getLogger(name) for name in names]
    previous = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(level)
    try:
        yield
    finally:
        for logger, old in zip(loggers, previous, strict=True):
            logger.setLevel(old)


IMPORT_NOISE = ("torchao", "torch.utils._pytree")
"""The loggers that speak when torchao is first imported: torchao's own (a kernel library this build
lacks) and torch's pytree (torchao's enums registered as constants, a deprecated call)."""


@contextlib.contextmanager
def import_noise_quieted() -> Iterator[None]:
    """Within this block, importing torchao (directly, or through transformers) logs only errors."""
    with loggers_quieted(IMPORT_NOISE, logging.ERROR):
        yield
