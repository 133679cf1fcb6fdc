"""Partitions compiled one by one: the unit of work of a backend whose partitions compile
independently, and who compiles them.

Lowering hands such a backend's partitions, as :class:`CompileUnit` s, to the current
:class:`PartitionCompiler`: the one a ``torchdelegate.preprocessing(...)`` block set, else the
one the environment asks for (``TORCHDELEGATE_CACHE``'s compile cache, ``compile/options.py``),
else :func:`compile_serially` in this process. Whoever compiles, the results come back in the
units' order, so the saved file does not depend on the path they took.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Protocol

from torch.export import ExportedProgram

from torchdelegate.delegate.backend_details import BackendDetails
from torchdelegate.delegate.progress import partition_compiled
from torchdelegate.delegate.specs import CompileSpec
from torchdelegate.errors import PreprocessError


@dataclass(frozen=True)
class CompileUnit:
    """One partition on its own: its sub-program and compile specs, and where it is in the lowering."""

    method: str
    tag: str
    program: ExportedProgram
    compile_specs: tuple[CompileSpec, ...]

    @property
    def where(self) -> str:
        return f"partition {self.tag!r} of method {self.method!r}"


@dataclass(frozen=True)
class CompiledUnit:
    """What a unit's backend returned (checked by lowering), and how the compile cache answered:
    ``"hit"`` (nothing compiled), ``"miss"`` (compiled, then stored) or None (no cache)."""

    result: Any
    cache: str | None = None


class PartitionCompiler(Protocol):
    def compile(self, backend: type[BackendDetails], units: Sequence[CompileUnit]) -> list[CompiledUnit]:
        """Every unit compiled by ``backend``, in order; each completion reported to ``progress``."""
        ...


@contextmanager
def failures_named(backend: type[BackendDetails], where: str) -> Iterator[None]:
    """A backend's exception inside the block re-raised as a ``PreprocessError`` naming the backend and
    ``where`` (the partition), chained; a ``PreprocessError`` that names it already passes as it is."""
    try:
        yield
    except PreprocessError as e:
        if where in str(e):
            raise
        raise PreprocessError(
            f"backend {backend.backend_id!r} failed to preprocess {where}: PreprocessError: {e}"
        ) from e
    except Exception as e:
        raise PreprocessError(
            f"backend {backend.backend_id!r} failed to preprocess {where}: {type(e).__name__}: {e}"
        ) from e


def compile_in_process(backend: type[BackendDetails], unit: CompileUnit) -> Any:
    """``backend.preprocess_partition`` on the unit here, its failure named by the partition."""
    with failures_named(backend, unit.where):
        return backend.preprocess_partition(unit.program, list(unit.compile_specs), unit.where)


def compile_serially(backend: type[BackendDetails], units: Sequence[CompileUnit]) -> list[CompiledUnit]:
    """Each unit in turn, in this process, with no cache."""
    compiled = []
    for unit in units:
        compiled.append(CompiledUnit(compile_in_process(backend, unit)))
        partition_compiled(backend.backend_id, unit.where)
    return compiled


_current: ContextVar[PartitionCompiler | None] = ContextVar("torchdelegate_partition_compiler", default=None)


@contextmanager
def compiling_with(compiler: PartitionCompiler) -> Iterator[None]:
    """Lowerings inside this block compile their units with ``compiler``."""
    token = _current.set(compiler)
    try:
        yield
    finally:
        _current.reset(token)


def compile_units(backend: type[BackendDetails], units: Sequence[CompileUnit]) -> list[CompiledUnit]:
    """``units`` compiled by the current compiler, in order."""
    compiler = _current.get()
    if compiler is None:
        from torchdelegate.compile.options import environment_compiler  # it starts pools: imported when needed

        compiler = environment_compiler()
    if compiler is None:
        return compile_serially(backend, units)
    return compiler.compile(backend, units)
