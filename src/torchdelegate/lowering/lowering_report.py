"""What went where and why, as data: the report every lowering emits.

Lowering makes a method's report in the same pass that lowers it (``batch.py``), from the
program the partitioner tagged, the partitioner's :class:`~torchdelegate.partition.plan.PartitionPlan`
and the partitions lowering itself found: for every computation, its backend or the reasons
each backend gave; for every partition, its nodes, ops, inputs and outputs, the bytes of the
weights that move into it and the FLOPs it computes; for the method, the share delegated by node
count and by FLOPs. FLOPs are torch's own count (``torch.utils.flop_counter``: matrix products,
convolutions, attention), so element-wise work weighs nothing; a node without shapes counts
zero. Blob sizes, compile cache answers and each backend's ``delegate_info`` are added once the
backends have compiled. A report is plain JSON (``to_json``/``from_json``), which is how a saved
file carries it.
"""

from __future__ import annotations

import types
import typing
import weakref
from collections import Counter
from collections.abc import Callable, Collection, Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind
from torch.fx import Node
from torch.utils.flop_counter import flop_registry

from torchdelegate.exported.debug_handles import DEBUG_HANDLE
from torchdelegate.exported.programs import TENSOR_STATE_KINDS, state_value
from torchdelegate.lowering.partitions import Partition
from torchdelegate.partition.contract import is_tuple_item
from torchdelegate.partition.modules import module_calls
from torchdelegate.partition.plan import PartitionPlan

REPORT_VERSION = 2  # 2: each node's debug handle
READ_VERSIONS = (1, 2)
NOT_DELEGATED = "not delegated"


@dataclass(frozen=True)
class NodeRow:
    """One computation: where it went (``backend_id``/``tag``, or None) and each backend's reason if not there."""

    name: str
    op: str
    backend_id: str | None
    tag: str | None
    reasons: dict[str, str]
    flops: int
    inputs: list[str]  # computations and user inputs it reads (through tuple items)
    modules: list[str] = field(default_factory=list)  # the module calls it was made in, outermost first
    debug_handle: int | None = None  # its number since to_edge, which a delegate's debug_handle_map names


@dataclass(frozen=True)
class PartitionRow:
    tag: str
    backend_id: str
    nodes: int
    ops: dict[str, int]  # op -> count, most frequent first (ties by name)
    inputs: list[str]  # values computed or given outside that it reads
    outputs: list[str]  # its values read outside
    weight_bytes: int  # parameters and constants carried inside (shared by every partition that carries them)
    flops: int
    kept_apart: dict[str, str]  # tag of a partition it touches -> a node on the path between them
    blob_bytes: int | None = None
    cache: str | None = None  # how the compile cache answered this lowering: "hit", "miss"; None: no cache
    delegate_info: Any = None  # what the backend said of its delegate (what it fused, what not): a JSON value

    def __post_init__(self) -> None:  # however made (a saved file's JSON has its keys sorted)
        object.__setattr__(self, "ops", dict(sorted(self.ops.items(), key=lambda item: (-item[1], item[0]))))


@dataclass(frozen=True)
class MethodReport:
    method: str
    nodes: list[NodeRow]  # every computation, in graph order
    partitions: list[PartitionRow]
    user_inputs: list[str]
    user_outputs: list[str]  # what the graph returns (through tuple items), updated buffers included
    module_types: dict[str, str] = field(default_factory=dict)  # module call -> its class's qualified name

    @property
    def delegated_nodes(self) -> int:
        return sum(row.tag is not None for row in self.nodes)

    @property
    def total_flops(self) -> int:
        return sum(row.flops for row in self.nodes)

    @property
    def delegated_flops(self) -> int:
        return sum(row.flops for row in self.nodes if row.tag is not None)

    def module_callers(self) -> dict[str, str | None]:
        """Each module call -> the call it was made in (None at the top), in the order they first appear."""
        callers: dict[str, str | None] = {}
        for row in self.nodes:
            for caller, call in zip([None, *row.modules], row.modules, strict=False):
                callers.setdefault(call, caller)
        return callers

    def not_delegated(self) -> dict[tuple[str, str], list[str]]:
        """``(op, reason) -> node names``; the reason joins every backend's answer."""
        found: dict[tuple[str, str], list[str]] = {}
        for row in self.nodes:
            if row.tag is None:
                why = "; ".join(f"{b}: {r}" for b, r in row.reasons.items()) or "no backend was asked"
                found.setdefault((row.op, why), []).append(row.name)
        return found


