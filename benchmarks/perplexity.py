"""Perplexity of each tool's file for benchmarks/llm_race.py: the same token ids, teacher-forced, every position.

The text is one none of the raced models was tuned for: the Vim user manual as this machine has it
(``/usr/share/vim/vim90/doc/usr_01.txt`` .. ``usr_05.txt``, concatenated), tokenized once by the checkpoint's
tokenizer (transformers, no special tokens added) and cut into ``WINDOWS`` windows of ``LENGTH`` tokens (fewer
positions when the model has fewer: then as many windows as give the same number of tokens). Every tool scores
those ids: each window from an empty cache, the logits after every token but the last predicting the next
(255 predictions a window), and perplexity = exp(mean negative log-likelihood) over all of them, computed in
float64 from the tool's own logits. Each side runs in a fresh process, in its tool's own environment: this
module imports only the standard library at its top, and each side its tool's package and numpy.

- ours: ``torchdelegate.load(FILE)``'s ``decode`` method, one token a call at its position (a window
  overwrites the cache of the one before from position 0);
- llama.cpp: ``Llama(FILE, n_ctx=LENGTH, n_threads=2, logits_all=True)``, ``reset()``, ``eval(window)``: the
  ``scores`` of every position;
- ONNX Runtime GenAI: ``og.Generator`` (``max_length`` LENGTH, 2 intra-op threads), ``append_tokens(window)``,
  then ``get_output("logits")`` of every appended position;
- transformers (the reference): the fp32 checkpoint in eager torch, a window a forward call.

    python perplexity.py ids CHECKPOINT OUT.json                    (the windows; in our environment)
    python perplexity.py ours|llamacpp|genai|transformers FILE IDS.json [--threads N]
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any

TEXT = [Path(f"/usr/share/vim/vim90/doc/usr_0{i}.txt") for i in range(1, 6)]
WINDOWS, LENGTH, THREADS = 8, 256, 2
DESCRIPTION = (
    "the Vim user manual on this machine (`/usr/share/vim/vim90/doc/usr_01.txt`..`usr_05.txt`), tokenized once by "
    "the checkpoint's tokenizer (no special tokens), {windows} windows of {length} tokens, every tool teacher-forced "
    "on the same ids from an empty cache, {predictions} next-token predictions in all; perplexity = exp(mean "
    "negative log-likelihood), in float64 from each tool's own logits"
)


def token_windows(checkpoint: Path, out: Path) -> dict[str, Any]:
    """The text's ids by the checkpoint's tokenizer, cut into windows, written to ``out`` as JSON."""
    from transformers import AutoConfig, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    config = AutoConfig.from_pretrained(checkpoint)
    positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None) or LENGTH
    length = min(LENGTH, positions)
    count = WINDOWS * LENGTH // length
    text = "".join(path.read_text() for path in TEXT)
    ids = tokenizer(text, add_special_tokens=False).input_ids
    if len(ids) < count * length:
        raise RuntimeError(f"the text is {len(ids)} tokens, fewer than {count} windows of {length}")
    windows = [ids[i * length : (i + 1) * length] for i in range(count)]
    out.write_text(json.dumps(windows))
    return {
        "text_tokens": len(ids),
        "text_characters": len(text),
        "windows": count,
        "length": length,
        "predictions": count * (length - 1),
        "files": [str(path) for path in TEXT],
    }


def negative_log_likelihoods(logits: Any, targets: list[int]) -> Any:
    """Each row's -log softmax at its target, in float64: ``logits`` (positions, vocabulary)."""
    import numpy as np

    rows = np.asarray(logits, dtype=np.float64)
    top = rows.max(axis=1, keepdims=True)
    log_sum = top[:, 0] + np.log(np.exp(rows - top).sum(axis=1))
    return log_sum - rows[np.arange(len(targets)), np.asarray(targets)]


def _result(per_window: list[Any], started: float, **extra: Any) -> dict[str, Any]:
    total = sum(float(w.sum()) for w in per_window)
    count = sum(len(w) for w in per_window)
    return {
        "perplexity": math.exp(total / count),
        "mean_nll": total / count,
        "predictions": count,
        "window_perplexities": [math.exp(float(w.mean())) for w in per_window],
        "seconds": time.perf_counter() - started,
        **extra,
    }


def ours(path: Path, windows: list[list[int]], threads: int) -> dict[str, Any]:
    """Our file's decode method, one token a call."""
    import numpy as np

    import torchdelegate as td

    started = time.perf_counter()
    scored = []
    with td.load(path) as program:
        decode = program.method("decode")
        ids, position = np.zeros((1, 1), dtype=np.int64), np.zeros(1, dtype=np.int64)
        for window in windows:
            rows = []
            for p, token in enumerate(window[:-1]):
                ids[0, 0], position[0] = token, p
                rows.append(np.array(decode(input_ids=ids, cache_position=position)[0, -1], dtype=np.float64))
            scored.append(negative_log_likelihoods(np.stack(rows), window[1:]))
    return _result(scored, started)


