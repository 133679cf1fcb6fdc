"""``torchdelegate llm generate`` on benchmarks/llm.py's 200M Llama against ExecuTorch's Python loop.

The model (``llm_side.llama("base")``, random weights, no stop token) is saved as a transformers
checkpoint beside a byte-level BPE tokenizer trained on ``training/botchan.txt``. For fp32 and
8da4w: ours is ``torchdelegate llm export`` with its defaults then ``torchdelegate llm generate``
(the command as a user runs it; its own time to first token and decode rate), ExecuTorch's is
``llm_side.py lower --side executorch`` (the same weights, XNNPACK) then a runner-free greedy loop
in Python over its methods (``llm_side.py generate``). The same loop over our file is shown too. Every run is a
fresh process; ``--rounds`` rounds alternate the sides; figures are medians. The prompt is 32
tokens, the length ExecuTorch's prefill is exported for, and 64 tokens are generated.

Also measured, in this process: the generation loop's overhead per token over ``Program.run``
alone, on a tiny Llama (where a token costs little else): ``Generator`` decoding 200 tokens
against 200 bare ``run("decode", ...)`` calls, medians of 5 alternating repetitions.

    python benchmarks/llm_generate.py [--rounds 3] [--recipes fp32 8da4w]
    python benchmarks/llm_generate.py checkpoint DIR      (a phase: writes the checkpoint)
    python benchmarks/llm_generate.py eager DIR RECIPE IDS   (a phase: transformers' greedy tokens)
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from compare import EXECUTORCH_PYTHON, machine, measure
from results import machine_line, written

HERE = Path(__file__).resolve().parent
TEXT = HERE.parent / "training" / "botchan.txt"
PROMPT_TOKENS, NEW_TOKENS, CACHE = 32, 64, 128
OURS = [str(Path(sys.executable).parent / "torchdelegate")]
SIDE = str(HERE / "llm_side.py")


def write_checkpoint(directory: Path) -> dict[str, Any]:
    """The 200M Llama with save_pretrained, and a tokenizer of 2,000 tokens trained on the novel."""
    import torch
    from llm_side import llama
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    model = llama("base")
    model.generation_config.eos_token_id = None  # random weights: no stop token, every run the same length
    model.config.eos_token_id = None
    with torch.no_grad():
        model.save_pretrained(directory)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=2000, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(TEXT.read_text().splitlines(), trainer)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer).save_pretrained(directory)
    return {"checkpoint_bytes": sum(p.stat().st_size for p in directory.iterdir())}


def eager_tokens(directory: Path, recipe: str, ids: list[int]) -> dict[str, Any]:
    """transformers' greedy tokens from the checkpoint in eager torch (torchao's recipe applied for 8da4w)."""
    import torch
    from llm_side import quantized
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    if recipe != "fp32":
        model = quantized(model, recipe)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    return {"tokens": out[0, len(ids) :].tolist()}


def prompt(directory: Path) -> tuple[str, list[int]]:
    """A passage of the novel that the tokenizer reads as exactly ``PROMPT_TOKENS`` tokens."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    words = TEXT.read_text().split()[200:]
    for count in range(8, 64):
        text = " ".join(words[:count])
        ids = tokenizer.encode(text).ids
        if len(ids) == PROMPT_TOKENS:
            return text, ids
    raise RuntimeError("no passage of 32 tokens")


def lower(directory: Path, recipe: str) -> dict[str, dict[str, Any]]:
    """Each side's file of ``recipe``: ours with ``llm export``, ExecuTorch's with llm_side.py."""
    quantize = [] if recipe == "fp32" else ["--quantize", recipe]
    ours = directory / f"ours-{recipe}.tdp"
    started = time.perf_counter()
    command = [*OURS, "llm", "export", str(directory / "checkpoint"), "-o", str(ours)]  # its defaults
    subprocess.run([*command, *quantize], check=True, capture_output=True, timeout=3600)
    seconds = time.perf_counter() - started
    theirs = directory / f"executorch-{recipe}.pte"
    figures = measure([str(EXECUTORCH_PYTHON), SIDE, "lower", "--side", "executorch", "--out", str(theirs), *quantize])
    return {
        "torchdelegate": {"path": str(ours), "lower_save_s": seconds, "file_bytes": ours.stat().st_size},
        "executorch": {
            "path": str(theirs),
            "lower_save_s": figures["export_s"] + figures["lower_save_s"],
            "file_bytes": figures["file_bytes"],
        },
    }


