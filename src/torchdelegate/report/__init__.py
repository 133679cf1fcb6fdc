"""Partition reports: what went where and why, as data, a terminal table and an HTML page."""

from torchdelegate.lowering.lowering_report import (
    LoweringReport,
    MethodReport,
    NodeRow,
    PartitionRow,
    lowering_report,
    method_report,
)
from torchdelegate.report.html import render_html
from torchdelegate.report.lowering import lower_with_report, plan_report
from torchdelegate.report.terminal import render_text

__all__ = [
    "LoweringReport",
    "MethodReport",
    "NodeRow",
    "PartitionRow",
    "lower_with_report",
    "lowering_report",
    "method_report",
    "plan_report",
    "render_html",
    "render_text",
]
