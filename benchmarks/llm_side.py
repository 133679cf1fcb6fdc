"""One side of benchmarks/llm.py, one phase, in this fresh process; prints its figures as JSON.

Runs in our environment (``--side torchdelegate``) or in ``.venv-executorch`` (``--side executorch``):
it imports torch, transformers and the side's own framework only.

    lower --side S --size Z --out F    build the Llama (--quantize 8da4w: torchao's recipe on every linear
                                       layer, the head included), export prefill + decode, lower, save
    reference --size Z --out F         the fp32 model in eager torch: greedy tokens after the prompt and
                                       the logits of the prompt and of each decode step
    prepare --side torchdelegate --file F   Program.prepare() into TORCHDELEGATE_CACHE (machine cache)
    run   --side S --size Z --file F   load both methods, a first prefill, warm prefills, decodes; with
                                       --reference R, the logits of the prompt and of R's tokens against R's
    generate --side S --file F --prompt-ids JSON [--new-tokens N]   a greedy loop in Python over the
                                       methods: time to first token, decode tokens/s, the tokens

Resident memory is read from /proc (RSS from statm, PSS from smaps_rollup, anonymous memory from
status); each stage's peak is
sampled by :class:`instruments.PeakRss`. Growth is counted from the moment before export (lower)
or before loading (run), after torch and the side's framework are imported and warmed up.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from instruments import PeakRss, anonymous_bytes, pss_bytes, rss_bytes, warm_up_torch
from workloads import weight_bytes

PROMPT = 32  # tokens of the prefill
CACHE = 128  # the static KV cache's length
DECODES = 40
ACCURACY_DECODES = 48  # greedy decode steps whose logits are compared with the fp32 model's
_SAMPLING = 0.005  # seconds between resident-memory samples
WARM_PREFILLS = 5
# hidden, layers, heads, KV heads, MLP, vocabulary: untied head, fp32.
SIZES = {
    "base": (1024, 12, 16, 4, 2816, 32000),  # 200M parameters
    "large": (2048, 22, 32, 4, 5632, 32000),  # TinyLlama's shape, 1.1B parameters
    "deep": (576, 30, 9, 3, 1536, 49152),  # SmolLM2-135M's shape (its head untied here): deep and thin, 163M
}


def llama_config(size: str) -> Any:
    """The transformers ``LlamaConfig`` of ``size``."""
    from transformers import LlamaConfig

    hidden, layers, heads, kv_heads, mlp, vocabulary = SIZES[size]
    return LlamaConfig(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=mlp,
        vocab_size=vocabulary,
        max_position_embeddings=2 * CACHE,
        tie_word_embeddings=False,
    )


def llama(size: str) -> torch.nn.Module:
    """The model, random weights, built in place: its parameters are allocated once."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(llama_config(size)).eval()


def static_cache_module(model: torch.nn.Module) -> torch.nn.Module:
    """transformers' exportable wrapper: the model over a static KV cache held as buffers."""
    from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM

    model.generation_config.use_cache = True
    model.generation_config.cache_implementation = "static"
    return TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=CACHE).model


def quantized(model: torch.nn.Module, recipe: str) -> torch.nn.Module:
    """``model`` with torchao's ``recipe`` applied to its linear layers, in place (both sides alike)."""
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig, quantize_
    from torchao.quantization.granularity import PerGroup

    if recipe != "8da4w":
        raise ValueError(f"unknown recipe {recipe!r}")
    config = Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup(32))
    quantize_(model, config)
    return model


def tensor_bytes(model: torch.nn.Module) -> int:
    """The bytes of the model's distinct tensors, a quantized weight counted as the tensors it holds."""
    seen: dict[int, int] = {}
    for tensor in model.state_dict().values():
        names, _ = tensor.__tensor_flatten__() if hasattr(tensor, "__tensor_flatten__") else ([], None)
        for part in [getattr(tensor, n) for n in names] or [tensor]:
            storage = part.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def method_inputs() -> dict[str, dict[str, torch.Tensor]]:
    ids = torch.randint(0, 32000, (1, PROMPT), generator=torch.Generator().manual_seed(1))
    return {
        "prefill": {"input_ids": ids, "cache_position": torch.arange(PROMPT)},
        "decode": {"input_ids": ids[:, :1], "cache_position": torch.tensor([PROMPT])},
    }


def export(module: torch.nn.Module, strict: bool) -> dict[str, Any]:
    """prefill and decode; ``strict`` (dynamo) as transformers' exporter does."""
    with torch.no_grad():
        return {m: torch.export.export(module, (), x, strict=strict) for m, x in method_inputs().items()}


