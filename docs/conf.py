"""The documentation site: Sphinx with the PyData theme (PyTorch's own documentation's base), the
pages in Markdown (MyST), and an API reference made from the docstrings of every public name.

``make docs`` builds it into ``docs/_build/html`` with warnings as errors and every cross-reference
checked (nitpicky): a name that moved, a page that was renamed or a broken link fails the build.
The reference pages are written here, before Sphinx reads the sources, from the ``__all__`` of
each public module, so a name added to the API has its page without anyone listing it; so are
the benchmark pages, one per ``benchmarks/results/*.md``.
"""

from __future__ import annotations

import importlib
import inspect
import shutil
from pathlib import Path

import torchdelegate

HERE = Path(__file__).parent
REFERENCE = HERE / "reference"
RESULTS = HERE / "results"
PUBLIC_MODULES = {
    "torchdelegate": "The package: lowering, partitioning, backends, named data, the runtime, errors.",
    "torchdelegate.backends.reference": "The reference backend: any core-ATen sub-program, run by torch.",
    "torchdelegate.backends.onnxruntime": "The ONNX Runtime backend.",
    "torchdelegate.backends.inductor": "The AOTInductor backend: partitions compiled to native code.",
    "torchdelegate.report": "Lowering reports: what went where and why, drawn as text or HTML; profiles by node.",
    "torchdelegate.llm": "Generation over a loaded language model's prefill and decode.",
}

project = "torchdelegate"
author = "the torchdelegate authors"
copyright = "2026, the torchdelegate authors"
release = torchdelegate.__version__

