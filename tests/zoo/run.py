"""Run the zoo: every model exported, lowered with each backend list, saved, loaded and run in a
fresh process, compared with eager; the results as JSON and as docs/ZOO.md.

``python tests/zoo/run.py [--workers 2] [--json FILE] [--markdown FILE] [MODEL ...]`` (``make zoo``).
``python tests/zoo/run.py --render FILE.json --markdown FILE.md`` rewrites the page from saved results.

One model goes through three steps, which the tests call separately so that one fresh process
can serve many models: :func:`prepare` (build, eager outputs, export, lower, save), the fresh
process (:mod:`fresh`), :func:`finish` (compare with eager). Lowering uses a
``CapabilityPartitioner`` over the shipped backends' operator support through
the lowering's own report, which gives the shares of nodes and FLOPs.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import multiprocessing
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils import _pytree as pytree

HERE = Path(__file__).resolve().parent
if str(HERE.parent) not in sys.path:  # run as a script: tests/ holds the zoo package and language_models
    sys.path.insert(0, str(HERE.parent))

import torchdelegate  # noqa: E402
from torchdelegate.errors import first_line  # noqa: E402
from zoo.models import BY_NAME, ZOO, Call, Case, ZooModel  # noqa: E402

BACKEND_LISTS: tuple[tuple[str, ...], ...] = (("reference",), ("onnxruntime", "reference"))
ORT = "onnxruntime"
TORCH = "torch"  # where an undelegated computation runs: the program itself
ATOL = RTOL = 1e-4
FRESH_TIMEOUT = 900  # seconds for one fresh process to load and run its programs


@dataclass
class MethodResult:
    """One method of one lowered program: its delegates and what the report says went where."""

    delegates: dict[str, int]  # backend id -> delegates, in order of first appearance
    nodes: int  # computations in the edge program
    ort_nodes: int
    flops: int
    ort_flops: int
    elsewhere: dict[str, dict[str, int]]  # computations not on the first backend: where -> op -> count


@dataclass
class Result:
    """One model with one backend list: pass, or the step that failed and the error's first line."""

    model: str
    kind: str
    family: str
    backends: list[str]
    passed: bool = False
    step: str = ""  # the step that failed: build, export, lower, save, load and run, compare
    error: str = ""
    methods: dict[str, MethodResult] = field(default_factory=dict)
    file_bytes: int = 0
    weight_bytes: int = 0
    export_seconds: float = 0.0
    lowering_seconds: float = 0.0
    max_abs_error: float | None = None
    output_structure: str = ""
    imports: list[str] = field(default_factory=list)  # modules defining the output types, imported to run
    bare_error: str = ""  # running with only torch and torchdelegate imported, when ``imports``: "" if as eager
    bare_structure: str = ""  # the plain output structure it returned then

    @property
    def file_over_weights(self) -> float | None:
        return self.file_bytes / self.weight_bytes if self.file_bytes and self.weight_bytes else None

    def share(self, part: str) -> float | None:
        """The share of ``part`` ("nodes" or "flops") that runs on ONNX Runtime, over all methods."""
        total = sum(getattr(m, part) for m in self.methods.values())
        on_ort = sum(getattr(m, f"ort_{part}") for m in self.methods.values())
        return on_ort / total if total and self.methods else None

    def fail(self, step: str, error: BaseException | str) -> Result:
        self.step = step
        self.error = error if isinstance(error, str) else describe(error)
        return self

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> Result:
        methods = {name: MethodResult(**m) for name, m in value.get("methods", {}).items()}
        return cls(**{**value, "methods": methods})


@dataclass
class Prepared:
    """A model lowered with every backend list and saved, waiting to be run in a fresh process."""

    model: ZooModel
    expected: list[list[torch.Tensor]]  # each call's flattened eager outputs
    structures: list[str]  # each call's eager output structure
    imports: list[str]  # the modules that define the output types (pytree nodes beyond Python's and torch's)
    calls_path: Path
    results: list[Result]
    programs: dict[int, Path]  # index in results -> saved file, for those that got that far


def describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {first_line(error)}"


# ---------------------------------------------------------------- ahead of time


def eager_outputs(case: Case) -> tuple[list[list[torch.Tensor]], list[str], list[str]]:
    """Each call's outputs in eager, flattened, their structures, and the modules that define
    the structures' types; on a copy of the modules (so that a cache the calls fill is not the
    one the programs are exported from)."""
    modules = copy.deepcopy(case.modules)  # one copy: methods sharing a module still share it
    outputs, structures, imports = [], [], []
    with torch.no_grad():
        for call in case.calls:
            leaves, spec = pytree.tree_flatten(modules[call.method](*call.args, **call.kwargs))
            outputs.append(leaves)
            structures.append(str(spec))
            imports.extend(type_modules(spec))
    return outputs, structures, sorted(set(imports))


def type_modules(spec: pytree.TreeSpec) -> list[str]:
    """Modules defining the container types of ``spec`` that are neither Python's nor torch's."""
    found = (
        []
        if spec.type is None or spec.type.__module__.split(".")[0] in {"builtins", "collections", "torch"}
        else [spec.type.__module__]
    )
    return found + [module for child in spec.children() for module in type_modules(child)]


def export(case: Case) -> dict[str, torch.export.ExportedProgram]:
    """Each method exported with its first call's arguments (non-strict unless the case says otherwise)."""
    programs = {}
    with torch.no_grad():
        for method, module in case.modules.items():
            example = case.example(method)
            programs[method] = torch.export.export(module, example.args, dict(example.kwargs), strict=case.strict)
    return programs