def llm_generate(path: str, text: str) -> dict[str, Any]:
    """``torchdelegate llm generate`` as a user runs it: its own figures, read from what it prints."""
    command = [*OURS, "llm", "generate", path, "--prompt", text, "--max-new-tokens", str(NEW_TOKENS), "--ids"]
    started = time.perf_counter()
    done = subprocess.run(command, check=True, capture_output=True, text=True, timeout=600)
    wall = time.perf_counter() - started
    ids = re.search(r"token ids: \[([0-9, ]*)\]", done.stdout)
    figures = re.search(
        r"time to first token ([0-9.]+) ms; prompt [0-9]+ tokens/s, generation ([0-9.]+) tokens/s", done.stdout
    )
    if ids is None or figures is None:
        raise RuntimeError(f"llm generate printed no figures:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return {
        "time_to_first_token_ms": float(figures.group(1)),
        "decode_tokens_per_s": float(figures.group(2)),
        "command_s": wall,
        "tokens": [int(t) for t in ids.group(1).split(", ")],
    }


def python_loop(side: str, path: str, ids: list[int]) -> dict[str, Any]:
    python = str(EXECUTORCH_PYTHON) if side == "executorch" else sys.executable
    command = [python, SIDE, "generate", "--side", side, "--file", path, "--prompt-ids", json.dumps(ids)]
    return measure([*command, "--new-tokens", str(NEW_TOKENS)])


