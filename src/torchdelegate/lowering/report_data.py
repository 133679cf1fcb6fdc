"""A lowering's report as data: its rows, a method's report, stages joined, JSON.

What lowering decided and made, per computation (:class:`NodeRow`), per partition
(:class:`PartitionRow`) and per method (:class:`MethodReport`), in one :class:`LoweringReport`
for all methods; a later stage's report joined after an earlier one's (``then``); blob sizes,
compile cache answers and each backend's ``delegate_info`` added once the backends have compiled.
A report is plain JSON (``to_json``/``from_json``), which is how a saved file carries it; reading
checks every field's type, since the file's author wrote it. This module imports no torch: what
reads a saved report (``torchdelegate inspect``, the pictures) needs none.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Callable, Collection, Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

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


def short_op(op: str) -> str:
    """``addmm`` for ``aten.addmm.default``: how the report names an op where space is short."""
    return op.removeprefix("aten.").removesuffix(".default")
