"""Programs with several methods: ``to_edge``, ``EdgeProgramManager``, ``to_edge_transform_and_lower``.

A program is a set of methods (``forward``; or ``prefill`` and ``decode``) exported from one
model. ``to_edge`` decomposes each to core ATen (functionalizing in-place updates of
buffers; ``decomposition.py``) and makes methods that hold equal state share one tensor. The
manager is immutable: every step returns a new manager and leaves the old one as it was; what it
does is done by the modules it calls (``transform_passes.py``, ``batch.py``, the writer).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch._ops import OpOverload
from torch.export import ExportedProgram
from torch.fx import GraphModule

from torchdelegate.delegate.lowered_module import LoweredBackendModule, delegates_held_by, delegates_named_data
from torchdelegate.delegate.named_data import NamedDataStore, NamedDataStoreOutput, NamedDataSummary
from torchdelegate.delegate.specs import DelegationSpec
from torchdelegate.errors import PartitionError
from torchdelegate.exported.debug_handles import number_nodes
from torchdelegate.exported.structural_copy import MutableStateCopies, with_state
from torchdelegate.lowering.batch import lower
from torchdelegate.lowering.decomposition import KeepFilters, any_accepts, asked_overloads, decompose, wanted_whole
from torchdelegate.lowering.equal_programs import once_per_program
from torchdelegate.lowering.lowering_report import DeferredReport, attached_report
from torchdelegate.lowering.report_data import LoweringReport
from torchdelegate.lowering.run_partitioner import PartitionerLike
from torchdelegate.lowering.transform_passes import Pass, run_passes
from torchdelegate.partition.contract import Partitioner
from torchdelegate.serialize.writer import save_program

PartitionerChoice = PartitionerLike | Sequence[PartitionerLike]


def _methods(programs: ExportedProgram | Mapping[str, ExportedProgram]) -> dict[str, ExportedProgram]:
    if isinstance(programs, ExportedProgram):
        return {"forward": programs}
    if not isinstance(programs, Mapping) or not programs:
        raise TypeError(
            "expected an ExportedProgram or a non-empty {method name: ExportedProgram} mapping, "
            f"got {type(programs).__name__}"
        )
    for name, program in programs.items():
        if not isinstance(name, str) or not name:
            raise TypeError(f"method names must be non-empty str, got {name!r}")
        if not isinstance(program, ExportedProgram):
            raise TypeError(f"method {name!r} must be a torch.export.ExportedProgram, got {type(program).__name__}")
    return dict(programs)


def _numbered(programs: dict[str, ExportedProgram]) -> dict[str, ExportedProgram]:
    """``programs`` (of our own making) with every computation's debug handle (``exported/debug_handles.py``)."""
    for program in programs.values():
        number_nodes(program)
    return programs


def _own_state(programs: dict[str, ExportedProgram]) -> dict[str, ExportedProgram]:
    """Methods hold one tensor per name where their values are equal, and own what they write.

    Exports of one model already share their tensors; separate exports of equal models get
    their duplicates replaced, so weights (and a KV cache) exist once across methods. Every
    buffer that any method writes is copied once, so running the programs never writes
    into the caller's exported programs, and all methods keep sharing it.
    """
    canonical: dict[str, Any] = {}
    written = frozenset().union(*(p.graph_signature.buffers_to_mutate.values() for p in programs.values()))
    copies = MutableStateCopies()

    def shared(fqn: str, value: Any) -> Any:
        first = canonical.setdefault(fqn, value)
        if isinstance(value, torch.Tensor) and first is not value and _same_tensor_value(first, value):
            value = first
        return copies(value) if fqn in written and isinstance(value, torch.Tensor) else value

    return {method: with_state(program, shared) for method, program in programs.items()}


