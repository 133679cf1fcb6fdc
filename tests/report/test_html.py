"""The HTML report: one self-contained file that headless Chromium renders without a script error."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from backends_for_tests import TorchExportBackend
from models import TwoLinears, export

import torchdelegate as td
from torchdelegate import CapabilityPartitioner, DelegationSpec
from torchdelegate.report import plan_report, render_html

aten = torch.ops.aten
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--enable-logging=stderr",
    "--v=0",
]


def _chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        if os.environ.get("TORCHDELEGATE_REQUIRE_CHROMIUM"):
            pytest.fail("Chromium is required here (TORCHDELEGATE_REQUIRE_CHROMIUM) but is not installed")
        pytest.skip("Chromium is not installed (apt-get install chromium)")
    return found


def _page(tmp_path: Path) -> tuple[Path, int]:
    edge = td.to_edge(export(TwoLinears(), torch.randn(2, 4)))
    linear = {aten.permute.default, aten.addmm.default}
    partitioner = CapabilityPartitioner(
        [
            (linear, DelegationSpec(TorchExportBackend.backend_id)),
            ({aten.relu.default, aten.add.Tensor}, DelegationSpec("reference")),
        ]
    )
    report = plan_report(edge, partitioner)
    page = tmp_path / "report.html"
    page.write_text(render_html(report), encoding="utf-8")
    return page, len(report.methods["forward"].nodes)


def test_the_page_is_self_contained_and_colours_each_backend(tmp_path: Path) -> None:
    page, nodes = _page(tmp_path)
    text = page.read_text()
    assert not re.search(r"""(src|href)=["']?(https?:|//)""", text)  # nothing fetched
    assert text.count('<rect class="node"') == nodes
    assert (
        'fill="#1f77b4"' in text and 'fill="#2ca02c"' in text and 'fill="#c7c7c7"' in text
    )  # two backends, and sigmoid


def test_chromium_renders_the_page_and_its_script_runs(tmp_path: Path) -> None:
    chromium = _chromium()
    page, nodes = _page(tmp_path)
    profile = tmp_path / "profile"
    common = [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}"]
    dom = subprocess.run([*common, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert 'data-ready="1"' in dom.stdout  # the script ran to its end
    assert dom.stdout.count('class="node"') == nodes
    assert "Uncaught" not in dom.stderr, dom.stderr[-2000:]
    shot = tmp_path / "report.png"
    run = subprocess.run(
        [*common, "--window-size=1000,800", f"--screenshot={shot}", page.as_uri()], capture_output=True, timeout=120
    )
    assert run.returncode == 0 and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 5000


def test_a_hostile_saved_report_cannot_inject_markup_or_script(tmp_path: Path) -> None:
    """A report read from a file is the file author's text: every string is escaped, none ends the script data."""
    import json

    from torchdelegate.report import LoweringReport

    edge = td.to_edge(export(TwoLinears(), torch.randn(2, 4)))
    report = plan_report(edge, CapabilityPartitioner([({aten.addmm.default}, DelegationSpec("reference"))]))
    hostile = '</script><script>alert(1)</script><!--<script><img src=x onerror="alert(2)">'
    text = json.dumps(report.to_json())
    for name in ("relu", "sigmoid", "addmm"):
        text = text.replace(f'"{name}"', json.dumps(f"{name}{hostile}"))
    page = render_html(LoweringReport.from_json(json.loads(text)), title=hostile)
    assert hostile.replace('"', "&quot;") not in page and "alert(1)</script>" not in page
    assert "<img" not in page and "<!--" not in page
    assert page.count("<script") == 2  # the page's own data block and script
    assert page.count("alert(1)") >= 4  # the hostile text is there, as text: title, names, details


def test_a_saved_report_whose_fields_have_the_wrong_types_is_refused() -> None:
    """A number field holding markup would reach the page as it is: every field is checked against its type."""
    import json

    from torchdelegate.report import LoweringReport

    edge = td.to_edge(export(TwoLinears(), torch.randn(2, 4)))
    report = plan_report(edge, CapabilityPartitioner([({aten.addmm.default}, DelegationSpec("reference"))])).to_json()
    report["methods"][0]["partitions"][0]["nodes"] = "<img src=x onerror=alert(1)>"
    with pytest.raises(ValueError, match=r"malformed entry \(.<img src=x onerror=alert\(1\)>. is not"):
        LoweringReport.from_json(json.loads(json.dumps(report)))
