"""The page of a side-by-side run (benchmarks/compare.py): tables, targets and plots.

Every figure on the page is computed here from the run's data, which is written beside the
page as JSON; nothing is typed by hand.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

EXECUTORCH = "ExecuTorch + XNNPACK"
EAGER = "eager torch"
MIB = 2**20


def spread(values: list[float], scale: float = 1.0, digits: int = 3) -> str:
    """``median [min–max] (n)`` of ``values`` divided by ``scale``."""
    low, middle, high = (f(values) / scale for f in (min, statistics.median, max))
    if len(values) == 1:
        return f"{middle:.{digits}g} (n=1)"
    return f"{middle:.{digits}g} [{low:.{digits}g}–{high:.{digits}g}] (n={len(values)})"


def growth_exponent(nodes: list[int], seconds: list[float]) -> float:
    """The least-squares slope of log(seconds) against log(nodes): 1 is linear, 2 quadratic."""
    xs, ys = [math.log(n) for n in nodes], [math.log(s) for s in seconds]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)


def lowering_series(data: dict[str, Any], side: str, key: str) -> list[list[float]]:
    return [[run[key] for run in row["sides"][side]] for row in data["lowering"]]


def latency(runs: list[dict[str, Any]]) -> list[float]:
    """A side's figure per round: the median of that round's repetitions, in microseconds."""
    return [statistics.median(run["latency_us"]) for run in runs]


def _lowering_table(data: dict[str, Any]) -> list[str]:
    lines = [
        "| L | nodes (ours / ET) | partitions (ours / ET) | torchdelegate s | ExecuTorch s | ET ÷ ours "
        "| peak RSS growth ÷ weights (ours / ET) |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in data["lowering"]:
        ours, theirs = row["sides"]["torchdelegate"], row["sides"]["ExecuTorch"]
        ratio = statistics.median(r["seconds"] for r in theirs) / statistics.median(r["seconds"] for r in ours)
        memory = [statistics.median(r["rss_growth"] / r["weights"] for r in runs) for runs in (ours, theirs)]
        lines.append(
            f"| {row['layers']} | {ours[0]['nodes']} / {theirs[0]['nodes']} "
            f"| {ours[0]['partitions']} / {theirs[0]['partitions']} "
            f"| {spread([r['seconds'] for r in ours])} | {spread([r['seconds'] for r in theirs])} | {ratio:.0f}× "
            f"| {memory[0]:.2f} / {memory[1]:.2f} |"
        )
    return lines


def _files_table(data: dict[str, Any]) -> list[str]:
    lines = ["| side | file bytes | ÷ unique weights | delegates (prefill, decode) |", "|---|---|---|---|"]
    for side, figures in data["files"].items():
        delegates = figures.get("delegates")
        held = f"{delegates['prefill']}, {delegates['decode']}" if delegates else "—"
        lines.append(f"| {side} | {figures['file_bytes']:,} | {figures['file_bytes'] / data['weights']:.4f} | {held} |")
    return lines


def _runtime_table(data: dict[str, Any]) -> list[str]:
    baseline = statistics.median(latency(data["runtime"][EXECUTORCH]))
    lines = [
        "| side | decode µs | ÷ ExecuTorch | RSS growth MiB | ÷ weights | max abs diff from eager |",
        "|---|---|---|---|---|---|",
    ]
    for side, runs in data["runtime"].items():
        values = latency(runs)
        resident = [r["rss_growth"] for r in runs]
        lines.append(
            f"| {side} | {spread(values, digits=4)} | {statistics.median(values) / baseline:.2f} "
            f"| {spread(resident, MIB)} | {statistics.median(resident) / data['weights']:.2f} "
            f"| {max(r['max_abs_diff'] for r in runs):.1e} |"
        )
    return lines


def targets(data: dict[str, Any]) -> list[tuple[str, str, bool]]:
    """(target, what the run measured, met) for each target of the comparison."""
    rows = []
    at32 = next((row for row in data["lowering"] if row["layers"] == 32), None)
    if at32:
        ours, theirs = (
            statistics.median(r["seconds"] for r in at32["sides"][s]) for s in ("torchdelegate", "ExecuTorch")
        )
        rows.append(("lowering ≥ 30× faster than ExecuTorch at L=32", f"{theirs / ours:.0f}×", theirs / ours >= 30))
    nodes = [row["sides"]["torchdelegate"][0]["nodes"] for row in data["lowering"]]
    if len(nodes) > 1:
        seconds = [statistics.median(runs) for runs in lowering_series(data, "torchdelegate", "seconds")]
        exponent = growth_exponent(nodes, seconds)
        rows.append(
            ("lowering grows linearly with nodes (log–log slope ≤ 1.15)", f"slope {exponent:.2f}", exponent <= 1.15)
        )
    ours_files = {s: f["file_bytes"] / data["weights"] for s, f in data["files"].items() if s != EXECUTORCH}
    worst = max(ours_files, key=ours_files.__getitem__)
    rows.append(
        (
            "file ≤ 1.01 × unique weights (every backend)",
            f"{ours_files[worst]:.4f} ({worst})",
            ours_files[worst] <= 1.01,
        )
    )
    medians = {s: statistics.median(latency(r)) for s, r in data["runtime"].items() if s.startswith("torchdelegate")}
    best = min(medians, key=medians.__getitem__)
    ratio = medians[best] / statistics.median(latency(data["runtime"][EXECUTORCH]))
    rows.append(
        ("decode latency of the best backend ≤ 0.9 × ExecuTorch + XNNPACK", f"{ratio:.2f} ({best})", ratio <= 0.9)
    )
    resident = {
        s: statistics.median(r["rss_growth"] for r in runs) / data["weights"]
        for s, runs in data["runtime"].items()
        if s.startswith("torchdelegate")
    }
    low = min(resident, key=resident.__getitem__)
    rows.append(
        (
            "resident memory after loading both methods ≤ 1.2 × weights",
            f"{resident[low]:.2f} ({low}, the lowest)",
            resident[low] <= 1.2,
        )
    )
    return rows


def plot(data: dict[str, Any], directory: Path, stem: str) -> list[str]:
    """Two PNGs beside the page: lowering on log–log axes, and bars of the rest. Their names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6.4, 4.4))
    for side, marker in (("torchdelegate", "o"), ("ExecuTorch", "s")):
        nodes = [row["sides"][side][0]["nodes"] for row in data["lowering"]]
        runs = lowering_series(data, side, "seconds")
        middle = [statistics.median(r) for r in runs]
        below = [m - min(r) for m, r in zip(middle, runs, strict=True)]
        above = [max(r) - m for m, r in zip(middle, runs, strict=True)]
        axes.errorbar(nodes, middle, yerr=[below, above], marker=marker, capsize=3, label=f"{side} to_backend")
    axes.set_xscale("log")
    axes.set_yscale("log")
    axes.set_xlabel("nodes in the graph")
    axes.set_ylabel("seconds (median, min–max)")
    axes.set_title("Lowering cost against graph size (stack, d=64)")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend()
    figure.tight_layout()
    lowering_png = f"{stem}-lowering.png"
    figure.savefig(directory / lowering_png, dpi=120)
    plt.close(figure)

    figure, panels = plt.subplots(2, 2, figsize=(11, 8))
    sides = list(data["runtime"])
    colours = ["#c0392b" if s == EXECUTORCH else "#7f8c8d" if s == EAGER else "#2e86c1" for s in sides]
    labels = [s.replace("torchdelegate ", "td ") for s in sides]
    bars = {
        (0, 0): ([statistics.median(latency(data["runtime"][s])) for s in sides], "decode latency, µs (median)"),
        (0, 1): (
            [statistics.median(r["rss_growth"] for r in data["runtime"][s]) / data["weights"] for s in sides],
            "resident memory growth after loading both methods ÷ weights",
        ),
    }
    for (row, column), (values, title) in bars.items():
        panels[row][column].bar(labels, values, color=colours)
        panels[row][column].set_title(title, fontsize=10)
        panels[row][column].tick_params(axis="x", rotation=30, labelsize=8)
    files = list(data["files"])
    panels[1][0].bar(
        [s.replace("torchdelegate ", "td ") for s in files],
        [data["files"][s]["file_bytes"] / data["weights"] for s in files],
        color=["#c0392b" if s == EXECUTORCH else "#2e86c1" for s in files],
    )
    panels[1][0].axhline(1.0, color="black", linewidth=0.8)
    panels[1][0].set_title("two-method file bytes ÷ unique weight bytes", fontsize=10)
    panels[1][0].tick_params(axis="x", rotation=30, labelsize=8)
    layers = [str(row["layers"]) for row in data["lowering"]]
    width = 0.4
    for offset, side, colour in ((-width / 2, "torchdelegate", "#2e86c1"), (width / 2, "ExecuTorch", "#c0392b")):
        values = [
            statistics.median(r["rss_growth"] / r["weights"] for r in row["sides"][side]) for row in data["lowering"]
        ]
        panels[1][1].bar([i + offset for i in range(len(layers))], values, width, label=side, color=colour)
    panels[1][1].set_xticks(range(len(layers)), [f"L={n}" for n in layers])
    panels[1][1].set_title("lowering: peak resident memory growth ÷ weights", fontsize=10)
    panels[1][1].legend()
    figure.suptitle("torchdelegate and ExecuTorch, stack L=4 d=256 (prefill + decode)")
    figure.tight_layout()
    rest_png = f"{stem}-runtime.png"
    figure.savefig(directory / rest_png, dpi=110)
    plt.close(figure)
    return [lowering_png, rest_png]


