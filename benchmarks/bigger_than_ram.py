"""Models bigger than the machine: a random-weight Llama-3.1-8B-shaped checkpoint exported, quantized,
lowered and run on this machine, and the 1.1B (TinyLlama's shape) beside ExecuTorch's llama flow.

``make bench BIG=1`` runs it (it writes ~16 GB of checkpoint and ~5 GB of program). The checkpoint
(hidden 4096, 32 layers, 32 heads, 8 KV heads, MLP 14336, vocab 128256, bfloat16, safetensors shards
of at most 5 GB, the demo's byte tokenizer; nothing downloaded) is written tensor by tensor, never
held in memory. Then, each a fresh process under ``/usr/bin/time -v`` with its anonymous memory
sampled every 20 ms:

- ``torchdelegate llm export CKPT -o F --quantize`` (the default 4-bit recipe, defaults otherwise): wall time, peak
  RSS, peak anonymous memory, file size;
- ``torchdelegate llm generate F --prompt TEXT --max-new-tokens N``: its time to first token and
  speeds, peak RSS against the file's size; the machine's memory bandwidth measured in the same run
  (``llm_race.py bandwidth``) over the bytes a token reads (the file less its int8 token embedding,
  of which a token reads one row) bounds the speed;
- the same export at 1.1B, fp32 (no flags) and ``--quantize``, from a fp32 checkpoint, and
  ExecuTorch 1.5.1's documented llama export (``export_llm``) of that checkpoint where it fits.

Writes ``benchmarks/results/<date>-bigger-than-ram.md`` and ``.json``.

    python benchmarks/bigger_than_ram.py [--work DIR] [--skip-8b] [--skip-executorch]
    python benchmarks/bigger_than_ram.py checkpoint DIR SHAPE DTYPE   (a phase: writes a checkpoint)
    python benchmarks/bigger_than_ram.py page JSON                      (the page again from a run's data)
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from compare import machine
from instruments import descendants, processes_bytes
from llm_race import bandwidth, wait_idle
from results import machine_line, targets_table, written

HERE = Path(__file__).resolve().parent
OURS = str(Path(sys.executable).parent / "torchdelegate")
SHARD_BYTES = 5 * 10**9
SHAPES = {
    "8b": {
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 14336,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rms_norm_eps": 1e-5,
    },
    "1.1b": {
        "hidden_size": 2048,
        "num_hidden_layers": 22,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "intermediate_size": 5632,
        "vocab_size": 32000,
        "max_position_embeddings": 2048,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-5,
    },
}
PROMPT = "It was the best of times, it was the worst of times, it was the age of wisdom"
NEW_TOKENS = 32

# ---------------------------------------------------------------- the checkpoint, written tensor by tensor


def tensor_names(shape: dict[str, Any]) -> list[tuple[str, list[int]]]:
    """A LlamaForCausalLM's tensors in the order save_pretrained writes them, with their shapes."""
    hidden, mlp, vocab = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    kv = hidden // shape["num_attention_heads"] * shape["num_key_value_heads"]
    names = [("model.embed_tokens.weight", [vocab, hidden])]
    for i in range(shape["num_hidden_layers"]):
        layer = f"model.layers.{i}"
        names += [
            (f"{layer}.input_layernorm.weight", [hidden]),
            (f"{layer}.self_attn.q_proj.weight", [hidden, hidden]),
            (f"{layer}.self_attn.k_proj.weight", [kv, hidden]),
            (f"{layer}.self_attn.v_proj.weight", [kv, hidden]),
            (f"{layer}.self_attn.o_proj.weight", [hidden, hidden]),
            (f"{layer}.post_attention_layernorm.weight", [hidden]),
            (f"{layer}.mlp.gate_proj.weight", [mlp, hidden]),
            (f"{layer}.mlp.up_proj.weight", [mlp, hidden]),
            (f"{layer}.mlp.down_proj.weight", [hidden, mlp]),
        ]
    return [*names, ("model.norm.weight", [hidden]), ("lm_head.weight", [vocab, hidden])]


