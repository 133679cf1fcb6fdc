"""How the partition report's HTML page behaves on the 200M-parameter LLM: does it open in a second
and move smoothly?

The report is benchmarks/llm.py's Llama (prefill and decode, 2,800 computations) planned for ONNX
Runtime then the reference backend; the page is what ``torchdelegate lower --html`` writes. Each
round opens the page in a fresh headless Chromium (software drawing, no GPU) and measures:

- open: from navigation to the page's script having drawn both methods (ready to use);
- the script's own share of that (parsing the data, laying out, drawing);
- open all: laying out and drawing every computation of a method;
- frames while moving: 120 animation frames, the picture panned every frame, then 120 zoomed, first
  as it opens and then with every computation drawn: the median and the 95th percentile frame time
  (16.7 ms is 60 frames a second).

    .venv/bin/python benchmarks/report_page.py --rounds 5
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent / "tests"), str(HERE)]

FRAMES = 120
_MOVE = """new Promise(done => {{
  const view = window.torchdelegateReport[{method!r}];
  const times = [];
  let last = performance.now(), frames = 0;
  const step = now => {{
    times.push(now - last); last = now;
    if ({zoom}) view.view.k *= frames % 60 < 30 ? 1.01 : 1 / 1.01;
    else {{ view.view.y -= 6; view.view.x += frames % 40 < 20 ? 3 : -3; }}
    view.applyView();
    if (++frames < {frames}) requestAnimationFrame(step); else done(times.slice(2));
  }};
  requestAnimationFrame(step);
}})"""


def measure_round(page: Path, methods: list[str]) -> dict[str, Any]:
    from chromium import Chromium

    with Chromium(width=1400, height=1000) as browser:
        opened = browser.open(page)
        found: dict[str, Any] = {
            "open_ms": opened * 1000,
            "script_ms": float(browser.evaluate("document.body.dataset.openMs")),
        }
        for k, method in enumerate(methods):
            browser.evaluate(f"document.querySelector('#method-{k} .picture').scrollIntoView()")
            found[f"{method} drawn at first"] = browser.evaluate(
                f"document.querySelectorAll('#method-{k} g.node, #method-{k} g.group').length"
            )
            found.update(_frames(browser, method, "first view"))
            browser.evaluate(f"document.querySelector('#method-{k} button[data-action=open]').click()")
            found[f"{method} open all ms"] = float(
                browser.evaluate(f"document.getElementById('method-{k}').dataset.renderMs")
            )
            found[f"{method} drawn when all open"] = browser.evaluate(
                f"document.querySelectorAll('#method-{k} g.node').length"
            )
            found[f"{method} scale when all open"] = browser.evaluate(f"window.torchdelegateReport[{method!r}].view.k")
            found.update(_frames(browser, method, "all open"))
        assert browser.errors == [], browser.errors
    return found


def _frames(browser: Any, method: str, when: str) -> dict[str, float]:
    found = {}
    for motion, zoom in (("panning", "false"), ("zooming", "true")):
        times = sorted(browser.evaluate(_MOVE.format(method=method, frames=FRAMES, zoom=zoom)))
        found[f"{method} {motion}, frame ms, median ({when})"] = statistics.median(times)
        found[f"{method} {motion}, frame ms, 95th percentile ({when})"] = times[int(0.95 * len(times))]
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--results", type=Path, default=HERE / "results")
    args = parser.parse_args()
    from reports_to_draw import llm_200m

    from torchdelegate.report import render_html

    report = llm_200m()
    methods = list(report.methods)
    with tempfile.TemporaryDirectory() as directory:
        page = Path(directory) / "llm.html"
        page.write_text(render_html(report, title="200M Llama"), encoding="utf-8")
        size = page.stat().st_size
        rounds = [measure_round(page, methods) for _ in range(args.rounds)]
    import torch

    lines = [
        f"# The report page on the 200M LLM, {datetime.date.today().isoformat()}",
        "",
        f"`python benchmarks/report_page.py --rounds {args.rounds}`.",
        "",
        (__doc__ or "").split("\n\n", 1)[1].rsplit("\n\n", 1)[0],
        "",
        f"Machine: {_cpu()}, {len(os.sched_getaffinity(0))} cores; "
        f"Python {platform.python_version()}, torch {torch.__version__}; {_chromium_version()} headless, no GPU.",
        "",
        f"Page: {size / 2**20:.2f} MB, {sum(len(m.nodes) for m in report.methods.values())} computations in "
        f"{len(methods)} methods. Medians of {args.rounds} rounds, each in a fresh browser [min–max].",
        "",
        "| figure | value |",
        "|---|---|",
    ]
    for key in rounds[0]:
        values = [r[key] for r in rounds]
        low, middle, high = min(values), statistics.median(values), max(values)
        lines.append(f"| {key} | {middle:.1f} [{low:.1f}–{high:.1f}] |")
    text = "\n".join(lines) + "\n"
    print(text)
    stem = f"{datetime.date.today().isoformat()}-report-page"
    (args.results / f"{stem}.md").write_text(text)
    print(f"written: {args.results / stem}.md")


def _cpu() -> str:
    with open("/proc/cpuinfo") as info:
        return next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), "?")


def _chromium_version() -> str:
    import subprocess

    from chromium import chromium_path

    path = chromium_path()
    if path is None:
        return "no Chromium"
    return subprocess.run([path, "--version"], capture_output=True, text=True).stdout.strip()


if __name__ == "__main__":
    main()
