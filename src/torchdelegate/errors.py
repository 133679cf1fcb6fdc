"""The exception hierarchy.

Every error the package raises derives from :class:`TorchDelegateError`, and also from the
built-in exception a caller would naturally catch (``ValueError``, ``RuntimeError``,
``NotImplementedError``), so generic handlers keep working.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager

_TERMINAL_COLOURS = re.compile(r"\x1b\[[0-9;]*m")


class TorchDelegateError(Exception):
    """Base class of every error raised by torchdelegate."""


class BackendNotFoundError(TorchDelegateError, NotImplementedError):
    """No backend is registered under the requested id."""


class OperatorNotFoundError(TorchDelegateError, NotImplementedError):
    """A sound file calls an operator this process has not registered: its library is not imported."""


class BackendRegistrationError(TorchDelegateError, ValueError):
    """Two different classes claim the same backend id."""


class PartitionError(TorchDelegateError, ValueError):
    """A partitioner's result cannot be lowered: bad tags, tagged inputs or outputs, cycles."""


class CheckpointError(TorchDelegateError, ValueError):
    """A checkpoint directory that cannot be made into a program (``torchdelegate llm export``)."""


class QuantizationError(TorchDelegateError, ValueError):
    """A quantization request that cannot be met (an unknown recipe, a group size that does not fit)."""


class UntrustedCodeError(TorchDelegateError, PermissionError):
    """A loaded file's delegate would run native code from a backend its loader did not trust."""


class GraphChangedError(PartitionError):
    """A partitioner changed the graph it was only allowed to tag."""


class NamedDataConflictError(TorchDelegateError, ValueError):
    """One named-data key stored with two different contents."""

    def __init__(self, message: str, key: str) -> None:
        super().__init__(message)
        self.key = key


class PreprocessError(TorchDelegateError, RuntimeError):
    """A backend failed, or returned something unusable, while compiling a partition."""


class DelegateExecutionError(TorchDelegateError, RuntimeError):
    """A backend failed while initialising or executing a delegate."""


class MethodExecutionError(TorchDelegateError, RuntimeError):
    """An op of a method's own graph (outside every delegate) failed while running: an input
    value out of its domain (an index past a table's end), or a graph altered after saving."""


class SerializationError(TorchDelegateError, ValueError):
    """A program cannot be saved: something in it has no representation in the file format."""


class FormatError(TorchDelegateError, ValueError):
    """A file is not a valid torchdelegate file: bad magic, version, offset, length or checksum."""


class ProgramInputError(TorchDelegateError, ValueError):
    """The inputs given to a method do not match its signature (count, dtype, rank, sizes)."""


class ProgramClosedError(TorchDelegateError, RuntimeError):
    """A method was run on a program that has been closed."""


class BackendUnavailableError(TorchDelegateError, RuntimeError):
    """A program needs a backend whose ``is_available()`` is False on this machine."""


class TorchRequiredError(TorchDelegateError, ImportError):
    """A file needs torch to run (its graph computes outside its delegates, or a backend runs on torch),
    or lowering was asked for, in a process where torch is not installed."""


def first_line(error: BaseException, limit: int = 300) -> str:
    """``error``'s first message line, without terminal colours, cut at ``limit`` characters.

    For messages of ours that quote another library's error: that library's full text stays
    in the chained ``__cause__``.
    """
    lines = _TERMINAL_COLOURS.sub("", str(error)).strip().splitlines()
    line = lines[0] if lines else type(error).__name__
    return line if len(line) <= limit else line[: limit - 1] + "…"


@contextmanager
def located(where: str) -> Iterator[None]:
    """A ``FormatError`` raised inside the block gets ``where`` before its message (``"<where>: ..."``)
    and goes on, the same exception: where in a file a problem is, said once at the boundary that
    knows it rather than passed down to every check."""
    try:
        yield
    except FormatError as error:
        if error.args and isinstance(error.args[0], str):
            error.args = (f"{where}: {error.args[0]}", *error.args[1:])
        raise
