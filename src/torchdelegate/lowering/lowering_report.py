"""The report a lowering returns: made when first asked for, joined across stages and calls, and
found again from the programs ``to_backend`` returned (:func:`lowering_report`).

Lowering makes a method's report in the same pass that lowers it (``batch.py``), from the
program the partitioner tagged, the partitioner's :class:`~torchdelegate.partition.plan.PartitionPlan`
and the partitions lowering itself found (``method_report.py``). It keeps only what that needs
(plans, boundaries, graphs, the bytes of state held: ``held_state.py``) in a :class:`DeferredReport`,
which makes the :class:`~torchdelegate.lowering.report_data.LoweringReport` (``report_data.py``)
the first time it is read or saved. The report's data and how it is built live in those modules;
their names stay importable from here, where lowering and the report layer import them.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Collection, Mapping
from dataclasses import replace

from torch.export import ExportedProgram

from torchdelegate.lowering.held_state import Memory, state_bytes, state_totals
from torchdelegate.lowering.method_report import method_report
from torchdelegate.lowering.report_data import (
    LoweringReport,
    MethodReport,
    NodeRow,
    PartitionRow,
    short_op,
)

__all__ = [  # its own, and the report's public names as the deprecated torchdelegate.report.data served them
    "DeferredReport",
    "LoweringReport",
    "MethodReport",
    "NodeRow",
    "PartitionRow",
    "attach_report",
    "attached_report",
    "lowering_report",
    "method_report",
    "short_op",
    "state_bytes",
]


class DeferredReport:
    """A lowering's report, made the first time it is asked for (then kept) from what the lowering
    kept: its plans and boundaries, what compiled, the graphs as they were given and the bytes of the
    state each method held (``held``, read when lowering). Lowering thus pays for a report (FLOPs,
    module calls, rows) only where one is read or saved, and keeps none of the caller's tensors."""

    def __init__(self, make: Callable[[], LoweringReport], held: Mapping[str, Mapping[Memory, int]]) -> None:
        self._make: Callable[[], LoweringReport] | None = make
        self._made: LoweringReport | None = None
        self.held = held

    def __call__(self) -> LoweringReport:
        if self._make is not None:
            self._made, self._make = self._make(), None
        assert self._made is not None
        return self._made

    def then(self, later: DeferredReport) -> DeferredReport:
        """This report followed by a later stage's (:meth:`LoweringReport.then`), when asked for."""
        return DeferredReport(lambda: self().then(later()), self.held)

    def restricted(self, methods: Collection[str]) -> DeferredReport:
        """The report of ``methods`` only, their shared state counted once among themselves."""
        held = {method: tensors for method, tensors in self.held.items() if method in methods}
        kept = list(methods)
        return DeferredReport(lambda: replace(self().restricted(kept), unique_state_bytes=state_totals(held)[1]), held)

    @classmethod
    def joined(cls, parts: Mapping[str, tuple[DeferredReport, str]]) -> DeferredReport:
        """One report of methods lowered by different calls: ``{method: (report, its name there)}``
        (a program ``to_backend`` lowered alone is ``"forward"`` in its report)."""
        first = next(iter(parts.values()))[0]
        if all(report is first and name == method for method, (report, name) in parts.items()):
            return first.restricted(list(parts))
        held = {method: report.held.get(name, {}) for method, (report, name) in parts.items()}

        def make() -> LoweringReport:
            made = {method: (report(), name) for method, (report, name) in parts.items()}
            backends = list(dict.fromkeys(b for report, _ in made.values() for b in report.backends))
            methods = {
                method: replace(report.methods[name], method=method)
                for method, (report, name) in made.items()
                if name in report.methods
            }
            per_method, unique = state_totals(held)
            return LoweringReport(backends, methods, per_method, unique)

        return cls(make, held)


_REPORTS: weakref.WeakKeyDictionary[ExportedProgram, tuple[DeferredReport, str]] = weakref.WeakKeyDictionary()


def attach_report(program: ExportedProgram, report: DeferredReport, method: str) -> None:
    """Remember that lowering made ``program`` as ``method`` and what its report says (no reference
    keeps the program alive)."""
    _REPORTS[program] = (report, method)


def attached_report(lowered: ExportedProgram) -> tuple[DeferredReport, str] | None:
    """The report attached to ``lowered``, not yet made, and the method it names ``lowered``."""
    return _REPORTS.get(lowered)


def lowering_report(lowered: ExportedProgram) -> LoweringReport | None:
    """The report of the lowering that returned ``lowered`` (``to_backend(program, partitioner)``, or
    each program of the mapping form), the methods lowered in that one call included; None for a
    program no lowering returned. A manager has its own: ``EdgeProgramManager.report``."""
    if not isinstance(lowered, ExportedProgram):
        raise TypeError(
            f"lowering_report takes an ExportedProgram that to_backend returned, got {type(lowered).__name__}; "
            "a manager carries its report as EdgeProgramManager.report"
        )
    attached = _REPORTS.get(lowered)
    return None if attached is None else attached[0]()