@dataclass(frozen=True)
class LoweringReport:
    """A report per method, and the backends in the priority order they were given."""

    backends: list[str]
    methods: dict[str, MethodReport] = field(default_factory=dict)
    state_bytes: dict[str, int] = field(default_factory=dict)  # method -> bytes of the tensors it holds
    unique_state_bytes: int = 0  # the same, counting a tensor that several names or methods hold once

    def with_blob_sizes(
        self,
        sizes: Mapping[str, Mapping[str, int]],
        cache: Mapping[str, Mapping[str, str | None]] | None = None,
        info: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> LoweringReport:
        """A copy with each partition's compiled size, from ``{method: {tag: bytes}}``, how the compile
        cache answered it, from ``{method: {tag: "hit" | "miss" | None}}``, and its backend's
        ``delegate_info``, from ``{method: {tag: info}}``."""
        cache, info = cache or {}, info or {}
        return self._with_partitions(
            lambda method, p: replace(
                p,
                blob_bytes=sizes.get(method, {}).get(p.tag),
                cache=cache.get(method, {}).get(p.tag),
                delegate_info=info.get(method, {}).get(p.tag),
            )
        )

    def without_cache_answers(self) -> LoweringReport:
        """A copy without how the compile cache answered: what a file keeps, the same however it was compiled."""
        return self._with_partitions(lambda method, p: replace(p, cache=None))

    def _with_partitions(self, change: Callable[[str, PartitionRow], PartitionRow]) -> LoweringReport:
        """A copy with each partition row changed by ``change(method, row)``."""
        methods = {
            name: replace(method, partitions=[change(name, p) for p in method.partitions])
            for name, method in self.methods.items()
        }
        return replace(self, methods=methods)

    def then(self, later: LoweringReport) -> LoweringReport:
        """This report followed by a later stage's, which lowered what this one left: a computation
        this stage left takes the later decision (both stages' reasons kept), partitions add up, and
        the state is this stage's (the programs as the user gave them)."""
        backends = [*self.backends, *(b for b in later.backends if b not in self.backends)]
        methods = dict(self.methods)
        for name, method in later.methods.items():
            methods[name] = _then(methods[name], method) if name in methods else method
        return replace(self, backends=backends, methods=methods)

    def restricted(self, methods: Collection[str]) -> LoweringReport:
        """The report of ``methods`` only."""
        kept = {name: report for name, report in self.methods.items() if name in methods}
        state = {name: size for name, size in self.state_bytes.items() if name in methods}
        return replace(self, methods=kept, state_bytes=state)

    def to_json(self) -> dict[str, Any]:
        return {
            "version": REPORT_VERSION,
            "backends": self.backends,
            "methods": [asdict(m) for m in self.methods.values()],
            "state_bytes": self.state_bytes,
            "unique_state_bytes": self.unique_state_bytes,
        }

    @classmethod
    def from_json(cls, value: Mapping[str, Any]) -> LoweringReport:
        """Raises ``ValueError`` naming the field when ``value`` is not a report this version reads."""
        if not isinstance(value, Mapping) or value.get("version") not in READ_VERSIONS:
            raise ValueError(f"not a partition report of a version this torchdelegate reads ({READ_VERSIONS})")
        try:
            methods = {}
            for entry in value["methods"]:
                nodes = [_row(NodeRow, row) for row in entry["nodes"]]
                partitions = [_row(PartitionRow, row) for row in entry["partitions"]]
                method, inputs, outputs = (_typed(entry[k], t) for k, t in _METHOD_FIELDS)
                types = _typed(entry.get("module_types", {}), dict[str, str])
                methods[method] = MethodReport(method, nodes, partitions, inputs, outputs, types)
            state = _typed(value.get("state_bytes", {}), dict[str, int])
            backends = _typed(value["backends"], list[str])
            return cls(backends, methods, state, _typed(value.get("unique_state_bytes", 0), int))
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"partition report: malformed entry ({error})") from error