def loop_overhead(repeats: int = 5, tokens: int = 200) -> dict[str, float]:
    """Microseconds per token that ``Generator`` adds to the ``run("decode", ...)`` calls it makes."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import torchdelegate as td
    from torchdelegate.backends.onnxruntime import OnnxRuntimePartitioner
    from torchdelegate.backends.reference import ReferencePartitioner
    from torchdelegate.llm import Generator
    from torchdelegate.llm.checkpoint import export_methods

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=512, max_position_embeddings=512, eos_token_id=None,
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    cache = tokens + 16
    programs = export_methods(model, cache, None)
    partitioners = [OnnxRuntimePartitioner(), ReferencePartitioner()]
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "tiny.tdp"
        td.to_edge_transform_and_lower(programs, partitioner=partitioners).save(path)
        with td.load(path) as program, torch.no_grad():
            generator = Generator(program, max_positions=cache)
            prompt = list(range(3, 11))
            calls = [(torch.tensor([[5 + i % 100]]), torch.tensor([len(prompt) + i])) for i in range(tokens)]
            bare, looped = [], []
            for _ in range(repeats):
                started = time.perf_counter()
                for ids, position in calls:
                    program.run("decode", input_ids=ids, cache_position=position)
                bare.append((time.perf_counter() - started) / tokens)
                stats = generator.generate(prompt, tokens + 1).stats
                looped.append(stats.decode_time / tokens)
    return {
        "run_us": statistics.median(bare) * 1e6,
        "generator_us": statistics.median(looped) * 1e6,
        "overhead_us": (statistics.median(looped) - statistics.median(bare)) * 1e6,
    }


def collect(rounds: int, recipes: list[str], directory: Path) -> dict[str, Any]:
    measure([sys.executable, __file__, "checkpoint", str(directory / "checkpoint")])
    text, ids = prompt(directory / "checkpoint")
    data: dict[str, Any] = {"prompt": text, "prompt_ids": ids, "lower": {}, "runs": {}}
    data["eager"] = {}
    for recipe in recipes:
        command = [sys.executable, __file__, "eager", str(directory / "checkpoint"), recipe, json.dumps(ids)]
        data["eager"][recipe] = measure(command)["tokens"]
        data["lower"][recipe] = lower(directory, recipe)
        print(f"  lowered {recipe}", file=sys.stderr, flush=True)
    for index in range(rounds):
        for recipe in recipes:
            files = data["lower"][recipe]
            runs = data["runs"].setdefault(recipe, {"llm generate": [], "ours, Python loop": [], "executorch": []})
            runs["llm generate"].append(llm_generate(files["torchdelegate"]["path"], text))
            runs["executorch"].append(python_loop("executorch", files["executorch"]["path"], ids))
            runs["ours, Python loop"].append(python_loop("torchdelegate", files["torchdelegate"]["path"], ids))
        print(f"  round {index + 1}/{rounds} done", file=sys.stderr, flush=True)
    data["loop_overhead"] = loop_overhead()
    for files in data["lower"].values():
        for side in files.values():
            side.pop("path")
    return data


def _median(runs: list[dict[str, Any]], key: str) -> float:
    return statistics.median(run[key] for run in runs)


def page(data: dict[str, Any]) -> list[str]:
    lines = [
        f"# `llm generate` on the 200M Llama against ExecuTorch's Python loop, {data['date']}",
        "",
        machine_line(data["machine"]),
        "",
        f"Prompt: {PROMPT_TOKENS} tokens; {NEW_TOKENS} tokens generated, greedy. Ours: `llm export`'s defaults "
        f"(a 256-position cache, a prefill of any length); ExecuTorch's: a {CACHE}-position cache, a prefill of "
        f"{PROMPT_TOKENS} tokens. "
        f"Medians of {data['rounds']} rounds, each run a fresh process, sides alternating.",
        "",
        "| recipe | figure | `llm generate` (ours) | our file, Python loop | ExecuTorch + XNNPACK, Python loop "
        "| `llm generate` ÷ ExecuTorch |",
        "|---|---|---|---|---|---|",
    ]
    for recipe, runs in data["runs"].items():
        files = data["lower"][recipe]
        for figure, key in (
            ("time to first token (ms)", "time_to_first_token_ms"),
            ("decode tokens/s", "decode_tokens_per_s"),
        ):
            ours, loop, theirs = (_median(runs[k], key) for k in ("llm generate", "ours, Python loop", "executorch"))
            lines.append(f"| {recipe} | {figure} | {ours:.1f} | {loop:.1f} | {theirs:.1f} | {ours / theirs:.2f} |")
        sizes = files["torchdelegate"]["file_bytes"], files["executorch"]["file_bytes"]
        lines.append(
            f"| {recipe} | file (MB) | {sizes[0] / 1e6:.1f} | | {sizes[1] / 1e6:.1f} | {sizes[0] / sizes[1]:.3f} |"
        )
        seconds = files["torchdelegate"]["lower_save_s"], files["executorch"]["lower_save_s"]
        row = f"| {recipe} | export + lower + save (s) | {seconds[0]:.0f} | | {seconds[1]:.0f} |"
        lines.append(f"{row} {seconds[0] / seconds[1]:.2f} |")
        loads = (_median(runs[k], "load_ms") for k in ("ours, Python loop", "executorch"))
        lines.append("| {} | load + initialize (ms) | | {:.0f} | {:.0f} | |".format(recipe, *loads))
        eager = data["eager"][recipe]
        agree = [
            sum(a == b for a, b in zip(runs[k][0]["tokens"], eager, strict=True))
            for k in ("llm generate", "ours, Python loop", "executorch")
        ]
        lines.append(
            f"| {recipe} | greedy tokens equal to eager transformers' | {agree[0]} of {NEW_TOKENS} | {agree[1]} "
            f"| {agree[2]} | |"
        )
    overhead = data["loop_overhead"]
    lines += [
        "",
        f"Generation loop overhead per token (tiny Llama, 200 tokens, medians of 5): `Generator` "
        f"{overhead['generator_us']:.1f} µs against `Program.run` alone {overhead['run_us']:.1f} µs: "
        f"**{overhead['overhead_us']:.1f} µs** (target ≤ 50).",
        "",
        "`llm generate`'s time to first token counts from the call to generate to the first token chosen "
        "(tokenizing the prompt is not counted, nor loading the file and initializing its delegates, which "
        "`llm generate` does first); the Python loops' counts the prefill call and its argmax, after loading "
        "and initializing (ExecuTorch's `load_method`, our `Program.initialize`). Decode tokens/s counts the "
        "tokens after the first. Eager transformers' tokens: `generate` on the checkpoint (8da4w: after "
        "torchao's `quantize_` with the same recipe).",
    ]
    return lines


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "checkpoint":
        print(json.dumps(write_checkpoint(Path(sys.argv[2]))))
        return
    if len(sys.argv) == 5 and sys.argv[1] == "eager":
        print(json.dumps(eager_tokens(Path(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4]))))
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--recipes", nargs="+", choices=["fp32", "8da4w"], default=["fp32", "8da4w"])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="llm-generate-") as scratch:
        data = collect(args.rounds, args.recipes, Path(scratch))
    data.update(date=datetime.date.today().isoformat(), machine=machine(), rounds=args.rounds)
    results = HERE / "results"
    path = written(results, f"{data['date']}-llm-generate-base", data, page(data))
    print(path.read_text())


if __name__ == "__main__":
    main()