def write_checkpoint(
    directory: Path, shape_name: str | dict[str, Any], dtype_name: str, shard_bytes: int = SHARD_BYTES
) -> dict[str, Any]:
    """A random-weight Llama of ``shape_name`` (or that shape) in ``dtype_name`` (bfloat16, float32) as
    safetensors shards of at most ``shard_bytes``, written a slice at a time (a few MB in memory), with
    its config, no stop token, and the demo's byte tokenizer."""
    import torch
    from transformers import GenerationConfig, LlamaConfig

    from torchdelegate.demo.gpt2_checkpoint import byte_tokenizer

    shape = SHAPES[shape_name] if isinstance(shape_name, str) else shape_name
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype_name]
    code = {"bfloat16": "BF16", "float32": "F32"}[dtype_name]
    size = torch.empty((), dtype=dtype).element_size()
    directory.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(**shape, tie_word_embeddings=False, bos_token_id=1, eos_token_id=None, dtype=dtype_name)
    config.save_pretrained(directory)
    GenerationConfig(bos_token_id=1, eos_token_id=None).save_pretrained(directory)
    byte_tokenizer().save(str(directory / "tokenizer.json"))
    shards: list[list[tuple[str, list[int]]]] = [[]]
    held = 0
    for name, dims in tensor_names(shape):
        nbytes = size * _count(dims)
        if shards[-1] and held + nbytes > shard_bytes:
            shards.append([])
            held = 0
        shards[-1].append((name, dims))
        held += nbytes
    generator = torch.Generator().manual_seed(0)
    weight_map = {}
    for number, shard in enumerate(shards, 1):
        file = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        _write_shard(directory / file, shard, dtype, code, generator)
        weight_map.update({name: file for name, _ in shard})
    total = sum(size * _count(dims) for shard in shards for _, dims in shard)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    parameters = sum(_count(dims) for _, dims in tensor_names(shape))
    return {"bytes": total, "parameters": parameters, "shards": len(shards), "dtype": dtype_name}


def _count(dims: list[int]) -> int:
    count = 1
    for n in dims:
        count *= n
    return count


def _write_shard(path: Path, shard: list[tuple[str, list[int]]], dtype: Any, code: str, generator: Any) -> None:
    import torch

    size = torch.empty((), dtype=dtype).element_size()
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, dims in shard:
        header[name] = {"dtype": code, "shape": dims, "data_offsets": [offset, offset + size * _count(dims)]}
        offset += size * _count(dims)
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    with path.open("wb") as out:
        out.write(len(encoded).to_bytes(8, "little"))
        out.write(encoded)
        for name, dims in shard:
            count = _count(dims)
            if name.endswith("norm.weight"):
                out.write(torch.ones(count, dtype=dtype).view(torch.uint8).numpy().tobytes())
                continue
            for start in range(0, count, 1 << 24):
                values = torch.randn(min(1 << 24, count - start), generator=generator) * 0.02
                out.write(values.to(dtype).view(torch.uint8).numpy().tobytes())


# ---------------------------------------------------------------- measuring a command


def measured(command: list[str], timeout: float) -> dict[str, Any]:
    """``command`` under ``/usr/bin/time -v``: stdout, wall seconds, peak RSS, and the peak anonymous
    memory of its processes, sampled every 20 ms from /proc."""
    started = time.perf_counter()
    process = subprocess.Popen(
        ["/usr/bin/time", "-v", *command], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=HERE
    )
    peak = [0]
    done = threading.Event()

    def sample() -> None:
        pids, listed = [process.pid], time.perf_counter()
        while not done.wait(0.02):
            if time.perf_counter() - listed > 1.0:  # the process tree, listed once a second
                pids, listed = descendants(process.pid), time.perf_counter()
            peak[0] = max(peak[0], processes_bytes(pids, "status", "RssAnon:"))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    stdout, stderr = process.communicate(timeout=timeout)
    done.set()
    sampler.join()
    wall = time.perf_counter() - started
    if process.returncode:
        raise RuntimeError(f"{' '.join(command)} failed ({process.returncode}):\n{stdout[-3000:]}\n{stderr[-5000:]}")
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", stderr)
    return {
        "stdout": stdout,
        "wall_s": wall,
        "peak_rss_bytes": int(rss.group(1)) * 1024 if rss else None,
        "peak_anonymous_bytes": peak[0],
    }