def _then(first: MethodReport, later: MethodReport) -> MethodReport:
    """``first`` with what a later stage did to the computations it left."""
    later_rows = {row.name: row for row in later.nodes}
    rows = []
    for row in first.nodes:
        after = later_rows.get(row.name)
        if row.tag is None and after is not None:
            row = replace(row, backend_id=after.backend_id, tag=after.tag, reasons={**row.reasons, **after.reasons})
        rows.append(row)
    types = {**first.module_types, **later.module_types}
    return replace(first, nodes=rows, partitions=[*first.partitions, *later.partitions], module_types=types)


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


def as_report(value: LoweringReport | Mapping[str, Any]) -> LoweringReport:
    """``value`` as a report: a ``LoweringReport`` as it is, or its JSON data (``Program.report``) read."""
    if isinstance(value, LoweringReport):
        return value
    if isinstance(value, Mapping):
        return LoweringReport.from_json(value)
    raise TypeError(f"expected a LoweringReport or its JSON data (Program.report), got {type(value).__name__}")


_METHOD_FIELDS = (("method", str), ("user_inputs", list[str]), ("user_outputs", list[str]))
_FIELD_TYPES = {cls: typing.get_type_hints(cls) for cls in (NodeRow, PartitionRow)}


def _row(cls: type[Any], value: Any) -> Any:
    """A report row read from a file, every field of its declared type: the file author wrote it."""
    if not isinstance(value, Mapping):
        raise TypeError(f"a {cls.__name__} is {type(value).__name__}, not an object")
    hints = _FIELD_TYPES[cls]
    return cls(**{key: _typed(item, hints[key]) if key in hints else item for key, item in value.items()})


def _typed(value: Any, hint: Any) -> Any:
    """``value`` if it is of type ``hint`` (str, int, None, unions, lists and dicts of them), else ``TypeError``."""
    if not _is_a(value, hint):
        raise TypeError(f"{str(value)[:60]!r} is not {hint}")
    return value


def _is_a(value: Any, hint: Any) -> bool:
    origin, arguments = typing.get_origin(hint), typing.get_args(hint)
    if hint is type(None):
        return value is None
    if origin is list:
        return isinstance(value, list) and all(_is_a(v, arguments[0]) for v in value)
    if origin is dict:
        return isinstance(value, dict) and all(
            _is_a(k, arguments[0]) and _is_a(v, arguments[1]) for k, v in value.items()
        )
    if hint is Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_is_a(value, a) for a in arguments)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


Memory = tuple[int, int, torch.dtype, tuple[int, ...]]  # what a tensor reads: see _memory


def held_state(programs: Mapping[str, ExportedProgram]) -> dict[str, dict[Memory, int]]:
    """Per method, the bytes of each parameter, buffer and constant it holds, keyed by the memory
    the tensor reads (two names of one tensor are one entry). Read when lowering: a report made
    later keeps these counts, not the tensors."""
    held = {}
    for method, program in programs.items():
        values = (*program.state_dict.values(), *program.constants.values())
        held[method] = {_memory(v): v.nbytes for v in values if isinstance(v, torch.Tensor)}
    return held


def state_totals(held: Mapping[str, Mapping[Memory, int]]) -> tuple[dict[str, int], int]:
    """Bytes per method, and in all: a tensor that several names or methods hold (tied embeddings,
    weights shared by prefill and decode) counts once."""
    union: dict[Memory, int] = {}
    for tensors in held.values():
        union.update(tensors)
    return {method: sum(tensors.values()) for method, tensors in held.items()}, sum(union.values())


def state_bytes(programs: Mapping[str, ExportedProgram]) -> tuple[dict[str, int], int]:
    """Bytes of parameters, buffers and constants per method, and in all (see :func:`state_totals`)."""
    return state_totals(held_state(programs))


