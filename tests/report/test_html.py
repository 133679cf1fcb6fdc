"""The HTML report: one self-contained file whose picture headless Chromium draws, opens, closes,
searches, pans and zooms without a script error, on a zoo model with three backends and on the
200M-parameter LLM's two methods."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from backends_for_tests import TorchExportBackend
from chromium import Chromium, require_chromium
from models import TwoLinears, export
from reports_to_draw import llm_200m, swin_three_backends

import torchdelegate as td
from torchdelegate import CapabilityPartitioner, DelegationSpec
from torchdelegate.report import LoweringReport, plan_report, render_html

aten = torch.ops.aten
LEFT_OUT_FOR_THE_PICTURE = {aten.index.Tensor, aten.any.dim}


def _embedded(page: str) -> dict[str, Any]:
    found = re.search(r'<script id="report-data" type="application/json">(.*?)</script>', page, re.S)
    assert found is not None
    return json.loads(found.group(1))


@pytest.fixture(scope="module")
def swin_report() -> LoweringReport:
    return swin_three_backends()


def _write(report: LoweringReport, path: Path, title: str) -> Path:
    path.write_text(render_html(report, title=title), encoding="utf-8")
    return path


def test_the_page_is_self_contained_and_carries_every_computation_grouped_by_module(
    swin_report: LoweringReport, tmp_path: Path
) -> None:
    page = render_html(swin_report)
    assert not re.search(r"""(src|href)=["']?(https?:|//)|@import|url\(""", page)  # nothing fetched
    data = _embedded(page)
    assert data["backends"] == ["onnxruntime", "reference", "inductor"]
    [method] = data["methods"]
    rows = swin_report.methods["forward"].nodes
    computations = [n for n in method["nodes"] if n[6] == 0]
    assert [n[0] for n in computations] == [row.name for row in rows]
    modules = [m[0] for m in method["modules"]]
    for node, row in zip(computations, rows, strict=True):
        assert (modules[node[2]] if node[2] >= 0 else None) == (row.modules[-1] if row.modules else None)
    assert {"model.encoder.layers.0", "model.embeddings.patch_embeddings.projection"} <= set(modules)
    labels = {m[0]: m[1] for m in method["modules"]}
    assert labels["model.encoder.layers.0"] == "layers.0" and labels["model.embeddings"] == "embeddings"


def _shown(browser: Chromium, section: int) -> dict[str, Any]:
    return browser.evaluate(
        f"""(() => {{
          const s = document.getElementById("method-{section}");
          return {{
            nodes: [...s.querySelectorAll("g.node")].map(e => e.dataset.node),
            groups: [...s.querySelectorAll("g.group")].map(e => e.dataset.module),
            frames: [...s.querySelectorAll("g.frame")].map(e => e.dataset.module),
            transform: s.querySelector(".picture svg").style.transform,
            detail: s.querySelector("pre.detail").textContent,
          }};
        }})()"""
    )


def _centre(browser: Chromium, selector: str) -> tuple[float, float]:
    box = browser.evaluate(
        f"(() => {{ const r = document.querySelector({json.dumps(selector)}).getBoundingClientRect();"
        " return [r.x + r.width / 2, r.y + r.height / 2]; })()"
    )
    return box[0], box[1]


def _button(browser: Chromium, section: int, action: str) -> None:
    browser.evaluate(f'document.querySelector("#method-{section} button[data-action={action}]").scrollIntoView()')
    browser.click(*_centre(browser, f"#method-{section} button[data-action={action}]"))


def _check_page(browser: Chromium, report: LoweringReport, layer: str, wanted: str, shots: Path) -> None:
    """Every node drawn once all is open; closing ``layer`` hides its nodes; finding ``wanted`` by name
    opens its layers and marks it; the wheel moves the picture; a screenshot is not blank."""
    for k, method in enumerate(report.methods.values()):
        every = {row.name for row in method.nodes} | set(method.user_inputs)
        first = _shown(browser, k)
        assert first["nodes"] or first["groups"]
        _button(browser, k, "open")
        shown = _shown(browser, k)
        assert every <= set(shown["nodes"]) and not shown["groups"], method.method
        inside = {row.name for row in method.nodes if layer in row.modules}
        assert inside and layer in shown["frames"]
        title = f'#method-{k} text.title[data-module="{layer}"]'
        browser.evaluate(f"document.querySelector('#method-{k} .picture').scrollIntoView()")
        view = f"window.torchdelegateReport[{json.dumps(method.method)}]"
        browser.evaluate(f"{view}.centre(document.querySelector({json.dumps(title)}))")  # as a user pans to it
        browser.click(*_centre(browser, title))
        closed = _shown(browser, k)
        assert not inside & set(closed["nodes"]) and layer in closed["groups"], method.method
        assert every - inside <= set(closed["nodes"])
        _button(browser, k, "close")
        search = f"#method-{k} input.search"
        browser.evaluate(f"document.querySelector({json.dumps(search)}).scrollIntoView()")
        browser.click(*_centre(browser, search))
        browser.type_text(wanted)
        browser.press("Enter")
        found = browser.evaluate(f"[...document.querySelectorAll('#method-{k} g.node.found')].map(e => e.dataset.node)")
        assert found == [wanted], method.method
        assert _shown(browser, k)["detail"].startswith(wanted + "\n")
        before = _shown(browser, k)["transform"]
        browser.evaluate(f"document.querySelector('#method-{k} .picture').scrollIntoView()")
        x, y = _centre(browser, f"#method-{k} .picture")
        browser.mouse("mouseWheel", x, y, deltaX=0, deltaY=300)
        browser.mouse("mouseWheel", x, y, deltaX=0, deltaY=-200, modifiers=2)  # ctrl: zoom
        browser.evaluate("new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)))")
        assert _shown(browser, k)["transform"] != before
        _assert_not_blank(browser.screenshot(shots / f"{method.method}.png"))
    assert browser.errors == []


