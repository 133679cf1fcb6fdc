"""The package's folders are its layers, in the order docs/ARCHITECTURE.md gives: every import of a
module of the package, lazy ones inside functions included, points to its own layer or one below."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "torchdelegate"


def _layers() -> list[str]:
    """The order of layers ARCHITECTURE states, bottom first."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    match = re.search(r"Layers, bottom to top: ([^.]+)\.", text.replace("\n", " "))
    assert match, "docs/ARCHITECTURE.md states no 'Layers, bottom to top: ...' line"
    return [name.strip().strip("`") for name in match.group(1).split(",")]


def _layer_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _imports() -> list[tuple[str, int, str]]:
    """(file, line, module imported) for every import of the package's own modules."""
    found = []
    for file in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(file.read_text(), str(file))):
            names = []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            relative = str(file.relative_to(PACKAGE))
            found += [(relative, node.lineno, name) for name in names if name.split(".")[0] == "torchdelegate"]
    return found


def _own_layer(relative: str) -> str:
    return relative.split("/")[0].removesuffix(".py")


def test_the_root_holds_only_the_public_api_the_errors_and_the_version() -> None:
    modules = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert modules == ["__init__.py", "__main__.py", "errors.py", "version.py"]


def test_every_folder_is_a_layer_architecture_places() -> None:
    layers = _layers()
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    assert folders <= set(layers), f"folders ARCHITECTURE's order leaves out: {sorted(folders - set(layers))}"
    assert len(layers) == len(set(layers))


def test_imports_only_point_down() -> None:
    order = {name: rank for rank, name in enumerate(_layers())}
    upward = []
    for relative, line, module in _imports():
        mine, theirs = order[_own_layer(relative)], order[_layer_of(module)]
        if theirs > mine:
            upward.append(f"{relative}:{line} imports {module} ({_layer_of(module)} is above {_own_layer(relative)})")
    assert not upward, "\n".join(upward)


@pytest.mark.parametrize("old", ["torchdelegate.backend", "torchdelegate.machine_cache", "torchdelegate.compile.cache"])
def test_a_moved_module_is_found_by_its_old_name_with_a_warning(old: str) -> None:
    import importlib
    import sys

    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match="moved to torchdelegate"):
        module = importlib.import_module(old)
    assert module.__name__ != old and sys.modules[old] is sys.modules[module.__name__]