def _same_tensor_value(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values: two views of the same bytes are, without reading them (weights mapped from a file)."""
    if not (type(a) is type(b) and a.dtype == b.dtype and a.shape == b.shape and a.device == b.device):
        return False
    if a.data_ptr() == b.data_ptr() and a.stride() == b.stride():
        return True
    return bool(torch.equal(a.detach(), b.detach()))


def to_edge(programs: ExportedProgram | Mapping[str, ExportedProgram]) -> EdgeProgramManager:
    """Decompose every method to core ATen (functional) and wrap them in a manager."""
    methods = _methods(programs)
    manager = EdgeProgramManager(_numbered(_own_state(once_per_program(methods, decompose))))
    return manager._reported(_reports_of(methods))


class EdgeProgramManager:
    """The methods of one program, their delegates, and the named data those delegates share."""

    def __init__(
        self,
        programs: Mapping[str, ExportedProgram],
        named_data: NamedDataStoreOutput | None = None,
    ) -> None:
        self._programs = _methods(programs)
        # Delegates carry their named data: a manager around lowered programs holds all of it.
        delegates = (d for p in self._programs.values() for d in delegates_held_by(p.graph_module))
        self._named_data = delegates_named_data(named_data, delegates)
        self._report = _reports_of(self._programs)

    def _reported(self, report: DeferredReport | None) -> EdgeProgramManager:
        """This manager, carrying ``report`` (what the lowering that made it did)."""
        self._report = report.restricted(self._programs) if report is not None else None
        return self

    @property
    def report(self) -> LoweringReport | None:
        """What lowering did to these methods and why (``torchdelegate.report`` renders it): every
        stage of every ``to_backend`` that made this manager; None if none did. Made the first time it
        is asked for (or saved), from the programs as they were given to ``to_backend``."""
        return self._report() if self._report is not None else None

    @property
    def methods(self) -> list[str]:
        return list(self._programs)

    def exported_program(self, method: str = "forward") -> ExportedProgram:
        try:
            return self._programs[method]
        except KeyError:
            raise KeyError(f"no method {method!r}; the methods are {', '.join(map(repr, self._programs))}") from None

    @property
    def named_data(self) -> NamedDataStoreOutput:
        """Every delegate's named data, merged across partitions and methods (deduplicated)."""
        return self._named_data

    def named_data_summary(self) -> NamedDataSummary:
        return self._named_data.summary()

    def delegates(self) -> dict[str, list[LoweredBackendModule]]:
        """Each method's delegates, in topological order (a sub-graph's at its control-flow op)."""
        return {method: delegates_held_by(program.graph_module) for method, program in self._programs.items()}

    def __repr__(self) -> str:
        counts = ", ".join(f"{m}: {len(d)} delegates" for m, d in self.delegates().items())
        return f"EdgeProgramManager({counts})"

    def transform(self, passes: Sequence[Pass] | Mapping[str, Sequence[Pass]]) -> EdgeProgramManager:
        """Run passes on every method (a sequence) or on the named methods (a mapping)."""
        per_method = self._per_method(passes, "transform")
        programs = dict(self._programs)
        for method, method_passes in per_method.items():
            programs[method] = run_passes(method, programs[method], method_passes)
            number_nodes(programs[method])  # what the passes made gets numbers after the others
        return EdgeProgramManager(programs, self._named_data)._reported(self._report)

    def to_backend(self, partitioner: PartitionerChoice | Mapping[str, PartitionerChoice]) -> EdgeProgramManager:
        """Lower with a Partitioner or DelegationSpec (every method), a list of them applied in
        order, or a ``{method: ...}`` mapping (only the methods named)."""
        stages = self._stages(partitioner)
        programs = dict(self._programs)
        # One live store for every stage: each delegate sees all the program's named data.
        store = NamedDataStore()
        store.merge(self._named_data)
        report = self._report
        for number, stage in enumerate(stages, start=1):
            label = number if len(stages) > 1 else 0
            # The manager already owns its state (see to_edge): lowering shares it, uncopied.
            lowering = lower(programs, stage, named_data=store, copy_mutable_state=False, stage=label)
            programs = lowering.programs
            report = lowering.report if report is None else report.then(lowering.report)
        return EdgeProgramManager(programs, store.get_named_data_store_output())._reported(report)

    def save(
        self,
        path: str | os.PathLike[str],
        *,
        external_data_path: str | os.PathLike[str] | None = None,
        debug_info: bool = False,
        report: bool | LoweringReport | Mapping[str, Any] | None = True,
        assets: Mapping[str, bytes] | None = None,
    ) -> None:
        """Write the program to one file (docs/FORMAT.md): residual graphs, delegate blobs, state and
        named data, each distinct blob or tensor stored once. ``external_data_path`` puts named data
        and tensors in a second file, which other programs saved with the same path share (it is
        extended, never shrunk). The delegates' original sub-programs are not saved. ``debug_info``
        keeps the residual graphs' stack traces and module paths (a few hundred bytes a node).
        The file keeps :attr:`report` (how the compile cache answered left out, so a file does not
        depend on it), which ``Program.report`` and ``torchdelegate inspect`` read back;
        ``report=False`` leaves it out, and a ``LoweringReport`` or its JSON data is kept instead.
        ``assets`` (file name -> bytes: a tokenizer, a generation config) travel in the program file
        for its users, never read by the runtime; ``Program.asset(name)`` gives them back."""
        save_program(
            self._programs,
            self._named_data,
            path,
            external_data_path,
            debug_info=debug_info,
            report=self._report_to_save(report),
            assets=assets,
        )

    def _report_to_save(self, report: bool | LoweringReport | Mapping[str, Any] | None) -> Mapping[str, Any] | None:
        if report is None:  # what 0.1.0 took for "no report"
            return None
        if report is True:
            report = self.report if self._report is not None else False
        if report is False:
            return None
        if isinstance(report, LoweringReport):
            return report.without_cache_answers().to_json()
        if isinstance(report, Mapping):
            return report
        raise TypeError(
            f"save(report=...) takes True (the lowering's report), False, a LoweringReport or its JSON data; "
            f"got {type(report).__name__}"
        )

    def _per_method(self, value: Any, what: str) -> dict[str, Any]:
        if isinstance(value, Mapping):
            unknown = [m for m in value if m not in self._programs]
            if unknown:
                raise PartitionError(
                    f"{what}: no method {', '.join(map(repr, unknown))}; "
                    f"the methods are {', '.join(map(repr, self._programs))}"
                )
            return dict(value)
        return dict.fromkeys(self._programs, value)

    def _stages(self, partitioner: Any) -> list[dict[str, PartitionerLike]]:
        """One ``{method: partitioner}`` per stage: lists are applied in order, first claims first."""
        per_method = {m: _as_list(m, p) for m, p in self._per_method(partitioner, "to_backend").items()}
        depth = max((len(p) for p in per_method.values()), default=0)
        return [{m: p[i] for m, p in per_method.items() if i < len(p)} for i in range(depth)]


def _reports_of(programs: Mapping[str, ExportedProgram]) -> DeferredReport | None:
    """The report of programs ``to_backend`` returned (see ``lowering_report``), joined per method."""
    found = {method: attached_report(program) for method, program in programs.items()}
    parts = {method: part for method, part in found.items() if part is not None}
    return DeferredReport.joined(parts) if parts else None


def _as_list(method: str, choice: Any) -> list[PartitionerLike]:
    items = list(choice) if isinstance(choice, (list, tuple)) else [choice]
    for item in items:
        if isinstance(item, type) and issubclass(item, Partitioner):
            raise TypeError(f"method {method!r}: got the class {item.__name__}; pass an instance: {item.__name__}(...)")
        if not isinstance(item, (Partitioner, DelegationSpec)):
            raise TypeError(
                f"method {method!r}: expected a Partitioner, a DelegationSpec, or a list of them; "
                f"got {type(item).__name__}"
            )
    return items


def to_edge_transform_and_lower(
    programs: ExportedProgram | Mapping[str, ExportedProgram],
    partitioner: PartitionerChoice | Mapping[str, PartitionerChoice] | None = None,
    transform_passes: Sequence[Pass] | Mapping[str, Sequence[Pass]] | None = None,
) -> EdgeProgramManager:
    """Decompose (keeping the ops partitioners ask to keep), transform, and lower in order.

    An op kept whole that no backend then claims is decomposed afterwards, with a warning.
    """
    manager, kept = edge_keeping(programs, partitioner)
    if transform_passes is not None:
        manager = manager.transform(transform_passes)
    if partitioner is not None:
        manager = manager.to_backend(partitioner)  # one call: every stage's delegates share its named data
    return kept.decompose_unclaimed(manager)


def edge_keeping(
    programs: ExportedProgram | Mapping[str, ExportedProgram],
    partitioner: PartitionerChoice | Mapping[str, PartitionerChoice] | None,
) -> tuple[EdgeProgramManager, KeptWhole]:
    """``to_edge``, with the ops each partitioner's ``ops_to_not_decompose`` asks for left whole;
    and what was kept, to decompose once lowering is done (:meth:`KeptWhole.decompose_unclaimed`)."""
    methods = _methods(programs)
    stages = EdgeProgramManager(methods)._stages(partitioner) if partitioner is not None else []
    keep: dict[str, set[OpOverload]] = {m: set() for m in methods}
    filters: dict[str, KeepFilters] = {m: [] for m in methods}
    default_table = torch.export.default_decompositions()
    for stage in stages:
        for method, choice in stage.items():
            if isinstance(choice, Partitioner):
                asked, node_filter = choice.ops_to_not_decompose(methods[method])
                ops = {op for op in asked_overloads(asked) if op in default_table}
                keep[method] |= ops
                filters[method].append((ops, node_filter))
    kept = KeptWhole(keep, filters)
    # Equal programs decompose alike where the same partitioners kept the same ops in them.
    kept_by = {m: (tuple(sorted(map(str, keep[m]))), tuple(id(stage.get(m)) for stage in stages)) for m in methods}
    edge = once_per_program(
        methods, lambda m, p: decompose(m, p, kept.keep[m], any_accepts(kept.filters[m])), also=kept_by
    )
    return EdgeProgramManager(_numbered(_own_state(edge))), kept


@dataclass(frozen=True)
class KeptWhole:
    """The ops ``edge_keeping`` left whole in each method, and each partitioner's node filter."""

    keep: dict[str, set[OpOverload]]
    filters: dict[str, KeepFilters]

    def decompose_unclaimed(self, manager: EdgeProgramManager) -> EdgeProgramManager:
        """Decompose the kept ops no backend claimed; warn about those a partitioner wanted."""
        programs = dict(manager._programs)
        for method, program in programs.items():
            keep = self.keep.get(method, set())
            left = [
                node
                for gm in program.graph_module.modules()
                if isinstance(gm, GraphModule)
                for node in gm.graph.nodes
                if node.op == "call_function" and node.target in keep
            ]
            if not left:
                continue
            wanted = sorted({str(node.target) for node in left if wanted_whole(node, self.filters[method])})
            if wanted:
                warnings.warn(
                    f"method {method!r}: {', '.join(wanted)} kept whole for a backend that did not claim "
                    "them; decomposing them now",
                    stacklevel=3,
                )
            programs[method] = decompose(method, program)
        return EdgeProgramManager(programs, manager.named_data)._reported(manager._report)
