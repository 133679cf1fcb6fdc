"""The partition report as one self-contained HTML page: the graph coloured by backend, and tables.

The picture is an SVG drawn here, with no library and nothing fetched: each computation is a
box in a row by its depth (the longest path from the method's inputs), coloured by its
backend, grey when no backend took it; hovering shows its op, partition and reasons, and
clicking it shows them under the picture. Everything the page shows is in the file.
"""

from __future__ import annotations

import html
import json

from torchdelegate.report.data import LoweringReport, MethodReport
from torchdelegate.report.terminal import coverage_line, human_bytes, human_flops

PALETTE = ["#1f77b4", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2", "#bcbd22"]
LEFT_OUT = "#c7c7c7"
BOX_W, BOX_H, GAP_X, GAP_Y = 14, 10, 6, 18


def render_html(report: LoweringReport, *, title: str = "torchdelegate partition report") -> str:
    colours = {backend: PALETTE[i % len(PALETTE)] for i, backend in enumerate(report.backends)}
    legend = (
        "".join(f'<span class="key"><i style="background:{c}"></i>{html.escape(b)}</span>' for b, c in colours.items())
        + f'<span class="key"><i style="background:{LEFT_OUT}"></i>not delegated</span>'
    )
    sections = "".join(_method_section(method, colours) for method in report.methods.values())
    details = {
        method.method: {row.name: _describe(row.op, row.tag, row.backend_id, row.reasons) for row in method.nodes}
        for method in report.methods.values()
    }
    # A saved report comes from the file: no "<" reaches the page's script data ("</script>", "<!--").
    data = json.dumps(details, sort_keys=True).replace("<", "\\u003c").replace(">", "\\u003e")
    return _PAGE.format(
        title=html.escape(title),
        backends=html.escape(", ".join(report.backends)),
        legend=legend,
        sections=sections,
        data=data,
    )


def _describe(op: str, tag: str | None, backend: str | None, reasons: dict[str, str]) -> str:
    where = f"{tag} ({backend})" if tag else "not delegated"
    lines = [f"{op}: {where}"] + [f"{b}: {r}" for b, r in reasons.items()]
    return "\n".join(lines)


def _layout(method: MethodReport) -> dict[str, tuple[int, int]]:
    """Each computation's (row, column): row by longest path from the inputs, columns in graph order."""
    depth: dict[str, int] = {}
    for row in method.nodes:  # graph order is topological
        depth[row.name] = 1 + max((depth[s] for s in row.inputs if s in depth), default=0)
    columns: dict[int, int] = {}
    place = {name: (0, i) for i, name in enumerate(method.user_inputs)}
    for row in method.nodes:
        level = depth[row.name]
        place[row.name] = (level, columns.get(level, 0))
        columns[level] = columns.get(level, 0) + 1
    return place


def _method_section(method: MethodReport, colours: dict[str, str]) -> str:
    place = _layout(method)
    width = (max((c for _, c in place.values()), default=0) + 1) * (BOX_W + GAP_X) + GAP_X
    height = (max((r for r, _ in place.values()), default=0) + 1) * (BOX_H + GAP_Y) + GAP_Y

    def centre(name: str) -> tuple[float, float]:
        row, column = place[name]
        return GAP_X + column * (BOX_W + GAP_X) + BOX_W / 2, GAP_Y + row * (BOX_H + GAP_Y) + BOX_H / 2

    edges, boxes = [], []
    for row in method.nodes:
        x2, y2 = centre(row.name)
        for source in row.inputs:
            if source in place:
                x1, y1 = centre(source)
                edges.append(f'<line x1="{x1:.0f}" y1="{y1 + BOX_H / 2:.0f}" x2="{x2:.0f}" y2="{y2 - BOX_H / 2:.0f}"/>')
    for name in method.user_inputs:
        x, y = centre(name)
        boxes.append(
            f'<rect class="input" x="{x - BOX_W / 2:.0f}" y="{y - BOX_H / 2:.0f}" width="{BOX_W}" height="{BOX_H}">'
            f"<title>input {html.escape(name)}</title></rect>"
        )
    for row in method.nodes:
        x, y = centre(row.name)
        colour = colours.get(row.backend_id or "", LEFT_OUT)
        tip = html.escape(f"{row.name}\n{_describe(row.op, row.tag, row.backend_id, row.reasons)}")
        boxes.append(
            f'<rect class="node" data-method="{html.escape(method.method)}" data-node="{html.escape(row.name)}" '
            f'x="{x - BOX_W / 2:.0f}" y="{y - BOX_H / 2:.0f}" width="{BOX_W}" height="{BOX_H}" fill="{colour}">'
            f"<title>{tip}</title></rect>"
        )
    svg = (
        f'<svg class="graph" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}"><g class="edges">{"".join(edges)}</g>{"".join(boxes)}</svg>'
    )
    rows = "".join(
        "<tr>"
        f'<td><i style="background:{colours.get(p.backend_id, LEFT_OUT)}"></i>{html.escape(p.tag)}</td>'
        f"<td>{html.escape(p.backend_id)}</td><td>{html.escape(str(p.nodes))}</td><td>{human_flops(p.flops)}</td>"
        f"<td>{human_bytes(p.weight_bytes)}</td><td>{human_bytes(p.blob_bytes)}</td>"
        f"<td>{html.escape(', '.join(p.inputs))}</td><td>{html.escape(', '.join(p.outputs))}</td>"
        f"<td>{html.escape(', '.join(f'{op} {n}' for op, n in p.ops.items()))}</td>"
        f"<td>{html.escape(', '.join(f'{t} (through {v})' for t, v in p.kept_apart.items()))}</td></tr>"
        for p in method.partitions
    )
    left = "".join(
        f"<tr><td>{html.escape(op)}</td><td>{len(names)}</td><td>{html.escape(why)}</td>"
        f"<td>{html.escape(', '.join(names))}</td></tr>"
        for (op, why), names in sorted(method.not_delegated().items(), key=lambda item: (-len(item[1]), item[0]))
    )
    return (
        f'<section><h2>{html.escape(coverage_line(method))}</h2><div class="picture">{svg}</div>'
        f'<pre class="detail" id="detail-{html.escape(method.method)}">click a box for its details</pre>'
        "<table><tr><th>partition</th><th>backend</th><th>nodes</th><th>FLOPs</th><th>weights</th><th>blob</th>"
        f"<th>inputs</th><th>outputs</th><th>ops</th><th>kept apart from</th></tr>{rows}</table>"
        + (
            f"<h3>not delegated</h3><table><tr><th>op</th><th>count</th><th>why</th><th>nodes</th></tr>{left}</table>"
            if left
            else ""
        )
        + "</section>"
    )


_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>
body {{ font: 14px system-ui, sans-serif; margin: 1.5em; color: #222; }}
h2 {{ font-size: 1.05em; margin-top: 2em; }}
.key {{ margin-right: 1.2em; }}
i {{ display: inline-block; width: .9em; height: .9em; margin-right: .35em; vertical-align: -1px; }}
.picture {{ overflow: auto; max-height: 70vh; border: 1px solid #ddd; }}
.edges line {{ stroke: #999; stroke-opacity: .45; stroke-width: 1; }}
rect.node {{ stroke: #333; stroke-width: .5; cursor: pointer; }}
rect.node:hover {{ stroke-width: 2; }}
rect.input {{ fill: #fff; stroke: #333; }}
table {{ border-collapse: collapse; margin-top: .8em; }}
td, th {{ border: 1px solid #ddd; padding: 2px 6px; vertical-align: top; text-align: left; max-width: 40em; }}
pre.detail {{ background: #f6f6f6; padding: .5em; min-height: 2.5em; }}
</style></head>
<body>
<h1>{title}</h1>
<p>Backends in priority order: {backends}</p>
<p>{legend}</p>
{sections}
<script id="details" type="application/json">{data}</script>
<script>
"use strict";
const details = JSON.parse(document.getElementById("details").textContent);
for (const box of document.querySelectorAll("rect.node")) {{
  box.addEventListener("click", () => {{
    const method = box.dataset.method;
    const text = box.dataset.node + "\\n" + details[method][box.dataset.node];
    document.getElementById("detail-" + method).textContent = text;
  }});
}}
document.body.dataset.ready = "1";
</script>
</body></html>
"""