def parse_generate(stdout: str) -> dict[str, Any]:
    found = re.search(
        r"time to first token ([0-9.]+) ms; prompt ([0-9.]+) tokens/s, generation ([0-9.]+) tokens/s", stdout
    )
    if found is None:
        raise RuntimeError(f"llm generate printed no speeds:\n{stdout[-2000:]}")
    return {"first_token_ms": float(found[1]), "prompt_tps": float(found[2]), "decode_tps": float(found[3])}


# ---------------------------------------------------------------- the run


class Run:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.work = args, Path(args.work)
        self.work.mkdir(parents=True, exist_ok=True)
        self.data: dict[str, Any] = {"machine": machine(), "runs": {}}

    def phase(self, name: str, command: list[str], timeout: float = 4 * 3600) -> dict[str, Any]:
        idle = wait_idle(self.args.idle_wait)
        print(f"{name}: {' '.join(command)}", flush=True)
        figures = measured(command, timeout)
        figures["idle_before"] = idle
        self.data["runs"][name] = figures
        print(
            f"  {figures['wall_s']:.0f} s, peak RSS {figures['peak_rss_bytes'] / 1e9:.2f} GB, "
            f"peak anonymous {figures['peak_anonymous_bytes'] / 1e9:.2f} GB",
            flush=True,
        )
        return figures

    def checkpoint(self, shape: str, dtype: str) -> Path:
        directory = self.work / f"checkpoint-{shape}-{dtype}"
        single = directory / "model.safetensors"
        if single.is_file():  # a checkpoint save_pretrained wrote (llm_race.py's, say), put here
            self.data.setdefault("checkpoints", {})[shape] = {"bytes": single.stat().st_size, "dtype": dtype}
            return directory
        if not (directory / "model.safetensors.index.json").is_file():
            figures = self.phase(
                f"write {shape} {dtype}", [sys.executable, __file__, "checkpoint", str(directory), shape, dtype]
            )
            figures["checkpoint"] = json.loads(figures["stdout"].strip().splitlines()[-1])
        index = json.loads((directory / "model.safetensors.index.json").read_text())
        self.data.setdefault("checkpoints", {})[shape] = {"bytes": index["metadata"]["total_size"], "dtype": dtype}
        return directory

    def export(self, name: str, checkpoint: Path, flags: list[str], keep: bool = False) -> Path:
        output = self.work / f"{name}.tdp"
        figures = self.phase(f"export {name}", [OURS, "llm", "export", str(checkpoint), "-o", str(output), *flags])
        figures["file_bytes"] = output.stat().st_size
        if not keep:
            output.unlink()  # the disk is for the 8B model's files
        return output

    def generate(self, name: str, program: Path) -> dict[str, Any]:
        command = [OURS, "llm", "generate", str(program), "--prompt", PROMPT, "--max-new-tokens", str(NEW_TOKENS)]
        figures = self.phase(f"generate {name}", command)
        figures.update(parse_generate(figures["stdout"]))
        return figures

    def executorch(self, name: str, checkpoint: Path, quantize: bool) -> None:
        command = [self.args.executorch_python, str(HERE / "executorch_llama_flow.py"), str(checkpoint)]
        command += [str(self.work / f"{name}.pte"), "--quantize" if quantize else "--float"]
        try:
            figures = self.phase(f"executorch {name}", command)
            figures["file_bytes"] = json.loads(figures["stdout"].strip().splitlines()[-1])["file_bytes"]
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            self.data["runs"][f"executorch {name}"] = {"failed": str(e)[-2000:]}
        (self.work / f"{name}.pte").unlink(missing_ok=True)

    def __call__(self) -> None:
        args = self.args
        large = self.checkpoint("1.1b", "float32")
        self.export("1.1b-fp32", large, [])
        self.export("1.1b-4bit", large, ["--quantize"])
        if not args.skip_executorch:
            self.executorch("1.1b-fp32", large, False)
            if not args.skip_executorch_8da4w:
                self.executorch("1.1b-8da4w", large, True)
        if not args.skip_8b:
            big = self.checkpoint("8b", "bfloat16")
            program = self.export("8b-4bit", big, ["--quantize"], keep=True)
            self.data["bandwidth"] = bandwidth()
            self.generate("8b-4bit", program)
        self.data["date"] = datetime.date.today().isoformat()


