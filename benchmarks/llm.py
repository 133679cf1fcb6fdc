"""A Llama-architecture LLM, prefill + decode, lowered and run by torchdelegate and by ExecuTorch.

``make bench`` runs this after ``compare.py``. The model is a transformers ``LlamaForCausalLM``
with random weights over a static KV cache (transformers' exportable wrapper), exported as
``prefill`` (32 tokens) and ``decode`` (one token): ``--size base`` is 200M parameters (766 MB
fp32), ``--size large`` TinyLlama's shape (1.1B parameters, 4.4 GB). torchdelegate lowers to
ONNX Runtime, then the reference backend; ExecuTorch 1.5.1 to XNNPACK (in ``.venv-executorch``).

Every measurement is a fresh process of its side (``llm_side.py``): one lowering per side, then
``--rounds`` alternating rounds of loading and running both files. Writes
``benchmarks/results/<date>-llm-<size>.md`` with its JSON and a plot, and prints the page.

With ``--quantize 8da4w`` both sides lower the model quantized by torchao's 8da4w recipe (int8
dynamic activations, int4 weights in groups of 32, every linear layer; embeddings in float), and
each run also compares its logits over the prompt and 48 greedy decode steps with the fp32
model's (``llm_side.py reference``): largest and mean absolute error, top-1 agreement.

    python benchmarks/llm.py [--size base|large] [--rounds 3] [--non-strict] [--quantize 8da4w]
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from compare import EXECUTORCH_PYTHON, machine, measure
from results import machine_line, targets_table, written

HERE = Path(__file__).resolve().parent
SIDES = {
    "torchdelegate": [sys.executable, str(HERE / "llm_side.py")],
    "executorch": [str(EXECUTORCH_PYTHON), str(HERE / "llm_side.py")],
}
NAMES = {"torchdelegate": "torchdelegate (onnxruntime, then reference)", "executorch": "ExecuTorch + XNNPACK"}
SUFFIX = {"torchdelegate": ".tdp", "executorch": ".pte"}
# Each round's runs, in order: (side, with the machine cache our file was prepared into).
RUNS = {
    "torchdelegate": ("torchdelegate", False),
    "executorch": ("executorch", False),
    "prepared": ("torchdelegate", True),
}


def collect(size: str, rounds: int, strict: bool, quantize: str | None, directory: Path) -> dict[str, Any]:
    """Each side's lowering, our file prepared for this machine, then ``rounds`` alternating runs:
    our file without the machine cache, ExecuTorch's, ours with it (quantized: each run's logits
    compared with the fp32 model's)."""
    data: dict[str, Any] = {"lower": {}, "run": {run: [] for run in RUNS}}
    checked: list[str] = []
    if quantize:
        reference = directory / "fp32-logits.pt"
        measure([*SIDES["torchdelegate"], "reference", "--size", size, "--out", str(reference)])
        checked = ["--reference", str(reference)]
    for side, command in SIDES.items():
        path = directory / f"{side}{SUFFIX[side]}"
        extra = ([] if strict else ["--non-strict"]) + (["--quantize", quantize] if quantize else [])
        data["lower"][side] = {
            **measure([*command, "lower", "--side", side, "--size", size, "--out", str(path), *extra])
        }
        data["lower"][side]["path"] = str(path)
        print(f"  lowered {side}: {data['lower'][side]['lower_save_s']:.0f} s", file=sys.stderr, flush=True)
    cache = {"TORCHDELEGATE_CACHE": str(directory / "machine-cache")}
    ours = data["lower"]["torchdelegate"]["path"]
    data["prepare"] = measure(
        [*SIDES["torchdelegate"], "prepare", "--side", "torchdelegate", "--file", ours], env=cache
    )
    print(f"  prepared torchdelegate: {data['prepare']['prepare_s']:.0f} s", file=sys.stderr, flush=True)
    for index in range(rounds):
        for run, (side, cached) in RUNS.items():
            path = data["lower"][side]["path"]
            env = cache if cached else {"TORCHDELEGATE_CACHE": "off"}
            command = [*SIDES[side], "run", "--side", side, "--size", size, "--file", path, *checked]
            data["run"][run].append(measure(command, env=env))
        print(f"  run round {index + 1}/{rounds} done", file=sys.stderr, flush=True)
    for figures in data["lower"].values():
        figures.pop("path")
    return data


def weights_of(data: dict[str, Any]) -> int:
    return int(data["lower"]["torchdelegate"]["weights"])


def _median(runs: list[dict[str, Any]], key: str) -> float:
    return statistics.median(run[key] for run in runs)