def _memory(tensor: torch.Tensor) -> Memory:
    """What a tensor reads: equal for two names of one tensor, different for two copies."""
    return tensor.untyped_storage().data_ptr(), int(tensor.storage_offset()), tensor.dtype, tuple(tensor.shape)


@dataclass(frozen=True)
class Boundary:
    """A partition's boundary as lowering found it, by name: what it reads from outside (values and
    sub-graphs), what it gives back, and the state it carries inside."""

    reads: frozenset[str]
    outputs: list[str]
    state: list[str]

    @classmethod
    def of(cls, partition: Partition) -> Boundary:
        reads = frozenset(n.name for n in [*partition.inputs, *partition.attrs])
        return cls(reads, [n.name for n in partition.outputs], [n.name for n in partition.state])


@dataclass(frozen=True)
class ReportedProgram:
    """What a method's report reads of its program: the graph (names, shapes and module calls, no
    tensors), the user inputs and the bytes of each weight. Lowering takes it from the program it
    was given, so that a report made later does not keep the caller's tensors alive."""

    graph: torch.fx.Graph
    user_inputs: frozenset[str]
    weights: Mapping[str, int]  # placeholder name -> bytes

    @classmethod
    def of(cls, program: ExportedProgram) -> ReportedProgram:
        return cls(program.graph, frozenset(_user_inputs(program)), _weight_bytes(program))


def method_report(
    method: str, program: ExportedProgram | ReportedProgram, plan: PartitionPlan, found: Mapping[str, Boundary]
) -> MethodReport:
    """The report of ``program`` partitioned as ``plan`` says, with each partition's boundary as
    lowering found it (``found``: tag -> boundary); the program is only read."""
    reported = program if isinstance(program, ReportedProgram) else ReportedProgram.of(program)
    graph_nodes = {node.name: node for node in reported.graph.nodes}
    user_inputs = reported.user_inputs
    rows: list[NodeRow] = []
    module_types: dict[str, str] = {}
    for decision in plan.decisions:
        node = graph_nodes[decision.node]
        inputs = [n.name for n in _sources(node) if n.op == "call_function" or n.name in user_inputs]
        calls = module_calls(node)
        module_types.update((call.name, call.type_name) for call in calls)
        rows.append(
            NodeRow(
                decision.node,
                decision.op,
                decision.backend_id,
                decision.tag,
                decision.reasons,
                _flops(node),
                inputs,
                [call.name for call in calls],
                handle if isinstance(handle := node.meta.get(DEBUG_HANDLE), int) else None,
            )
        )
    flops = {row.name: row.flops for row in rows}
    weights = reported.weights
    partitions = []
    for planned in plan.partitions:
        members = [graph_nodes[name] for name in planned.nodes]
        computations = [n for n in members if not is_tuple_item(n)]
        boundary = found[planned.tag]
        partitions.append(
            PartitionRow(
                tag=planned.tag,
                backend_id=planned.backend_id,
                nodes=len(computations),
                ops=dict(Counter(short_op(str(n.target)) for n in computations)),
                inputs=_in_first_use_order(members, boundary.reads),
                outputs=list(boundary.outputs),
                weight_bytes=sum(weights.get(name, 0) for name in boundary.state),
                flops=sum(flops.get(n.name, 0) for n in computations),
                kept_apart=dict(planned.kept_apart),
            )
        )
    outputs = [n.name for n in _sources(reported.graph.output_node())]
    ordered_inputs = sorted(user_inputs, key=list(graph_nodes).index)
    return MethodReport(method, rows, partitions, ordered_inputs, outputs, module_types)


def _in_first_use_order(members: list[Node], names: Collection[str]) -> list[str]:
    """``names`` in the order ``members`` first read them."""
    read = dict.fromkeys(source.name for node in members for source in node.all_input_nodes)
    return [name for name in read if name in names]


def _sources(node: Node) -> list[Node]:
    """The nodes ``node`` reads, looking through tuple items to the node that made the tuple."""
    found: dict[Node, None] = {}
    for source in node.all_input_nodes:
        found[source.args[0] if is_tuple_item(source) and isinstance(source.args[0], Node) else source] = None
    return list(found)