def lower_torchdelegate(programs: dict[str, Any], path: Path, stages: dict[str, float]) -> None:
    import torchdelegate as td
    from torchdelegate.backends.onnxruntime import OnnxRuntimePartitioner
    from torchdelegate.backends.reference import ReferencePartitioner

    with PeakRss(_SAMPLING) as peak:
        lowered = td.to_edge_transform_and_lower(
            programs, partitioner=[OnnxRuntimePartitioner(), ReferencePartitioner()]
        )
    stages["lower"] = peak.peak
    with PeakRss(_SAMPLING) as peak:
        lowered.save(path)
    stages["save"] = peak.peak


def lower_executorch(programs: dict[str, Any], path: Path, stages: dict[str, float]) -> None:
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    with PeakRss(_SAMPLING) as peak:
        edge = to_edge_transform_and_lower(programs, partitioner=[XnnpackPartitioner()])
        program = edge.to_executorch()
    stages["lower"] = peak.peak
    with PeakRss(_SAMPLING) as peak:
        path.write_bytes(program.buffer)
    stages["save"] = peak.peak


def lower(args: argparse.Namespace) -> dict[str, Any]:
    warm_up_torch(256)
    model = llama(args.size)
    weights = weight_bytes(model)
    if args.quantize:
        model = quantized(model, args.quantize)
    module = static_cache_module(model)
    base = rss_bytes()
    stages: dict[str, float] = {}
    started = time.perf_counter()
    with PeakRss(_SAMPLING) as peak:
        programs = export(module, args.strict)
    stages["export"] = peak.peak
    gc.collect()  # strict export leaves garbage that holds a copy of the weights until collected
    exported = time.perf_counter()
    after_export = rss_bytes()
    (lower_torchdelegate if args.side == "torchdelegate" else lower_executorch)(programs, args.out, stages)
    done = time.perf_counter()
    return {
        "weights": weights,
        "quantized_weights": tensor_bytes(model),
        "export_s": exported - started,
        "lower_save_s": done - exported,
        "peak_growth": {stage: value - base for stage, value in stages.items()},
        "lower_save_peak_growth": max(stages["lower"], stages["save"]) - after_export,
        "file_bytes": args.out.stat().st_size,
    }


class _Methods:
    """A loaded program's two methods, called with the keyword inputs of ``method_inputs``."""

    def __init__(self, side: str, path: Path, initialize: bool = False) -> None:
        self.side = side
        if side == "torchdelegate":
            import torchdelegate as td

            self.program = td.load(path)
            if initialize:
                self.program.initialize()  # as ExecuTorch's load_method initializes its delegates
        else:
            from executorch.runtime import Runtime

            program = Runtime.get().load_program(path)
            self.program = {m: program.load_method(m) for m in ("prefill", "decode")}

    def __call__(self, method: str, inputs: dict[str, torch.Tensor]) -> Any:
        if self.side == "torchdelegate":
            return self.program.run(method, **inputs)
        return self.program[method].execute([inputs["input_ids"], inputs["cache_position"]])


def run(args: argparse.Namespace) -> dict[str, Any]:
    warm_up_torch(256)
    if args.side == "torchdelegate":
        import onnxruntime  # noqa: F401  (its import is not the program's cost)

        import torchdelegate  # noqa: F401
    else:
        import executorch.runtime  # noqa: F401
    inputs = method_inputs()
    base_rss, base_pss, base_anonymous = rss_bytes(), pss_bytes(), anonymous_bytes()
    with torch.no_grad(), PeakRss(_SAMPLING) as peak:
        started = time.perf_counter()
        methods = _Methods(args.side, args.file)
        methods("prefill", inputs["prefill"])
        first = time.perf_counter() - started
        warm = []
        for _ in range(WARM_PREFILLS):
            start = time.perf_counter()
            methods("prefill", inputs["prefill"])
            warm.append(time.perf_counter() - start)
        decode = []
        for step in range(DECODES):
            position = torch.tensor([PROMPT + step % (CACHE - PROMPT)])
            start = time.perf_counter()
            methods("decode", {"input_ids": inputs["decode"]["input_ids"], "cache_position": position})
            decode.append(time.perf_counter() - start)
    resident = rss_bytes(), pss_bytes(), anonymous_bytes()
    with torch.no_grad():
        figures = {} if args.reference is None else accuracy(methods, args.reference)
    return {
        **figures,
        "load_first_prefill_ms": first * 1e3,
        "warm_prefill_ms": statistics.median(warm) * 1e3,
        "decode_ms": statistics.median(decode) * 1e3,
        "rss_growth": resident[0] - base_rss,
        "pss_growth": resident[1] - base_pss,
        "anonymous_growth": resident[2] - base_anonymous,
        "peak_growth": peak.peak - base_rss,
        "threads": torch.get_num_threads(),
    }


def _logits(output: Any) -> torch.Tensor:
    """The logits of a method's outputs (ExecuTorch returns a list), as [positions, vocabulary]."""
    logits = output[0] if isinstance(output, (list, tuple)) else output
    return logits.reshape(-1, logits.shape[-1]).float()