def rows(data: dict[str, Any]) -> list[tuple[str, float, float, str]]:
    """(row, ours, ExecuTorch's, unit) for the table; memory as multiples of the weights."""
    weights = weights_of(data)
    lower, run = data["lower"], data["run"]

    def both(figure: Any) -> tuple[float, float]:
        return figure("torchdelegate"), figure("executorch")

    table = [
        ("lowering + save (s)", *both(lambda s: lower[s]["lower_save_s"]), "s"),
        ("peak RSS growth during export ÷ weights", *both(lambda s: lower[s]["peak_growth"]["export"] / weights), "×"),
        (
            "peak RSS growth during lower + save ÷ weights",
            *both(lambda s: lower[s]["lower_save_peak_growth"] / weights),
            "×",
        ),
        (
            "peak RSS growth during export + lower + save ÷ weights",
            *both(lambda s: max(lower[s]["peak_growth"].values()) / weights),
            "×",
        ),
        ("file ÷ weights", *both(lambda s: lower[s]["file_bytes"] / weights), "×"),
        ("fresh process: load + first prefill (ms)", *both(lambda s: _median(run[s], "load_first_prefill_ms")), "ms"),
        ("warm prefill, 32 tokens (ms)", *both(lambda s: _median(run[s], "warm_prefill_ms")), "ms"),
        ("decode, one token (ms, median of 40)", *both(lambda s: _median(run[s], "decode_ms")), "ms"),
        (
            "RSS growth after loading and running both methods ÷ weights",
            *both(lambda s: _median(run[s], "rss_growth") / weights),
            "×",
        ),
        (
            "PSS growth after loading and running both methods ÷ weights",
            *both(lambda s: _median(run[s], "pss_growth") / weights),
            "×",
        ),
        (
            "anonymous memory growth after running both ÷ weights",
            *both(lambda s: _median(run[s], "anonymous_growth") / weights),
            "×",
        ),
        (
            "prepared (ours): fresh process: load + first prefill (ms)",
            _median(run["prepared"], "load_first_prefill_ms"),
            _median(run["executorch"], "load_first_prefill_ms"),
            "ms",
        ),
        (
            "prepared (ours): anonymous memory growth after running both ÷ weights",
            _median(run["prepared"], "anonymous_growth") / weights,
            _median(run["executorch"], "anonymous_growth") / weights,
            "×",
        ),
        (
            "prepared (ours): RSS growth after running both ÷ weights",
            _median(run["prepared"], "rss_growth") / weights,
            _median(run["executorch"], "rss_growth") / weights,
            "×",
        ),
    ]
    if data.get("quantize"):
        quantized = int(data["lower"]["torchdelegate"]["quantized_weights"])
        table += [
            (
                "RSS growth after running both ÷ quantized weights",
                *both(lambda s: _median(run[s], "rss_growth") / quantized),
                "×",
            ),
            (
                "top-1 agreement with fp32 (prompt + 48 decode steps)",
                *both(lambda s: _median(run[s], "top1_agreement")),
                "×",
            ),
            ("mean |logit error| against fp32", *both(lambda s: _median(run[s], "mean_logit_error")), "×"),
            ("largest |logit error| against fp32", *both(lambda s: _median(run[s], "max_logit_error")), "×"),
        ]
    return table


def targets(data: dict[str, Any]) -> list[tuple[str, str, bool]]:
    """The issue's figures: (target, measured, met)."""
    if data.get("quantize"):
        return quantized_targets(data)
    table = {name: (ours, theirs) for name, ours, theirs, _ in rows(data)}
    lower_peak = table["peak RSS growth during lower + save ÷ weights"][0]
    resident = table["RSS growth after loading and running both methods ÷ weights"][0]
    cold = table["fresh process: load + first prefill (ms)"]
    decode = table["decode, one token (ms, median of 40)"]
    prefill = table["warm prefill, 32 tokens (ms)"]
    file_ratio = table["file ÷ weights"][0]
    return [
        ("peak RSS growth during lower + save ≤ 0.25 × weights", f"{lower_peak:.2f}", lower_peak <= 0.25),
        ("RSS growth after running both methods ≤ 1.2 × weights", f"{resident:.2f}", resident <= 1.2),
        ("load + first prefill ≤ 2 × ExecuTorch's", f"{cold[0] / cold[1]:.2f} ×", cold[0] <= 2 * cold[1]),
        ("decode ≤ 0.9 × ExecuTorch's", f"{decode[0] / decode[1]:.2f} ×", decode[0] <= 0.9 * decode[1]),
        ("warm prefill ≤ 0.8 × ExecuTorch's", f"{prefill[0] / prefill[1]:.2f} ×", prefill[0] <= 0.8 * prefill[1]),
        ("file ≤ 1.01 × weights", f"{file_ratio:.4f}", file_ratio <= 1.01),
    ]


