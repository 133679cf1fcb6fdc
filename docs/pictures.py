"""The pictures in the README and docs/BACKENDS.md, taken by headless Chromium from real reports.

    .venv/bin/python docs/pictures.py        # writes docs/images/*.png (about a minute)

- report-swin.png: a transformers Swin planned for three backends, as ``torchdelegate lower --html``
  draws it (the report of tests/reports_to_draw.py, the one the HTML tests open).
- report-llm.png: the 200M-parameter Llama of benchmarks/llm.py, decode, as it first opens: its decoder
  layers open, their attention and MLP closed.
- model-explorer.png: the Swin's report in Google's Model Explorer (``inspect --model-explorer --open``),
  with both overlays: each node's backend and partition.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "benchmarks")]

from chromium import Chromium  # noqa: E402
from reports_to_draw import llm_200m, swin_three_backends  # noqa: E402

from torchdelegate.report import render_html  # noqa: E402
from torchdelegate.report.model_explorer import write_model_explorer  # noqa: E402

IMAGES = ROOT / "docs" / "images"


def html_pictures(work: Path) -> None:
    swin = work / "swin.html"
    swin.write_text(render_html(swin_three_backends(), title="Swin, three backends"), encoding="utf-8")
    llm = work / "llm.html"
    llm.write_text(render_html(llm_200m(), title="200M Llama"), encoding="utf-8")
    with Chromium(width=1280, height=1000) as browser:
        browser.open(swin)
        browser.evaluate("window.torchdelegateReport.forward.zoom(0.62, 620, 0)")
        browser.evaluate("new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)))")
        browser.screenshot(IMAGES / "report-swin.png", "#method-0 .picture")
        browser.open(llm)
        frame = '#method-1 g.frame[data-module="model.model.layers.1"]'
        browser.evaluate(f"window.torchdelegateReport.decode.centre(document.querySelector('{frame}'))")
        browser.evaluate("window.torchdelegateReport.decode.zoom(0.7, 620, 200)")
        browser.evaluate("new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)))")
        browser.screenshot(IMAGES / "report-llm.png", "#method-1 .picture")
        assert browser.errors == [], browser.errors


def model_explorer_picture(work: Path) -> None:
    files = write_model_explorer(swin_three_backends(), work / "me", "swin")
    serve = (
        "import sys; from pathlib import Path; from torchdelegate.cli.explorer_server import serve_model_explorer;"
        "from torchdelegate.report.model_explorer import ModelExplorerFiles;"
        f"serve_model_explorer(ModelExplorerFiles(Path({str(files.graphs)!r}), Path({str(files.backends)!r}), "
        f"Path({str(files.partitions)!r})), None, sys.stdout)"
    )
    server = subprocess.Popen(
        [sys.executable, "-c", serve], stdout=subprocess.PIPE, text=True, env={**os.environ, "BROWSER": "true"}
    )
    try:
        assert server.stdout is not None
        url = ""
        while not url:
            line = server.stdout.readline()
            assert line, "Model Explorer did not start"
            url = line.strip() if line.startswith("http://127.0.0.1") else ""
        with Chromium(width=1400, height=820, webgl=True) as browser:
            browser.open(url, ready="document.body.innerText.includes('inductor_0')")
            browser.click(432, 422)  # the model layer's open icon: its embeddings, encoder and norm
            time.sleep(3)
            browser.screenshot(IMAGES / "model-explorer.png")
    finally:
        server.terminate()
        server.wait(timeout=30)


if __name__ == "__main__":
    IMAGES.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as directory:
        html_pictures(Path(directory))
        model_explorer_picture(Path(directory))
    for png in sorted(IMAGES.glob("*.png")):
        print(f"{png.relative_to(ROOT)}: {png.stat().st_size // 1024} KB")