def reference(args: argparse.Namespace) -> dict[str, Any]:
    """The fp32 model's greedy continuation of the prompt and its logits, saved to ``--out``."""
    module = static_cache_module(llama(args.size))
    inputs = method_inputs()
    with torch.no_grad():
        rows = [_logits(module(**inputs["prefill"]))]
        tokens = []
        for step in range(ACCURACY_DECODES):
            token = rows[-1][-1].argmax()
            tokens.append(int(token))
            position = torch.tensor([PROMPT + step])
            rows.append(_logits(module(input_ids=token.reshape(1, 1), cache_position=position)))
    torch.save({"tokens": torch.tensor(tokens), "logits": torch.cat(rows)}, args.out)
    return {"positions": PROMPT + ACCURACY_DECODES}


def accuracy(methods: Any, path: Path) -> dict[str, Any]:
    """The loaded program's logits over the prompt and the reference's tokens, against the reference's."""
    saved = torch.load(path, weights_only=True)
    inputs = method_inputs()
    rows = [_logits(methods("prefill", inputs["prefill"]))]
    for step, token in enumerate(saved["tokens"].tolist()):
        position = torch.tensor([PROMPT + step])
        rows.append(_logits(methods("decode", {"input_ids": torch.tensor([[token]]), "cache_position": position})))
    logits, expected = torch.cat(rows), saved["logits"]
    error = (logits - expected).abs()
    return {
        "max_logit_error": float(error.max()),
        "mean_logit_error": float(error.mean()),
        "top1_agreement": float((logits.argmax(-1) == expected.argmax(-1)).float().mean()),
    }


def generate(args: argparse.Namespace) -> dict[str, Any]:
    """A runner-free greedy loop in Python over the loaded methods: prefill the prompt's ids, then
    decode one token at a time, each chosen by argmax; the time to first token and decode's rate."""
    warm_up_torch(256)
    prompt = json.loads(args.prompt_ids)
    started = time.perf_counter()
    methods = _Methods(args.side, args.file, initialize=True)
    loaded = time.perf_counter()
    with torch.no_grad():
        inputs = {"input_ids": torch.tensor([prompt]), "cache_position": torch.arange(len(prompt))}
        tokens = [int(_logits(methods("prefill", inputs))[-1].argmax())]
        first = time.perf_counter()
        for step in range(args.new_tokens - 1):
            position = torch.tensor([len(prompt) + step])
            logits = _logits(methods("decode", {"input_ids": torch.tensor([[tokens[-1]]]), "cache_position": position}))
            tokens.append(int(logits[-1].argmax()))
        done = time.perf_counter()
    return {
        "load_ms": (loaded - started) * 1e3,
        "time_to_first_token_ms": (first - loaded) * 1e3,
        "decode_tokens_per_s": (args.new_tokens - 1) / (done - first),
        "tokens": tokens,
    }


def prepare(args: argparse.Namespace) -> dict[str, Any]:
    """torchdelegate's ``Program.prepare`` of the file, into ``TORCHDELEGATE_CACHE``."""
    import torchdelegate as td
    from torchdelegate.cache.machine_cache import cache_directory

    started = time.perf_counter()
    with td.load(args.file) as program:
        lines = program.prepare()
    seconds = time.perf_counter() - started
    directory = cache_directory()
    stored = sum(p.stat().st_size for p in directory.rglob("*") if p.is_file()) if directory else 0
    return {"prepare_s": seconds, "entries": lines, "cache_bytes": stored}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("phase", choices=["lower", "prepare", "run", "reference", "generate"])
    parser.add_argument("--side", choices=["torchdelegate", "executorch"], default="torchdelegate")
    parser.add_argument("--size", choices=sorted(SIZES), default="base")
    parser.add_argument(
        "--non-strict", dest="strict", action="store_false", help="lower: export without dynamo (strict=False)"
    )
    parser.add_argument("--quantize", choices=["8da4w"], help="lower: quantize the model with torchao first")
    parser.add_argument("--reference", type=Path, help="run: the reference phase's file, to compare logits with")
    parser.add_argument("--out", type=Path, help="lower, reference: the file to write")
    parser.add_argument("--file", type=Path, help="prepare, run: the file to load")
    parser.add_argument("--prompt-ids", help="generate: the prompt's token ids, a JSON list")
    parser.add_argument("--new-tokens", type=int, default=64, help="generate: tokens to generate (default 64)")
    args = parser.parse_args()
    phases = {"lower": lower, "prepare": prepare, "run": run, "reference": reference, "generate": generate}
    figures = phases[args.phase](args)
    print(json.dumps({"side": args.side, "size": args.size, "phase": args.phase, "pid": os.getpid(), **figures}))


if __name__ == "__main__":
    main()
