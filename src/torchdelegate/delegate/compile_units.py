"""Compile units: a backend's partitions compiled one by one, and who compiles them.

This is the one path by which partitions compile, whatever runs them. The default
``BackendDetails.preprocess_multimethod`` hands each partition, as a :class:`CompileUnit`, to
the current :class:`PartitionCompiler`: the one lowering chose for the call (a
``torchdelegate.preprocessing(...)`` block's, else the environment's compile cache; see
``compile/``), else :func:`compile_serially` here. Whoever compiles, the results come back in the
units' order, so the saved file does not depend on the path they took. While a unit compiles,
:func:`current_partition` names it, for the backend's own messages and warnings.

``BackendDetails.preprocess_multimethod`` calls into this module, so it does not import the
contract back: what compiling a unit asks of a backend class is :class:`UnitBackend`, which every
``BackendDetails`` subclass is.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Protocol

from torch.export import ExportedProgram

from torchdelegate.delegate.progress import partition_compiled
from torchdelegate.delegate.specs import CompileSpec
from torchdelegate.errors import PreprocessError


class UnitBackend(Protocol):
    """A backend class as its units compile: its id and its ``preprocess`` (or the deprecated
    ``preprocess_partition`` a subclass still overrides). Every ``BackendDetails`` subclass is one."""

    backend_id: str
    _calls_preprocess_partition: bool

    def preprocess(self, edge_program: ExportedProgram, compile_specs: list[CompileSpec]) -> Any: ...

    def preprocess_partition(
        self, edge_program: ExportedProgram, compile_specs: list[CompileSpec], where: str
    ) -> Any: ...


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
    def compile(self, backend: Any, units: Sequence[CompileUnit]) -> list[CompiledUnit]:
        """Every unit compiled by ``backend`` (a ``BackendDetails`` subclass: a compiler asks it for more
        than :class:`UnitBackend` says, its cache identity, its checks), in order; each completion
        reported to ``progress``."""
        ...


@dataclass
class CompileRun:
    """One backend's ``preprocess_multimethod`` call inside a lowering: who compiles its units, each
    partition's tag (method -> tags in order), and how the compile cache answered each
    (``(method, position)`` -> answer), which the lowering's report shows."""

    compiler: PartitionCompiler | None
    tags: Mapping[str, Sequence[str]]
    answers: dict[tuple[str, int], str | None] = field(default_factory=dict)


_compiler: ContextVar[PartitionCompiler | None] = ContextVar("torchdelegate_partition_compiler", default=None)
_run: ContextVar[CompileRun | None] = ContextVar("torchdelegate_compile_run", default=None)
_partition: ContextVar[str | None] = ContextVar("torchdelegate_partition", default=None)


@contextmanager
def compiling_with(compiler: PartitionCompiler) -> Iterator[None]:
    """Lowerings inside this block compile their units with ``compiler``."""
    token = _compiler.set(compiler)
    try:
        yield
    finally:
        _compiler.reset(token)


def current_compiler() -> PartitionCompiler | None:
    """The compiler a ``compiling_with`` block set, if any."""
    return _compiler.get()


@contextmanager
def compile_run(run: CompileRun) -> Iterator[CompileRun]:
    """Lowering: the backend's ``preprocess_multimethod`` call inside this block compiles as ``run`` says."""
    token = _run.set(run)
    try:
        yield run
    finally:
        _run.reset(token)


def current_partition() -> str:
    """How messages name the partition a backend's ``preprocess`` is compiling ("partition 'tag' of
    method 'forward'"); "sub-program" outside a compile unit (a whole program given to ``preprocess``)."""
    return _partition.get() or "sub-program"


@contextmanager
def failures_named(backend: UnitBackend, where: str) -> Iterator[None]:
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


def preprocess_unit(
    backend: UnitBackend, program: ExportedProgram, compile_specs: list[CompileSpec], where: str
) -> Any:
    """One unit's ``backend.preprocess``, with :func:`current_partition` naming it: the one call a
    partition's compile makes, here or on a worker. A backend still overriding the deprecated
    ``preprocess_partition`` has that called instead."""
    token = _partition.set(where)
    try:
        if backend._calls_preprocess_partition:
            return backend.preprocess_partition(program, compile_specs, where)
        return backend.preprocess(program, compile_specs)
    finally:
        _partition.reset(token)


def compile_in_process(backend: UnitBackend, unit: CompileUnit) -> Any:
    """The unit's ``preprocess`` here, its failure named by the partition."""
    with failures_named(backend, unit.where):
        return preprocess_unit(backend, unit.program, list(unit.compile_specs), unit.where)


def compile_serially(backend: UnitBackend, units: Sequence[CompileUnit]) -> list[CompiledUnit]:
    """Each unit in turn, in this process, with no cache."""
    compiled = []
    for unit in units:
        compiled.append(CompiledUnit(compile_in_process(backend, unit)))
        partition_compiled(backend.backend_id, unit.where)
    return compiled


def compile_partitions(
    backend: UnitBackend,
    edge_programs: Mapping[str, Sequence[ExportedProgram]],
    compile_specs: Mapping[str, Sequence[Sequence[CompileSpec]]],
) -> list[tuple[str, Any]]:
    """Every partition of every method as a unit, compiled by the current run's compiler (else
    the ``compiling_with`` block's, else here one by one): ``(method, result)`` in order. How the
    compile cache answered each is kept in the run."""
    run = _run.get()
    units = []
    for method, programs in edge_programs.items():
        tags = list(run.tags.get(method, ())) if run is not None else []
        specs = compile_specs[method]
        if len(specs) != len(programs):
            raise PreprocessError(
                f"preprocess_multimethod: method {method!r} has {len(programs)} sub-programs but "
                f"{len(specs)} lists of compile specs; give one list per sub-program"
            )
        for index, (program, unit_specs) in enumerate(zip(programs, specs, strict=True)):
            tag = tags[index] if index < len(tags) else str(index)
            units.append(CompileUnit(method, tag, program, tuple(unit_specs)))
    compiler = run.compiler if run is not None else _compiler.get()
    compiled = compiler.compile(backend, units) if compiler is not None else compile_serially(backend, units)
    positions: dict[str, int] = {}
    for unit, done in zip(units, compiled, strict=True):
        position = positions.setdefault(unit.method, 0)
        positions[unit.method] += 1
        if run is not None:
            run.answers[(unit.method, position)] = done.cache
    return [(unit.method, done.result) for unit, done in zip(units, compiled, strict=True)]
