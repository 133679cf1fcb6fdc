"""The partition report as one self-contained HTML page: each method's graph, by layer, and tables.

The picture groups the computations by the module calls export recorded (``nn_module_stack``),
so a transformer reads as its embedding, its layers and its head; layers open and close, and
those beyond what fits a first look start closed. Each box is an op, filled in its backend's
colour (grey when no backend took it); each partition's boxes sit on one outlined area; edges
that cross from one partition to another are dashed. The page pans, zooms and finds a node by
name, op or module; hovering or clicking a box shows its partition and each backend's reason.
The drawing is done in the browser by ``page.js`` from the data embedded in the page: one file,
nothing fetched.
"""

from __future__ import annotations

import html
import json
from collections.abc import Mapping
from importlib.resources import files
from typing import Any

from torchdelegate.lowering.report_data import LoweringReport, MethodReport, as_report
from torchdelegate.partition.modules import call_label
from torchdelegate.report.terminal import coverage_line, delegate_info_text, human_bytes, human_flops

PALETTE = ["#1f77b4", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2", "#bcbd22"]
LEFT_OUT = "#9a9a9a"
COMPUTATION, INPUT, OUTPUT = 0, 1, 2
OUTPUTS = "(outputs)"  # the picture's box for what the method returns


def colours_of(names: list[str]) -> dict[str, str]:
    """A colour for each of ``names`` (backends in priority order, a method's partitions), in order."""
    return {name: PALETTE[i % len(PALETTE)] for i, name in enumerate(names)}


def render_html(report: LoweringReport | Mapping[str, Any], *, title: str = "torchdelegate partition report") -> str:
    """The report as one self-contained page; ``report`` is a ``LoweringReport`` or its JSON data
    (``Program.report``)."""
    report = as_report(report)
    colours = colours_of(report.backends)
    legend = (
        "".join(
            f'<span class="key"><i class="swatch" style="background:{c}"></i>{html.escape(b)}</span>'
            for b, c in colours.items()
        )
        + f'<span class="key"><i class="swatch" style="background:{_tint(LEFT_OUT)}"></i>not delegated</span>'
    )
    methods = list(report.methods.values())
    data = {
        "backends": report.backends,
        "colours": list(colours.values()),
        "tints": [_tint(c) for c in colours.values()],
        "leftOut": LEFT_OUT,
        "leftOutTint": _tint(LEFT_OUT),
        "methods": [picture_data(method, report.backends) for method in methods],
    }
    # A saved report comes from the file: no "<" reaches the page's script data ("</script>", "<!--").
    text = json.dumps(data, separators=(",", ":")).replace("<", "\\u003c").replace(">", "\\u003e")
    page = files("torchdelegate.report")
    return _PAGE.format(
        title=html.escape(title),
        backends=html.escape(", ".join(report.backends)),
        legend=legend,
        sections="".join(_method_section(k, method, colours) for k, method in enumerate(methods)),
        data=text,
        style=page.joinpath("page.css").read_text(encoding="utf-8"),
        script=page.joinpath("page.js").read_text(encoding="utf-8"),
    )


def _tint(colour: str) -> str:
    """``colour`` three quarters of the way to white: a box's fill, its border keeping the colour."""
    red, green, blue = (int(colour[i : i + 2], 16) for i in (1, 3, 5))
    return "#" + "".join(f"{round(c + (255 - c) * 0.72):02x}" for c in (red, green, blue))


def picture_data(method: MethodReport, backends: list[str]) -> dict[str, Any]:
    """What ``page.js`` draws for one method: module calls as a tree, nodes by index, partitions by backend."""
    callers = method.module_callers()
    modules = {call: k for k, call in enumerate(callers)}
    module_rows = [
        [call, call_label(call, caller or ""), method.module_types.get(call, ""), modules.get(caller or "", -1)]
        for call, caller in callers.items()
    ]
    partitions = {p.tag: k for k, p in enumerate(method.partitions)}
    backend_index = {b: k for k, b in enumerate(backends)}
    index = {name: k for k, name in enumerate(method.user_inputs)}
    nodes: list[list[Any]] = [[name, "input", -1, -1, [], {}, INPUT, 0] for name in method.user_inputs]
    for row in method.nodes:
        index[row.name] = len(nodes)
        nodes.append(
            [
                row.name,
                row.op,
                modules[row.modules[-1]] if row.modules else -1,
                partitions.get(row.tag, -1) if row.tag is not None else -1,
                [index[name] for name in row.inputs if name in index],
                row.reasons,
                COMPUTATION,
                row.flops,
            ]
        )
    returned = [index[name] for name in method.user_outputs if name in index]
    nodes.append([OUTPUTS, "output", -1, -1, returned, {}, OUTPUT, 0])
    return {
        "method": method.method,
        "modules": module_rows,
        "partitions": [[p.tag, backend_index.get(p.backend_id, 0)] for p in method.partitions],
        "nodes": nodes,
    }


def _method_section(k: int, method: MethodReport, colours: dict[str, str]) -> str:
    rows = "".join(
        "<tr>"
        f'<td><i class="swatch" style="background:{colours.get(p.backend_id, LEFT_OUT)}"></i>'
        f"{html.escape(p.tag)}</td>"
        f"<td>{html.escape(p.backend_id)}</td><td>{html.escape(str(p.nodes))}</td><td>{human_flops(p.flops)}</td>"
        f"<td>{human_bytes(p.weight_bytes)}</td><td>{human_bytes(p.blob_bytes)}</td>"
        f"<td>{html.escape(', '.join(p.inputs))}</td><td>{html.escape(', '.join(p.outputs))}</td>"
        f"<td>{html.escape(', '.join(f'{op} {n}' for op, n in p.ops.items()))}</td>"
        f"<td>{html.escape(', '.join(f'{t} (through {v})' for t, v in p.kept_apart.items()))}</td>"
        f"<td>{html.escape(delegate_info_text(p.delegate_info)) if p.delegate_info else ''}</td></tr>"
        for p in method.partitions
    )
    left = "".join(
        f"<tr><td>{html.escape(op)}</td><td>{len(names)}</td><td>{html.escape(why)}</td>"
        f"<td>{html.escape(', '.join(names))}</td></tr>"
        for (op, why), names in sorted(method.not_delegated().items(), key=lambda item: (-len(item[1]), item[0]))
    )
    return (
        f'<section id="method-{k}"><h2>{html.escape(coverage_line(method))}</h2>{_TOOLBAR}'
        '<div class="picture"><div class="tip"></div></div>'
        '<pre class="detail">click a box for its details</pre>'
        "<table><tr><th>partition</th><th>backend</th><th>nodes</th><th>FLOPs</th><th>weights</th><th>blob</th>"
        f"<th>inputs</th><th>outputs</th><th>ops</th><th>kept apart from</th><th>notes</th></tr>{rows}</table>"
        + (
            f"<h3>not delegated</h3><table><tr><th>op</th><th>count</th><th>why</th><th>nodes</th></tr>{left}</table>"
            if left
            else ""
        )
        + "</section>"
    )


_TOOLBAR = (
    '<div class="toolbar"><input class="search" type="search" placeholder="find a node, op or module" '
    'aria-label="find a node, op or module"><span class="found-count"></span>'
    '<button data-action="fit">fit</button><button data-action="in">+</button><button data-action="out">−</button>'
    '<button data-action="open">open all</button><button data-action="close">close all</button>'
    '<span class="hint">drag or wheel to move, ctrl+wheel to zoom; click a layer to open or close it, '
    "a box for its details and its partition</span></div>"
)

_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>
{style}</style></head>
<body>
<h1>{title}</h1>
<p>Backends in priority order: {backends}</p>
<p>{legend}</p>
{sections}
<script id="report-data" type="application/json">{data}</script>
<script>
{script}</script>
</body></html>
"""