def page(data: dict[str, Any]) -> list[str]:
    runs = data["runs"]
    lines = [f"# Models bigger than the machine — {data['date']}", "", machine_line(data["machine"]), ""]
    lines += ["| run | wall s | peak RSS GB | peak anonymous GB | file GB |", "|---|---|---|---|---|"]
    for name, run in runs.items():
        if "failed" in run:
            lines.append(f"| {name} | failed: {run['failed'].splitlines()[-1][:100]} | | | |")
            continue
        size = f"{run['file_bytes'] / 1e9:.2f}" if "file_bytes" in run else ""
        lines.append(
            f"| {name} | {run['wall_s']:.0f} | {run['peak_rss_bytes'] / 1e9:.2f} | "
            f"{run['peak_anonymous_bytes'] / 1e9:.2f} | {size} |"
        )
    rows = []
    checkpoints = data.get("checkpoints", {})
    if "export 1.1b-fp32" in runs and "1.1b" in checkpoints:
        weights = checkpoints["1.1b"]["bytes"]
        growth = runs["export 1.1b-fp32"]["peak_rss_bytes"] - BASELINE_RSS
        rows.append(
            (
                "1.1B fp32 export: peak RSS growth ≤ 0.25 × weights",
                f"{growth / weights:.2f} ×",
                growth <= 0.25 * weights,
            )
        )
    if "export 8b-4bit" in runs:
        peak = runs["export 8b-4bit"]["peak_rss_bytes"]
        rows.append(
            ("8B bf16 → 4-bit (the default recipe) export: peak RSS ≤ 3 GB", f"{peak / 1e9:.2f} GB", peak <= 3e9)
        )
    if "generate 8b-4bit" in runs:
        run, file_bytes = runs["generate 8b-4bit"], runs["export 8b-4bit"]["file_bytes"]
        ratio = run["peak_rss_bytes"] / file_bytes
        rows.append(("8B generation: peak RSS ≤ 1.15 × the file", f"{ratio:.2f} ×", ratio <= 1.15))
        shape = SHAPES["8b"]
        embedding = shape["vocab_size"] * shape["hidden_size"]  # int8, llm export --quantize's default; a row read
        bound = data["bandwidth"]["bytes_per_s"] / (file_bytes - embedding)
        rows.append(
            (
                "8B decode within 1.5 × of the bandwidth bound",
                f"{run['decode_tps']:.2f} tokens/s; bound {bound:.2f} ({bound / run['decode_tps']:.2f} ×)",
                bound / run["decode_tps"] <= 1.5,
            )
        )
    lines += ["", *targets_table(rows)]
    return lines


BASELINE_RSS = 0
"""Peak RSS growth is measured from zero: the whole process counts."""


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "page":
        data = json.loads(Path(sys.argv[2]).read_text())
        print(written(Path(sys.argv[2]).parent, Path(sys.argv[2]).stem, data, page(data)).read_text())
        return
    if len(sys.argv) > 1 and sys.argv[1] == "checkpoint":
        print(json.dumps(write_checkpoint(Path(sys.argv[2]), sys.argv[3], sys.argv[4])))
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", default=str(Path.home() / ".cache" / "torchdelegate-bigger-than-ram"))
    parser.add_argument("--skip-8b", action="store_true", help="only the 1.1B exports")
    parser.add_argument("--skip-executorch", action="store_true")
    parser.add_argument(
        "--skip-executorch-8da4w", action="store_true", help="ExecuTorch's fp32 export only (its 8da4w takes longest)"
    )
    parser.add_argument("--executorch-python", default=str(HERE.parent / ".venv-executorch" / "bin" / "python"))
    parser.add_argument("--idle-wait", type=float, default=120.0)
    args = parser.parse_args()
    run = Run(args)
    run()
    stem = f"{run.data['date']}-bigger-than-ram"
    path = written(HERE / "results", stem, run.data, page(run.data))
    print(path.read_text())


if __name__ == "__main__":
    main()