def llamacpp(path: Path, windows: list[list[int]], threads: int) -> dict[str, Any]:
    """llama.cpp's logits of every position of a window evaluated at once."""
    import llama_cpp

    started = time.perf_counter()
    length = max(len(w) for w in windows)
    llm = llama_cpp.Llama(
        model_path=str(path), n_ctx=length, n_batch=length, n_threads=threads, n_threads_batch=threads,
        logits_all=True, verbose=False,
    )  # fmt: skip
    scored = []
    for window in windows:
        llm.reset()
        llm.eval(window)
        scored.append(negative_log_likelihoods(llm.scores[: len(window) - 1], window[1:]))
    return _result(scored, started)


def genai(path: Path, windows: list[list[int]], threads: int) -> dict[str, Any]:
    """GenAI's logits of every appended position (one token at a time when it keeps only the last)."""
    import numpy as np
    import onnxruntime_genai as og

    started = time.perf_counter()
    config = og.Config(str(path))
    config.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": threads}}}}))
    model = og.Model(config)
    length = max(len(w) for w in windows)
    scored, shapes = [], []
    for window in windows:
        params = og.GeneratorParams(model)
        params.set_search_options(do_sample=False, max_length=length, batch_size=1)
        generator = og.Generator(model, params)
        generator.append_tokens(np.array(window[:-1], dtype=np.int32))
        logits = np.asarray(generator.get_output("logits"))
        shapes.append(list(logits.shape))
        logits = logits.reshape(-1, logits.shape[-1])
        if len(logits) != len(window) - 1:  # only the last position's: one token at a time
            generator = og.Generator(model, params)
            rows = []
            for token in window[:-1]:
                generator.append_tokens(np.array([token], dtype=np.int32))
                rows.append(np.asarray(generator.get_output("logits")).reshape(-1)[-logits.shape[-1] :])
            logits = np.stack(rows)
        scored.append(negative_log_likelihoods(logits, window[1:]))
    return _result(scored, started, logits_shapes=sorted({tuple(s) for s in map(tuple, shapes)}))


def transformers_reference(checkpoint: Path, windows: list[list[int]], threads: int) -> dict[str, Any]:
    """transformers' fp32 eager model of the checkpoint, a window a forward call."""
    import torch
    from transformers import AutoModelForCausalLM

    started = time.perf_counter()
    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    scored = []
    with torch.no_grad():
        for window in windows:
            logits = model(torch.tensor([window[:-1]])).logits[0].double().numpy()
            scored.append(negative_log_likelihoods(logits, window[1:]))
    return _result(scored, started)


REFERENCE = "transformers fp32 (reference)"  # the key of transformers' figures in the race's data


def perplexity_columns(data: dict[str, Any], key: str) -> str:
    """The race page's `` | perplexity | Δ`` cells of ``key``, Δ against transformers' fp32 reference; none for a
    random checkpoint's page (the perplexity of random weights says nothing)."""
    if not data.get("model"):
        return ""
    found, reference = data["perplexity"].get(key), data["perplexity"].get(REFERENCE)
    if found is None or reference is None or "perplexity" not in reference:
        return " | – | –"
    if "perplexity" not in found:
        return f" | failed: {found['error']} | –"
    return f" | {found['perplexity']:.3f} | {100 * (found['perplexity'] / reference['perplexity'] - 1):+.2f}%"


def perplexity_line(text: dict[str, Any]) -> str:
    """What the race page's perplexity is: ``text`` is what ``token_windows`` returned."""
    return (
        "Perplexity (lower is better): " + DESCRIPTION.format(**text) + f". The text is {text['text_tokens']} "
        f"tokens; the windows are its first {text['windows'] * text['length']}. Each file is scored once, in a "
        "fresh process; Δ is against transformers' fp32 eager model of the checkpoint."
    )


SIDES = {"ours": ours, "llamacpp": llamacpp, "genai": genai, "transformers": transformers_reference}


def main() -> None:
    import argparse
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if len(sys.argv) == 4 and sys.argv[1] == "ids":
        print(json.dumps(token_windows(Path(sys.argv[2]), Path(sys.argv[3]))))
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("side", choices=list(SIDES))
    parser.add_argument("path", type=Path)
    parser.add_argument("ids", type=Path, help="the windows, a JSON list of lists of token ids")
    parser.add_argument("--threads", type=int, default=THREADS)
    args = parser.parse_args()
    windows = json.loads(args.ids.read_text())
    print(json.dumps(SIDES[args.side](args.path, windows, args.threads)))


if __name__ == "__main__":
    main()