def _assert_not_blank(png: Path) -> None:
    from PIL import Image

    with Image.open(png) as image:
        data = image.convert("RGB").resize((200, 150)).tobytes()
        pixels = [data[i : i + 3] for i in range(0, len(data), 3)]
        colours = set(pixels)
        drawn = sum(1 for p in pixels if p != b"\xff\xff\xff") / len(pixels)
    assert len(colours) > 20 and drawn > 0.05, (len(colours), drawn)


def test_chromium_draws_a_zoo_model_with_three_backends(swin_report: LoweringReport, tmp_path: Path) -> None:
    require_chromium()
    page = _write(swin_report, tmp_path / "swin.html", "Swin, three backends")
    method = swin_report.methods["forward"]
    wanted = next(row.name for row in method.nodes if "model.encoder.layers.1" in row.modules)
    with Chromium() as browser:
        browser.open(page)
        first = _shown(browser, 0)
        colours = browser.evaluate(
            "[...new Set([...document.querySelectorAll('g.region rect[stroke]')].map(e => e.getAttribute('stroke')))]"
        )
        assert len(colours) == 3  # each backend's partitions outlined in its colour
        assert first["groups"] and len(first["nodes"]) < len(method.nodes)  # the deepest calls start closed
        _check_page(browser, swin_report, "model.encoder.layers.0.blocks.0", wanted, tmp_path)


@pytest.mark.timeout(600)
def test_chromium_draws_the_200m_llm_both_methods(tmp_path: Path) -> None:
    require_chromium()
    report = llm_200m()
    assert {m: len(r.nodes) > 1000 for m, r in report.methods.items()} == {"prefill": True, "decode": True}
    page = _write(report, tmp_path / "llm.html", "200M Llama")
    decode = report.methods["decode"]
    wanted = next(row.name for row in reversed(decode.nodes) if "model.model.layers.11.mlp" in row.modules)
    assert any(row.name == wanted for row in report.methods["prefill"].nodes)
    with Chromium() as browser:
        browser.open(page)
        for k in range(2):
            first = _shown(browser, k)
            assert (
                "model.model.layers.0.self_attn" in first["groups"] and len(first["nodes"]) < 200
            )  # deep calls closed
        _check_page(browser, report, "model.model.layers.3", wanted, tmp_path)


def test_a_hostile_saved_report_cannot_inject_markup_or_script() -> None:
    """A report read from a file is the file author's text: every string is escaped, none ends the script data."""
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
    names = [node[0] for node in _embedded(page)["methods"][0]["nodes"]]
    assert f"relu{hostile}" in names  # it reaches the picture as data, which the script draws escaped


def test_chromium_draws_hostile_names_as_text(tmp_path: Path) -> None:
    require_chromium()
    edge = td.to_edge(export(TwoLinears(), torch.randn(2, 4)))
    report = plan_report(
        edge, CapabilityPartitioner([({aten.addmm.default}, DelegationSpec(TorchExportBackend.backend_id))])
    )
    text = json.dumps(report.to_json()).replace('"relu"', json.dumps('relu<img src=x onerror="window.hit=1">'))
    page = _write(LoweringReport.from_json(json.loads(text)), tmp_path / "hostile.html", "hostile")
    with Chromium() as browser:
        browser.open(page)
        _button(browser, 0, "open")
        assert browser.evaluate("document.querySelectorAll('img').length") == 0
        assert browser.evaluate("window.hit === undefined")
        assert 'relu<img src=x onerror="window.hit=1">' in _shown(browser, 0)["nodes"]
        assert browser.errors == []


def test_a_saved_report_whose_fields_have_the_wrong_types_is_refused() -> None:
    """A number field holding markup would reach the page as it is: every field is checked against its type."""
    edge = td.to_edge(export(TwoLinears(), torch.randn(2, 4)))
    report = plan_report(edge, CapabilityPartitioner([({aten.addmm.default}, DelegationSpec("reference"))])).to_json()
    report["methods"][0]["partitions"][0]["nodes"] = "<img src=x onerror=alert(1)>"
    with pytest.raises(ValueError, match=r"malformed entry \(.<img src=x onerror=alert\(1\)>. is not"):
        LoweringReport.from_json(json.loads(json.dumps(report)))