def weight_bytes(manager: torchdelegate.EdgeProgramManager) -> int:
    """Bytes of the tensors the methods only read (weights, constants), each storage once; the
    buffers some method writes (a KV cache) are state, not weights."""
    seen: dict[int, int] = {}
    for method in manager.methods:
        program = manager.exported_program(method)
        written = set(program.graph_signature.buffers_to_mutate.values())
        for name, tensor in {**program.state_dict, **program.constants}.items():
            if isinstance(tensor, torch.Tensor) and name not in written:
                seen[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
    return sum(seen.values())


def method_results(lowered: torchdelegate.EdgeProgramManager, report: Any, first: str) -> dict[str, MethodResult]:
    """Delegates per method from the lowered program; nodes and FLOPs per backend from the report;
    the ops of computations that ``first`` (the first backend) did not take, by where they went."""
    found = {}
    for method, delegates in lowered.delegates().items():
        rows = report.methods[method].nodes
        on_ort = [row for row in rows if row.backend_id == ORT]
        elsewhere: dict[str, Counter[str]] = {}
        for row in rows:
            if row.backend_id != first:
                elsewhere.setdefault(row.backend_id or TORCH, Counter())[row.op] += 1
        found[method] = MethodResult(
            delegates=dict(Counter(d.backend_id for d in delegates)),
            nodes=len(rows),
            ort_nodes=len(on_ort),
            flops=sum(row.flops for row in rows),
            ort_flops=sum(row.flops for row in on_ort),
            elsewhere={where: dict(ops.most_common()) for where, ops in sorted(elsewhere.items())},
        )
    return found


def lower_and_save(
    programs: dict[str, torch.export.ExportedProgram], backends: Sequence[str], path: Path, result: Result
) -> bool:
    """Lower ``programs`` with ``backends`` in priority order and save them to ``path``; False if a step failed."""
    from torchdelegate.partition.proposed import backend_supports

    try:
        start = time.perf_counter()
        edge = torchdelegate.to_edge(programs)
        partitioner = torchdelegate.CapabilityPartitioner(backend_supports(list(backends)))
        lowered = edge.to_backend(partitioner)
        report = lowered.report
        result.lowering_seconds = time.perf_counter() - start
        result.weight_bytes = weight_bytes(edge)
        result.methods = method_results(lowered, report, backends[0])
    except Exception as error:  # noqa: BLE001 - the zoo records every failure and goes on
        result.fail("lower", error)
        return False
    try:
        lowered.save(path)
        result.file_bytes = path.stat().st_size
    except Exception as error:  # noqa: BLE001
        result.fail("save", error)
        return False
    return True


def prepare(model: ZooModel, workdir: Path, backend_lists: Iterable[Sequence[str]] = BACKEND_LISTS) -> Prepared:
    """Build ``model``, run it in eager, export it once, and lower and save it with each backend list."""
    results = [Result(model.name, model.kind, model.family, list(b)) for b in backend_lists]
    prepared = Prepared(model, [], [], [], workdir / f"{model.name}.calls.pt", results, {})

    def failed(step: str, error: BaseException) -> Prepared:
        for result in results:
            result.fail(step, error)
        return prepared

    try:
        case = model.build()
        prepared.expected, prepared.structures, prepared.imports = eager_outputs(case)
    except Exception as error:  # noqa: BLE001
        return failed("build", error)
    try:
        start = time.perf_counter()
        programs = export(case)
        seconds = time.perf_counter() - start
    except Exception as error:  # noqa: BLE001
        return failed("export", error)
    save_calls(case.calls, prepared.calls_path)
    for index, result in enumerate(results):
        result.export_seconds = seconds
        path = workdir / f"{model.name}.{'+'.join(result.backends)}.tdp"
        if lower_and_save(programs, result.backends, path, result):
            prepared.programs[index] = path
    return prepared


def save_calls(calls: list[Call], path: Path) -> None:
    torch.save([{"method": c.method, "args": list(c.args), "kwargs": dict(c.kwargs)} for c in calls], path)


# ---------------------------------------------------------------- the fresh process


def outputs_path(program: Path) -> Path:
    return program.with_suffix(".outputs.pt")


def run_fresh(prepared: Sequence[Prepared], workdir: Path) -> None:
    """Load and run every saved program of ``prepared`` in one new Python process."""
    jobs = [
        {"program": str(path), "calls": str(p.calls_path), "outputs": str(outputs_path(path)), "imports": p.imports}
        for p in prepared
        for path in p.programs.values()
    ]
    if not jobs:
        return
    jobs_path = Path(tempfile.mkstemp(suffix=".json", dir=workdir)[1])
    jobs_path.write_text(json.dumps(jobs))
    source = str(Path(torchdelegate.__file__).resolve().parent.parent)  # the same core as this process
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [source, os.environ.get("PYTHONPATH")]))}
    completed = subprocess.run(
        [sys.executable, str(HERE / "fresh.py"), str(jobs_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=FRESH_TIMEOUT,
    )
    if completed.returncode != 0:  # jobs that left no outputs are told why in finish
        last = (completed.stderr.strip().splitlines() or ["(no output)"])[-1]
        (workdir / "fresh-process-error.txt").write_text(f"exit code {completed.returncode}: {last}")


# ---------------------------------------------------------------- comparing with eager


def compare(expected: list[list[Any]], actual: list[list[Any]]) -> float:
    """The largest absolute difference over every output of every call; raises if any is not close."""
    if len(actual) != len(expected):
        raise AssertionError(f"{len(actual)} calls answered, {len(expected)} made")
    largest = 0.0
    for number, (want, got) in enumerate(zip(expected, actual, strict=True)):
        if len(want) != len(got):
            raise AssertionError(f"call {number}: {len(got)} outputs, eager has {len(want)}")
        for index, (w, g) in enumerate(zip(want, got, strict=True)):
            try:
                torch.testing.assert_close(g, w, atol=ATOL, rtol=RTOL)
            except AssertionError as error:
                detail = str(error).strip().splitlines()
                raise AssertionError(f"call {number} output {index}: {detail[0] if detail else 'differs'}") from None
            if isinstance(w, torch.Tensor) and w.is_floating_point() and w.numel():
                largest = max(largest, float((g.double() - w.double()).abs().max()))
    return largest


def plain_outcome(expected: list[list[Any]], bare: dict[str, Any]) -> tuple[str, str]:
    """The plain structure a run without the output types' modules returned, and what was wrong
    with it ("" when its outputs are eager's, in eager's order)."""
    if "error" in bare:
        return "", bare["error"]
    try:
        compare(expected, bare["outputs"])
    except AssertionError as error:
        return bare["structures"][0], str(error)
    return bare["structures"][0], ""


def finish(prepared: Prepared, workdir: Path) -> list[Result]:
    """Each saved program's fresh-process outputs checked against eager: its result is final."""
    crash = workdir / "fresh-process-error.txt"
    for index, program in prepared.programs.items():
        result = prepared.results[index]
        answer_path = outputs_path(program)
        if not answer_path.exists():
            why = crash.read_text() if crash.exists() else "no outputs written"
            result.fail("load and run", f"fresh process died: {why}")
            continue
        answer = torch.load(answer_path, weights_only=True)
        result.imports = prepared.imports
        if "bare" in answer:
            result.bare_structure, result.bare_error = plain_outcome(prepared.expected, answer["bare"])
        if "error" in answer:
            result.fail("load and run", answer["error"])
            continue
        result.output_structure = answer["structures"][0]
        try:
            result.max_abs_error = compare(prepared.expected, answer["outputs"])
        except AssertionError as error:
            result.fail("compare", str(error))
            continue
        if answer["structures"] != prepared.structures:
            result.fail("compare", f"output structure {answer['structures'][0]}, eager {prepared.structures[0]}")
            continue
        if result.bare_error:
            result.fail("run without imports", result.bare_error)
            continue
        result.passed = True
    return prepared.results


def run_models(models: Sequence[ZooModel], workdir: Path) -> list[Result]:
    """``models`` prepared one after another, then run in one fresh process and compared."""
    prepared = [prepare(model, workdir) for model in models]
    run_fresh(prepared, workdir)
    results = [result for p in prepared for result in finish(p, workdir)]
    for result in results:  # errors name files by their name only: the page does not change with the directory
        result.error = result.error.replace(f"{workdir}{os.sep}", "")
        result.bare_error = result.bare_error.replace(f"{workdir}{os.sep}", "")
    return results


def run_model(name: str) -> list[dict[str, Any]]:
    """One model in its own temporary directory and fresh process, as JSON (a worker's task)."""
    torch.set_num_threads(1)
    quiet_transformers()
    with tempfile.TemporaryDirectory(prefix=f"zoo-{name}-") as directory:
        return [result.to_json() for result in run_models([BY_NAME[name]], Path(directory))]


def quiet_transformers() -> None:
    """Tiny configs keep some special token ids outside the tiny vocabulary: transformers warns each time."""
    try:
        import transformers
    except ImportError:
        return
    transformers.logging.set_verbosity_error()


# ---------------------------------------------------------------- the whole zoo and its page


def run_zoo(names: Sequence[str], workers: int) -> list[Result]:
    """Every named model on at most ``workers`` processes, in catalogue order."""
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
        futures = {name: pool.submit(run_model, name) for name in names}
        results = []
        for name, future in futures.items():
            model = BY_NAME[name]
            try:
                found = [Result.from_json(r) for r in future.result()]
            except Exception as error:  # noqa: BLE001 - a worker that died fails its model, not the zoo
                found = [Result(name, model.kind, model.family, list(b)).fail("worker", error) for b in BACKEND_LISTS]
            for result in found:
                mark = "pass" if result.passed else f"FAIL at {result.step}: {result.error}"
                print(f"{name:28s} {'+'.join(result.backends):22s} {mark}", flush=True)
            results.extend(found)
    return results


def machine() -> dict[str, str]:
    """What the figures were measured on."""
    import onnxruntime
    import transformers

    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    processor = platform.processor() or platform.machine()
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        processor,
    )
    return {
        "cpu": f"{cpu}, {os.cpu_count()} cores",
        "memory": f"{memory:.0f} GiB",
        "system": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "onnxruntime": onnxruntime.__version__,
    }


def percent(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:.1f}%"


def delegates_text(result: Result) -> str:
    parts = []
    for method, found in result.methods.items():
        counts = ", ".join(f"{n} {backend}" for backend, n in found.delegates.items()) or "none"
        parts.append(f"{method}: {counts}")
    return "; ".join(parts) or "—"


def render(results: Sequence[Result], about: dict[str, Any]) -> str:
    """docs/ZOO.md: every figure comes from ``results`` and ``about``."""
    lists = list(dict.fromkeys(tuple(r.backends) for r in results))
    models = list(dict.fromkeys(r.model for r in results))
    lines = [
        "# The model zoo",
        "",
        "Generated by `make zoo` (`tests/zoo/run.py`) from `docs/zoo.json`; do not edit by hand.",
        "Every model is built from a tiny config with random weights (`tests/zoo/models.py`), exported",
        "with `torch.export` (non-strict; static-cache LMs strict, as transformers' exporter does),",
        "lowered with a `CapabilityPartitioner` over each backend list (priority order), saved, loaded",
        "and run **in a fresh process** (which imports torch and torchdelegate, and the modules defining",
        "the output types of models that return them: see below), and compared with eager",
        f"(`assert_close`, atol = rtol = {ATOL:g}).",
        "",
        f"Run of {about['date']} in {about['seconds']:.0f} s on {about['workers']} worker(s): "
        + ", ".join(f"{k} {v}" for k, v in about["machine"].items())
        + (f"; load average {about['load average']}" if "load average" in about else "")
        + ".",
        "",
        "## Summary",
        "",
        "| backends | models | pass | fail |",
        "|---|---:|---:|---:|",
    ]
    for backends in lists:
        mine = [r for r in results if tuple(r.backends) == backends]
        passed = sum(r.passed for r in mine)
        lines.append(f"| {' then '.join(backends)} | {len(mine)} | {passed} | {len(mine) - passed} |")
    lines += [
        "",
        "## Per model",
        "",
        "ONNX Runtime's share of the computations (nodes) and of the FLOPs (torch's flop counter) is",
        "over all methods, from the lowering report. File ÷ weights: the saved file against the bytes",
        "of the tensors the program only reads (weights and constants; a KV cache is not counted).",
        "Lowering: `to_edge` and `to_backend`, in seconds.",
        "",
        "| model | kind | backends | result | delegates per method | ORT nodes | ORT FLOPs | file ÷ weights "
        "| lowering s |",
        "|---|---|---|---|---|---:|---:|---:|---:|",
    ]
    by_key = {(r.model, tuple(r.backends)): r for r in results}
    for name in models:
        for backends in lists:
            r = by_key.get((name, backends))
            if r is None:
                continue
            outcome = "pass" if r.passed else f"**fail** ({r.step}): `{r.error.replace('|', '/')}`"
            ort = ORT in r.backends
            ratio = f"{r.file_over_weights:.2f}" if r.file_over_weights else "—"
            seconds = f"{r.lowering_seconds:.1f}" if r.lowering_seconds else "—"
            lines.append(
                f"| {name} | {r.kind} | {' then '.join(r.backends)} | {outcome} | {delegates_text(r)} "
                f"| {percent(r.share('nodes')) if ort else '—'} | {percent(r.share('flops')) if ort else '—'} "
                f"| {ratio} | {seconds} |"
            )
    lines += failures_section(results)
    lines += output_types_section(results)
    lines += elsewhere_section(results)
    return "\n".join(lines) + "\n"


def failures_section(results: Sequence[Result]) -> list[str]:
    """Failures grouped by their error's first line (the step it happened at, and the models)."""
    groups: dict[tuple[str, str], list[str]] = {}
    for r in results:
        if not r.passed:
            groups.setdefault((r.step, r.error), []).append(f"{r.model} ({' then '.join(r.backends)})")
    if not groups:
        return ["", "## Failures", "", "None."]
    lines = ["", "## Failures, by error", ""]
    for (step, error), where in sorted(groups.items(), key=lambda item: (-len(item[1]), item[0])):
        lines.append(f"- at {step}: `{error}` — {len(where)}: {', '.join(where)}")
    return lines


def output_types_section(results: Sequence[Result]) -> list[str]:
    """Models returning library types (a ``ModelOutput``): run before and after importing their module."""
    typed = [r for r in results if r.imports]
    if not typed:
        return []
    lines = [
        "",
        "## Outputs of library types",
        "",
        "These models return their library's output type as it is. The fresh process first loads and",
        "runs each file with only torch and torchdelegate imported: the outputs come back as plain",
        "containers (below, compared with eager's leaves), then it imports the modules that define the",
        "types, as a caller using them has them, and runs the calls again (the table above).",
        "",
        "| model | backends | imports | without them |",
        "|---|---|---|---|",
    ]
    for r in typed:
        structure = " ".join(r.bare_structure.split()).replace("|", "/")  # one table cell: one line
        plain = f"outputs equal eager's, as `{structure}`" if structure else ""
        bare = f"`{r.bare_error.replace('|', '/')}`" if r.bare_error else plain
        lines.append(f"| {r.model} | {' then '.join(r.backends)} | {', '.join(r.imports)} | {bare} |")
    return lines


def elsewhere_section(results: Sequence[Result]) -> list[str]:
    """The computations each lowering's first backend did not take: the ops, by where they went
    (the next backend, or ``torch``: left in the program, undelegated)."""
    lines = [
        "",
        "## What the first backend left",
        "",
        "Computations the first backend of the list did not take, by where they went (`torch`: left",
        "in the program, undelegated), summed over the methods.",
        "",
    ]
    found = False
    for r in results:
        where: dict[str, Counter[str]] = {}
        for method in r.methods.values():
            for backend, ops in method.elsewhere.items():
                where.setdefault(backend, Counter()).update(ops)
        for backend, ops in sorted(where.items()):
            found = True
            listed = ", ".join(f"`{op}` × {n}" for op, n in ops.most_common())
            lines.append(f"- {r.model}, {' then '.join(r.backends)} → {backend}: {listed}")
    return lines if found else [*lines, "None: the first backend took every computation."]


def write(results: Sequence[Result], about: dict[str, Any], json_path: Path, markdown_path: Path) -> None:
    document = {"about": about, "results": [r.to_json() for r in results]}
    json_path.write_text(json.dumps(document, indent=1) + "\n")
    markdown_path.write_text(render(results, about))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", help="names from tests/zoo/models.py (default: all)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--json", type=Path, default=Path("docs/zoo.json"))
    parser.add_argument("--markdown", type=Path, default=Path("docs/ZOO.md"))
    parser.add_argument("--render", type=Path, help="only rewrite --markdown from this JSON file")
    args = parser.parse_args(argv)
    if args.render:
        document = json.loads(args.render.read_text())
        results = [Result.from_json(r) for r in document["results"]]
        args.markdown.write_text(render(results, document["about"]))
        return 0
    unknown = sorted(set(args.models) - set(BY_NAME))
    if unknown:
        parser.error(f"unknown models: {', '.join(unknown)}; known: {', '.join(BY_NAME)}")
    names = args.models or [model.name for model in ZOO]
    start, load_before = time.perf_counter(), os.getloadavg()[0]
    results = run_zoo(names, max(1, min(args.workers, 2)))
    about = {
        "date": datetime.date.today().isoformat(),
        "seconds": time.perf_counter() - start,
        "workers": max(1, min(args.workers, 2)),
        "machine": machine(),
        "load average": f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after",  # other work on the machine
    }
    write(results, about, args.json, args.markdown)
    passed = sum(r.passed for r in results)
    print(f"{passed} of {len(results)} passed in {about['seconds']:.0f} s; wrote {args.json} and {args.markdown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