def short_op(op: str) -> str:
    """``addmm`` for ``aten.addmm.default``: how the report names an op where space is short."""
    return op.removeprefix("aten.").removesuffix(".default")


def _user_inputs(program: ExportedProgram) -> set[str]:
    return {spec.arg.name for spec in program.graph_signature.input_specs if spec.kind == InputKind.USER_INPUT}


def _weight_bytes(program: ExportedProgram) -> dict[str, int]:
    """Placeholder name -> bytes, for parameters and constants (not buffers a method updates)."""
    mutated = set(program.graph_signature.buffers_to_mutate.values())
    found = {}
    for spec in program.graph_signature.input_specs:
        if spec.kind in TENSOR_STATE_KINDS and spec.target is not None and spec.target not in mutated:
            value = state_value(program, spec.target)
            if isinstance(value, torch.Tensor):
                found[spec.arg.name] = value.numel() * value.element_size()
    return found


def _at_example_sizes(value: Any) -> Any:
    """A tensor of symbolic sizes as a meta tensor of the sizes export traced with (its example's).

    FLOPs are counted at those sizes. Reading a symbolic size as an int would instead add a guard to
    the program's shape environment and make the caller's dynamic dimension static."""
    if not isinstance(value, torch.Tensor) or all(isinstance(size, int) for size in value.shape):
        return value
    return torch.empty(_shape(value), dtype=value.dtype, device="meta")


class _NoExampleSize(Exception):
    pass


def _example_value(argument: Any) -> Any:
    return _at_example_sizes(argument.meta.get("val")) if isinstance(argument, Node) else argument


def _linear_flops(node: Node) -> int:
    """A linear layer kept whole through decomposition (torch counts it as the ``addmm`` it becomes):
    two FLOPs per input feature of each output value."""
    try:
        output, weight = _example_value(node), _example_value(node.args[1])
    except _NoExampleSize:
        return 0
    if not isinstance(output, torch.Tensor) or not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        return 0
    return 2 * output.numel() * weight.shape[1]


def _mapped(function: Callable[[Any], Any], value: Any) -> Any:
    """``function`` applied to every leaf of the lists, tuples and dicts in ``value`` (a node's arguments)."""
    if isinstance(value, list):  # fx keeps a list argument as a list type of its own
        return [_mapped(function, item) for item in value]
    if type(value) is tuple:
        return tuple(_mapped(function, item) for item in value)
    if isinstance(value, dict):
        return {key: _mapped(function, item) for key, item in value.items()}
    return function(value)


def _flops(node: Node) -> int:
    """torch's FLOP count for ``node`` from the shapes export recorded; 0 when it has none."""
    target = node.target
    if target is torch.ops.aten.linear.default:
        return _linear_flops(node)
    packet = getattr(target, "overloadpacket", None)
    count = flop_registry.get(packet) if packet is not None else None
    if count is None or "val" not in node.meta:
        return 0

    formula = getattr(count, "__wrapped__", None)  # torch's formula on shapes, inside its pytree-walking wrapper
    try:
        if formula is not None:
            args = _mapped(_example_shape, node.args)
            kwargs = _mapped(_example_shape, node.kwargs)
            return int(formula(*args, **kwargs, out_shape=_mapped(_shape, node.meta["val"])))
        args = _mapped(_example_value, node.args)
        kwargs = _mapped(_example_value, node.kwargs)
        output = _mapped(_at_example_sizes, node.meta["val"])
        return int(count(*args, **kwargs, out_val=output))
    except Exception:  # a shape torch's counter cannot read: count nothing
        return 0


def _shape(value: Any) -> Any:
    """A tensor's sizes at the example export traced with; other values as they are."""
    if not isinstance(value, torch.Tensor):
        return value
    sizes = tuple(size if isinstance(size, int) else size.node.hint for size in value.shape)
    if any(size is None for size in sizes):  # data-dependent: no example size
        raise _NoExampleSize
    return sizes


def _example_shape(argument: Any) -> Any:
    return _shape(argument.meta.get("val")) if isinstance(argument, Node) else argument