def quantized_targets(data: dict[str, Any]) -> list[tuple[str, str, bool]]:
    """The quantized issue's figures, against ExecuTorch's 8da4w in the same run."""
    table = {name: (ours, theirs) for name, ours, theirs, _ in rows(data)}
    decode = table["decode, one token (ms, median of 40)"]
    prefill = table["warm prefill, 32 tokens (ms)"]
    top1 = table["top-1 agreement with fp32 (prompt + 48 decode steps)"]
    error = table["mean |logit error| against fp32"]
    files = table["file ÷ weights"]
    resident = table["RSS growth after running both ÷ quantized weights"][0]
    return [
        ("decode ≤ 0.9 × ExecuTorch's", f"{decode[0] / decode[1]:.2f} ×", decode[0] <= 0.9 * decode[1]),
        ("warm prefill ≤ 0.9 × ExecuTorch's", f"{prefill[0] / prefill[1]:.2f} ×", prefill[0] <= 0.9 * prefill[1]),
        ("top-1 agreement ≥ ExecuTorch's", f"{top1[0]:.3f} vs {top1[1]:.3f}", top1[0] >= top1[1]),
        ("mean logit error ≤ ExecuTorch's", f"{error[0]:.3f} vs {error[1]:.3f}", error[0] <= error[1]),
        ("file ≤ ExecuTorch's", f"{files[0] / files[1]:.4f} ×", files[0] <= files[1]),
        ("RSS after both methods ≤ 1.2 × quantized weights", f"{resident:.2f}", resident <= 1.2),
    ]


def plot(data: dict[str, Any], path: Path) -> None:
    """Each row as ours ÷ ExecuTorch's (log scale): left of 1 is better."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = rows(data)
    figure, axes = plt.subplots(figsize=(9, 0.45 * len(table) + 1.2))
    ratios = [ours / theirs if theirs else float("nan") for _, ours, theirs, _ in table]
    axes.barh([name for name, *_ in table], ratios, color=["tab:green" if r <= 1 else "tab:red" for r in ratios])
    axes.axvline(1.0, color="black", linewidth=1)
    axes.set_xscale("log")
    axes.invert_yaxis()
    axes.set_xlabel("torchdelegate ÷ ExecuTorch + XNNPACK (lower is better)")
    axes.set_title(f"Llama {data['size']}: {data['lower']['torchdelegate']['weights'] / 1e6:.0f} MB of weights")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def write_page(data: dict[str, Any], directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    stem = f"{data['date']}-llm-{data['size']}" + (f"-{data['quantize']}" if data.get("quantize") else "")
    plot(data, directory / f"{stem}.png")
    lines = [
        f"# An LLM lowered and run by torchdelegate and ExecuTorch — {data['date']}, size {data['size']}"
        + (f", quantized {data['quantize']} (torchao) on both sides" if data.get("quantize") else ""),
        "",
        machine_line(data["machine"]),
        "",
        f"Written by `{data['command']}`; the data is in `{stem}.json`. One lowering per side, then "
        f"{len(data['run']['torchdelegate'])} alternating rounds of a fresh process per side loading its file and "
        f"running both methods; run figures are medians over rounds. Export is "
        f"{'strict (dynamo), as transformers exports' if data['strict'] else 'non-strict'}; growth during lower + "
        "save is counted from after export (its garbage collected). Rows marked *prepared* run our file after "
        f"`torchdelegate prepare` on this machine ({data['prepare']['prepare_s']:.1f} s, once; the machine cache "
        f"then held {data['prepare']['cache_bytes'] / weights_of(data):.2f} × the weights); the other rows of ours "
        "run without the machine cache.",
        "",
        "| | " + " | ".join(NAMES.values()) + " | ours ÷ theirs |",
        "|---|---|---|---|",
    ]
    for name, ours, theirs, unit in rows(data):
        precise = name.startswith(("file", "top-1", "mean |", "largest |"))
        digits = ".4f" if precise else (".2f" if unit == "×" else ".1f")
        lines.append(f"| {name} | {ours:{digits}} | {theirs:{digits}} | {ours / theirs:.2f} |")
    lines += [
        "",
        "## Targets",
        "",
        *targets_table(targets(data)),
        "",
        f"![ours ÷ ExecuTorch's]({stem}.png)",
        "",
    ]
    return written(directory, stem, data, lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=["base", "large"], default="base")
    parser.add_argument("--rounds", type=int, default=3, help="alternating load + run rounds")
    parser.add_argument("--non-strict", dest="strict", action="store_false", help="export without dynamo")
    parser.add_argument("--quantize", choices=["8da4w"], help="both sides lower the model quantized by this recipe")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args()
    if not EXECUTORCH_PYTHON.exists():
        sys.exit(f"{EXECUTORCH_PYTHON} is missing: `make bench` creates it")
    data: dict[str, Any] = {"date": datetime.date.today().isoformat(), "command": " ".join(sys.argv)}
    data |= {"size": args.size, "strict": args.strict, "quantize": args.quantize, "machine": machine()}
    with tempfile.TemporaryDirectory() as directory:
        data |= collect(args.size, args.rounds, args.strict, args.quantize, Path(directory))
    print(write_page(data, args.out).read_text())


if __name__ == "__main__":
    main()
