"""Partition reports: what went where and why, as data, a terminal table and an HTML page.

Names are imported when first asked for: ``torchdelegate.report.terminal`` (what the command line
prints sizes with) does not import torch.
"""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torchdelegate.lowering.lowering_report import (
        LoweringReport,
        MethodReport,
        NodeRow,
        PartitionRow,
        lowering_report,
        method_report,
    )
    from torchdelegate.report.attribution import GraphNode, ProfiledUnit, attributed_profile, delegate_nodes
    from torchdelegate.report.html import render_html
    from torchdelegate.report.lowering import lower_with_report, plan_report
    from torchdelegate.report.terminal import render_text

_EXPORTS = {
    "GraphNode": "torchdelegate.report.attribution",
    "ProfiledUnit": "torchdelegate.report.attribution",
    "attributed_profile": "torchdelegate.report.attribution",
    "delegate_nodes": "torchdelegate.report.attribution",
    "LoweringReport": "torchdelegate.lowering.lowering_report",
    "MethodReport": "torchdelegate.lowering.lowering_report",
    "NodeRow": "torchdelegate.lowering.lowering_report",
    "PartitionRow": "torchdelegate.lowering.lowering_report",
    "lower_with_report": "torchdelegate.report.lowering",
    "lowering_report": "torchdelegate.lowering.lowering_report",
    "method_report": "torchdelegate.lowering.lowering_report",
    "plan_report": "torchdelegate.report.lowering",
    "render_html": "torchdelegate.report.html",
    "render_text": "torchdelegate.report.terminal",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'torchdelegate.report' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "GraphNode",
    "ProfiledUnit",
    "attributed_profile",
    "delegate_nodes",
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