extensions = ["myst_parser", "sphinx.ext.autodoc"]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build", "images/*.md"]
myst_heading_anchors = 4
myst_enable_extensions = ["colon_fence"]
suppress_warnings = ["myst.header"]  # the catalogue pages open at level 2 under their title

autodoc_member_order = "bysource"
autodoc_default_options = {"members": True, "show-inheritance": True}
nitpicky = True
# What the reference names from other projects (no inventory is fetched: the build is offline).
_OTHER_PROJECTS = "torch|numpy|np|onnx|onnxruntime|onnx_ir|onnxscript|fsspec|dask|distributed|torchao|transformers"
_STANDARD_MODULES = (
    r"typing|collections|collections\.abc|concurrent\.futures|contextlib|dataclasses|os|pathlib|enum|types|io|abc"
)
nitpick_ignore_regex = [
    (r"py:.*", rf"({_OTHER_PROJECTS})(\..*)?"),
    (r"py:.*", rf"({_STANDARD_MODULES})\..*"),
    (r"py:.*", r"(Any|Callable|Iterable|Iterator|Mapping|Sequence|Path|PathLike|Executor|Future|TextIO|Node|Graph)"),
    (r"py:.*", r"(GraphModule|ExportedProgram|Tensor|Module|ModuleType|OpOverload|OperatorSupportBase|Partition)"),
    (r"py:.*", r"(builtins\.)?(bool|int|float|str|bytes|bytearray|memoryview|dict|list|tuple|set|frozenset)"),
    (r"py:.*", r"(builtins\.)?(type|object)"),
    (r"py:.*", r"None|Exception|ValueError|TypeError|KeyError|RuntimeError|OSError|ImportError|UserWarning"),
    (r"py:.*", r"DeprecationWarning"),
]

# Internal types that public signatures name; they have no page of their own. Any other target
# not found fails the build.
nitpick_ignore = [
    ("py:class", name)
    for name in (
        "OperatorSupport",
        "PatternLike",
        "BackendOptions",
        "ProgramFile",
        "torchdelegate.cache.compiled_entry.Entry",
        "Entry",
        "torchdelegate.serialize.call_plan.CallPlan",
        "torchdelegate.serialize.reader.ProgramFile",
        "torchdelegate.serialize.manifest.DelegateRecord",
        "torchdelegate.compile.compiler.UnitCompiler",
        "torchdelegate.partition.plan.PlannedPartition",
        "torchdelegate.partition.plan.NodeDecision",
        "torchdelegate.runtime.bound_method.BoundMethod",
        "torchdelegate.lowering.method_report.ReportedProgram",
        "torchdelegate.lowering.method_report.Boundary",
    )
] + [("py:data", "torchdelegate.partition.capability.OperatorSupport")]

html_theme = "pydata_sphinx_theme"
html_title = f"torchdelegate {release}"
html_static_path: list[str] = []
html_theme_options = {
    "navigation_with_keys": False,
    "show_toc_level": 2,
    "navbar_align": "left",
    "footer_start": ["copyright"],
    "footer_end": [],
}
html_show_sourcelink = False
html_context = {"default_mode": "light"}  # the theme's own default reads a stored choice, absent offline


def _kind(value: object) -> str:
    if inspect.isclass(value):
        return "exception" if issubclass(value, BaseException) else "class"
    return "function" if callable(value) else "data"


def _defined_where(value: object, module_name: str, name: str) -> str:
    """Where a public name is defined: a class or function two modules export gets one page, under the first."""
    if inspect.isclass(value) or inspect.isfunction(value):
        return f"{value.__module__}.{value.__qualname__}"
    return f"{module_name}.{name}"


def _reference_pages() -> None:
    """One page per public name (``reference/<module>.<name>.rst``) and an index per module."""
    shutil.rmtree(REFERENCE, ignore_errors=True)
    REFERENCE.mkdir()
    sections, documented = [], set()
    for module_name, summary in PUBLIC_MODULES.items():
        module = importlib.import_module(module_name)
        where = {name: _defined_where(getattr(module, name), module_name, name) for name in module.__all__}
        names = [name for name in module.__all__ if where[name] not in documented]
        documented.update(where[name] for name in names)
        for name in names:
            title = f"{module_name}.{name}"
            directive = f"auto{_kind(getattr(module, name))}"
            page = f"{title}\n{'=' * len(title)}\n\n.. currentmodule:: {module_name}\n\n.. {directive}:: {name}\n"
            (REFERENCE / f"{title}.rst").write_text(page, encoding="utf-8")
        entries = "\n".join(f"   {module_name}.{name}" for name in names)
        sections.append(
            f"``{module_name}``\n{'-' * (len(module_name) + 4)}\n\n{summary}\n\n"
            f".. toctree::\n   :maxdepth: 1\n\n{entries}\n"
        )
    heading = "API reference"
    index = (
        f"{heading}\n{'=' * len(heading)}\n\nEvery name the public modules export (their ``__all__``), "
        "from its docstring.\n\n" + "\n".join(sections)
    )
    (REFERENCE / "index.rst").write_text(index, encoding="utf-8")


def _result_pages() -> None:
    """A page per ``benchmarks/results/*.md`` (``docs/results/``, committed so that links to it work
    where the Markdown is read as it is), which includes it with its plots; a new result gets one."""
    RESULTS.mkdir(exist_ok=True)
    for result in sorted((HERE.parent / "benchmarks" / "results").glob("*.md")):
        page = RESULTS / result.name
        if not page.exists():
            include = f"```{{include}} ../../benchmarks/results/{result.name}\n:relative-images:\n```\n"
            page.write_text(include, encoding="utf-8")


_reference_pages()
_result_pages()


def _dataclass_factories(app: object, what: str, name: str, obj: object, options: object, signature: str | None,
                         return_annotation: str | None) -> tuple[str | None, str | None]:  # fmt: skip
    """A dataclass field's ``default_factory`` shows as ``<factory>``, which is not Python: the
    signature would be read as text and split at every comma. Shown as ``...`` instead."""
    return (signature.replace("<factory>", "...") if signature else signature), return_annotation


def setup(app: object) -> None:
    app.connect("autodoc-process-signature", _dataclass_factories)  # type: ignore[attr-defined]
