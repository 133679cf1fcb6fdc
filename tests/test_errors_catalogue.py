"""docs/ERRORS.md catalogues every error the package raises, each with a test that triggers it.

Checked here: every error class (and every built-in type our code raises directly) has its
place in the catalogue; every row names an existing test; and that test's own source
mentions the error class or quotes the message (16 characters of it or more).
"""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import torchdelegate.errors as errors
from torchdelegate.errors import TorchDelegateError

ROOT = Path(__file__).resolve().parent.parent
CATALOGUE = ROOT / "docs" / "ERRORS.md"
ARGUMENT_ERRORS = "Argument errors (built-in exception types)"
# Raised and caught inside the package (turned into a catalogued error), or an internal invariant.
INTERNAL = {
    "ChangedDataError",
    "AssertionError",
    "CombineError",
    "Refused",
    "FusionError",
    "EntryError",
    "WorkerError",
    "Unkeyable",
    "JsonLimitError",
    "NeedsTorch",
    "ModelProtoError",
}


def _sections() -> dict[str, list[list[str]]]:
    """Section heading -> its table rows (cells stripped); header and rule rows left out."""
    sections: dict[str, list[list[str]]] = {}
    current = None
    for line in CATALOGUE.read_text().splitlines():
        if line.startswith("## "):
            current = sections.setdefault(line[3:].strip(), [])
        elif current is not None and line.startswith("|") and not set(line) <= set("|-: "):
            cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
            if cells[0] != "when":
                current.append(cells)
    return sections


def _raised_in_source() -> set[str]:
    """Names of the exception classes a ``raise`` in src/torchdelegate constructs (a function that
    makes one, such as ``model_not_found(...)``, is not a type: the class it makes is raised where
    it is made)."""
    names = set()
    for path in (ROOT / "src" / "torchdelegate").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and isinstance(node.exc.func, ast.Name):
                if node.exc.func.id[:1].isupper():
                    names.add(node.exc.func.id)
    return names


def _test_source(reference: str) -> str:
    """The test's source, and that of the module's own helpers it calls (``_refused(...)``, ``check_fails(...)``)."""
    path, name = reference.strip("`").split("::")
    text = (ROOT / path).read_text()
    functions = {n.name: n for n in ast.parse(text).body if isinstance(n, ast.FunctionDef)}
    if name not in functions:
        raise AssertionError(f"{reference}: no such test")
    test = functions[name]
    called = {c.func.id for c in ast.walk(test) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)}
    helpers = [functions[c] for c in sorted(called) if c in functions and c != name]
    parts = [*test.decorator_list, test, *helpers]  # a parametrized test's cases are in its decorator
    return "\n".join(ast.get_source_segment(text, n) or "" for n in parts)


def _fragments(message: str) -> list[str]:
    """The literal runs of a catalogued message (placeholders in angle brackets removed)."""
    return [part.strip() for part in re.split(r"<[^>]*>", message.strip("`")) if len(part.strip()) >= 16]


def test_every_error_class_has_a_section() -> None:
    classes = {
        name for name, value in inspect.getmembers(errors, inspect.isclass) if issubclass(value, TorchDelegateError)
    }
    missing = classes - set(_sections())
    assert not missing, f"docs/ERRORS.md has no section for {sorted(missing)}"


def test_every_raised_type_is_catalogued() -> None:
    sections = _sections()
    builtin_rows = " ".join(row[0] for row in sections.get(ARGUMENT_ERRORS, []))
    for name in sorted(_raised_in_source()):
        if name.startswith("_") or name in INTERNAL:
            continue
        if name in sections:
            assert sections[name], f"section {name} has no rows"
        else:
            assert f"`{name}`" in builtin_rows, f"{name} is raised but not catalogued in docs/ERRORS.md"


def test_every_row_names_a_test_that_triggers_it() -> None:
    rows = [(section, row) for section, table in _sections().items() for row in table]
    assert len(rows) >= 50
    for section, row in rows:
        assert len(row) == 4, f"{section}: a row needs when, message, what to do, test: {row}"
        when, message, advice, reference = row
        assert message.startswith("`") and advice, f"{section}: {when}"
        assert reference.startswith("`tests/") and "::" in reference, f"{section}: {when}: no test named"
        source = _test_source(reference)
        names = [section] if section != ARGUMENT_ERRORS else re.findall(r"`(\w+)`", when)
        quoted = any(f[i : i + 16] in source for f in _fragments(message) for i in range(len(f) - 15))
        assert any(name in source for name in names) or quoted, (
            f"{reference} mentions neither {names} nor the message of '{when}'"
        )
