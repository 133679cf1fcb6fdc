"""The partition report as text for a terminal: coverage, a row per partition, the rest by reason."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torchdelegate.lowering.report_data import LoweringReport, MethodReport, PartitionRow


def human_bytes(count: int | None) -> str:
    if count is None:
        return "-"
    value = float(count)
    for unit in ("B", "KB", "MB", "GB"):
        if value < 1000 or unit == "GB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    raise AssertionError("unreachable")


def human_flops(count: int) -> str:
    for unit, size in (("GFLOP", 1e9), ("MFLOP", 1e6), ("kFLOP", 1e3)):
        if count >= size:
            return f"{count / size:.1f} {unit}"
    return f"{count} FLOP"


def coverage_line(method: MethodReport) -> str:
    nodes, delegated = len(method.nodes), method.delegated_nodes
    share = f"{100 * delegated / nodes:.1f}%" if nodes else "-"
    line = f"method {method.method!r}: {delegated} of {nodes} computations delegated ({share})"
    if method.total_flops:
        line += f", {100 * method.delegated_flops / method.total_flops:.1f}% of {human_flops(method.total_flops)}"
    return line


def render_text(report: LoweringReport | Mapping[str, Any], *, reasons: int = 12) -> str:
    """Every method's coverage and partitions, and up to ``reasons`` lines of what was left, by op and reason;
    ``report`` is a ``LoweringReport`` or its JSON data (``Program.report``)."""
    from torchdelegate.lowering.report_data import as_report

    report = as_report(report)
    lines = [f"backends, in priority order: {', '.join(report.backends)}"]
    for method in report.methods.values():
        lines += ["", coverage_line(method)]
        if method.partitions:
            lines += _table(method.partitions)
            lines += [f"  {p.tag}: {delegate_info_text(p.delegate_info)}" for p in method.partitions if p.delegate_info]
        left = sorted(method.not_delegated().items(), key=lambda item: (-len(item[1]), item[0]))
        if left:
            lines.append("  not delegated:")
            for (op, why), names in left[:reasons]:
                shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
                lines.append(f"    {op} x{len(names)} ({shown}): {why}")
            if len(left) > reasons:
                lines.append(f"    ... and {len(left) - reasons} more kinds")
    return "\n".join(lines)


def delegate_info_text(info: Any) -> str:
    """A backend's ``delegate_info`` on one line: ``key: value`` pairs; within them, ``key value``, lists in
    parentheses (``fusions: MatMulNBits 84; unfused: GroupQueryAttention (2 layers: ...)``)."""
    if isinstance(info, dict):
        return "; ".join(f"{key}: {_value_text(value)}" for key, value in info.items())
    return _value_text(info)


def _value_text(value: Any) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{key} {_value_text(item)}" for key, item in value.items())
    if isinstance(value, list):
        return "(" + "; ".join(_value_text(item) for item in value) + ")"
    return str(value)


def _table(partitions: list[PartitionRow]) -> list[str]:
    cached = any(p.cache for p in partitions)  # a column only when the compile cache was on
    header = ("partition", "backend", "nodes", "FLOPs", "weights", "blob", "in", "out", *(("cache",) * cached), "ops")
    rows = [
        (
            p.tag,
            p.backend_id,
            str(p.nodes),
            human_flops(p.flops),
            human_bytes(p.weight_bytes),
            human_bytes(p.blob_bytes),
            str(len(p.inputs)),
            str(len(p.outputs)),
            *((p.cache or "-",) * cached),
            ", ".join(f"{op} {n}" for op, n in list(p.ops.items())[:4]) + (", ..." if len(p.ops) > 4 else ""),
        )
        for p in partitions
    ]
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header) - 1)]
    numeric = {2, 3, 4, 5, 6, 7}

    def line(row: tuple[str, ...]) -> str:
        cells = [
            cell.rjust(w) if i in numeric else cell.ljust(w)
            for i, (cell, w) in enumerate(zip(row[:-1], widths, strict=True))
        ]
        return "  " + "  ".join(cells) + "  " + row[-1]

    return [line(header)] + [line(row) for row in rows]
