"""The documentation as readers meet it: every example in README and docs runs and prints what the
page shows, and the site builds clean (warnings are errors, every cross-reference resolves), has a
reference page per public name, and opens in headless Chromium without a console error."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from chromium import Chromium, require_chromium
from documented_examples import DATA, EXECUTED, console_steps, masked, page_blocks
from loopback import free_port

import torchdelegate

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
WITH_EXAMPLES = [page for page in PAGES if any(b.language in EXECUTED for b in page_blocks(page.read_text()))]


def test_every_block_is_an_example_that_runs_or_data() -> None:
    """A block in a language the runner does not run would be an example no test runs."""
    unknown = [
        f"{page.relative_to(ROOT)}:{block.line} ```{block.language}"
        for page in PAGES
        for block in page_blocks(page.read_text())
        if block.language not in EXECUTED + DATA and not block.language.startswith("{")
    ]
    assert not unknown, f"blocks neither run nor data: {unknown}"
    indented = [
        f"{page.relative_to(ROOT)}:{number}"
        for page in PAGES
        for number, line in enumerate(page.read_text().splitlines(), 1)
        if line.lstrip().startswith(("```", "~~~")) and not line.startswith("```")
    ]
    assert not indented, f"fences the runner does not read (indented, or ~~~): {indented}"
    assert len(WITH_EXAMPLES) >= 5


@pytest.mark.timeout(900)
@pytest.mark.parametrize("page", WITH_EXAMPLES, ids=lambda page: page.name)
def test_the_examples_of_a_page_run_and_print_what_it_shows(page: Path, tmp_path: Path) -> None:
    """The page's blocks in order, in a process of their own and an empty directory, with the
    installed command first on PATH: none fails, and each output the page shows is printed."""
    environment = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "TORCHDELEGATE_CACHE": str(tmp_path / "cache"),  # a reader's first run: every partition compiled
        "PORT": str(free_port()),  # a server an example starts listens here (its default: 8000)
        "PYTHONPATH": str(ROOT / "examples"),
        "TORCHDELEGATE_CLONE": str(ROOT),
        "PYTHONUNBUFFERED": "1",  # stdout and stderr interleaved as a terminal shows them
    }
    runner = Path(__file__).parent / "documented_examples.py"
    done = subprocess.run(
        [sys.executable, str(runner), str(page)], capture_output=True, text=True, cwd=tmp_path, env=environment,
        timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    results = json.loads(done.stdout.strip().splitlines()[-1])
    for result in results:
        block = result["block"]
        where = f"{page.relative_to(ROOT)}:{block['line']}"
        assert "error" not in result, f"{where} failed:\n{result['error']}"
        if block["language"] == "console":
            for (command, shown), printed in zip(console_steps(block["code"]), result["printed"], strict=True):
                assert masked(printed) == masked(shown), f"{where}: $ {command}\n{printed}"
        elif block["shown"] is not None:
            assert masked(result["printed"]) == masked(block["shown"]), f"{where}:\n{result['printed']}"


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("sphinx")
    built = tmp_path_factory.mktemp("site")
    done = subprocess.run(
        [sys.executable, "-m", "sphinx", "-b", "html", "-W", "--keep-going", "-n", "-q", str(ROOT / "docs"),
         str(built)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return built


@pytest.mark.xdist_group("documentation_site")  # one worker builds the site once for both
def test_the_site_builds_clean_with_a_reference_page_per_public_name(site: Path) -> None:
    pages = {path.stem for path in (site / "reference").glob("torchdelegate.*.html")}
    assert {f"torchdelegate.{name}" for name in torchdelegate.__all__} <= pages
    assert len([p for p in pages if p.count(".") == 1]) == len(torchdelegate.__all__)
    index = (site / "reference" / "index.html").read_text()
    assert "torchdelegate.to_edge_transform_and_lower" in index


@pytest.mark.xdist_group("documentation_site")
def test_the_site_opens_in_chromium_without_a_console_error(site: Path) -> None:
    require_chromium()
    pages = sorted(site.glob("*.html")) + [site / "reference" / "torchdelegate.Program.html"]
    with Chromium() as browser:
        for page in pages:
            browser.open(page, ready="document.readyState === 'complete'")
            assert browser.evaluate("document.querySelectorAll('main h1').length") == 1, page.name
        assert browser.errors == []