def machine_line(m: dict[str, str]) -> str:
    """The machine and versions a run was measured on, as one line of a page."""
    return (
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['memory']}; {m['os']}. Python {m['python']}, "
        f"torch {m['torch']}, onnxruntime {m['onnxruntime']}; ExecuTorch {m['executorch']} "
        f"(torch {m['executorch torch']}) in its own environment."
    )


def targets_table(rows: list[tuple[str, str, bool]]) -> list[str]:
    """(target, measured, met) rows as a Markdown table, a miss in bold."""
    lines = ["| target | measured | met |", "|---|---|---|"]
    return lines + [f"| {target} | {value} | {'yes' if met else '**no**'} |" for target, value, met in rows]


def written(directory: Path, stem: str, data: dict[str, Any], lines: list[str]) -> Path:
    """``<stem>.json`` (the data) and ``<stem>.md`` (the page's lines) in ``directory``; the page's path."""
    (directory / f"{stem}.json").write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    page = directory / f"{stem}.md"
    page.write_text("\n".join(lines))
    return page


def write_results(data: dict[str, Any], directory: Path) -> Path:
    """``<date>.md``, ``<date>.json`` and the plots in ``directory``; the page's path."""
    directory.mkdir(parents=True, exist_ok=True)
    stem = data["date"]
    lowering_png, rest_png = plot(data, directory, stem)
    lines = [
        f"# torchdelegate and ExecuTorch side by side — {stem}",
        "",
        machine_line(data["machine"]),
        "",
        f"Written by `{data['command']}` (`make bench`); the data is in `{stem}.json`. Each measurement "
        "ran in a fresh process of its side; sides alternated. Figures are medians, [min–max] over "
        "repetitions, n the repetitions.",
        "",
        "## Targets",
        "",
        *targets_table(targets(data)),
        "",
        "## Lowering cost against graph size",
        "",
        "The benchmark stack (d=64), each maximal run of supported ops (linear, addmm, mm, permute, "
        "view, add, mul, gelu) one partition, for a backend whose preprocess does nothing: "
        "`EdgeProgramManager.to_backend` on each side. Peak resident memory growth during the "
        "lowering is over the weights' bytes.",
        "",
        *_lowering_table(data),
        "",
    ]
    for side in ("torchdelegate", "ExecuTorch"):
        nodes = [row["sides"][side][0]["nodes"] for row in data["lowering"]]
        if len(nodes) > 1:
            seconds = [statistics.median(r) for r in lowering_series(data, side, "seconds")]
            lines.append(f"- {side}: seconds grow as nodes^{growth_exponent(nodes, seconds):.2f} (log–log slope).")
    lines += [
        "",
        f"![lowering seconds against nodes]({lowering_png})",
        "",
        "## Two methods sharing weights",
        "",
        f"The stack at L=4, d=256 as `prefill` (8 tokens) and `decode` (1 token) of one model, "
        f"lowered together and saved. Unique weight bytes: {data['weights']:,}.",
        "",
        *_files_table(data),
        "",
        "## Runtime: decode latency and resident memory",
        "",
        "Each file loaded with both methods by its side's runtime; resident memory growth after "
        "one call of each method, over the weights' bytes (the baseline is taken after the side's "
        "runtime libraries are imported, torch's thread pool started and a first large matrix "
        "product done, on every side); then one-token decode "
        "calls. A round's figure is the median of its repetitions; the table gives the median "
        "round, [min–max] over rounds.",
        "",
        *_runtime_table(data),
        "",
        f"![decode latency, memory, file size and lowering memory]({rest_png})",
        "",
    ]
    return written(directory, stem, data, lines)
