"""``torchdelegate demo``: the whole path on the built-in language model, checked against eager.

Build the model (the weights shipped in the package, trained on a public-domain novel), export
``prefill`` + ``decode``, lower them to
ONNX Runtime with ``reference`` as fallback (``reference`` alone when ONNX Runtime is not
installed), save one file with its report, load it as a deployer would, generate tokens and
check every one against eager torch, then time both, alternating, medians of ``rounds``.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import torch

from torchdelegate.delegate.progress import PreprocessProgress, preprocess_progress
from torchdelegate.demo.model import DecoderLM, export_demo, generate, reset_cache, trained_demo_model
from torchdelegate.errors import BackendUnavailableError
from torchdelegate.lowering.edge_program_manager import to_edge
from torchdelegate.partition.capability import CapabilityPartitioner
from torchdelegate.partition.proposed import backend_supports
from torchdelegate.report import render_html, render_text
from torchdelegate.report.terminal import human_bytes
from torchdelegate.runtime.program import load

PROMPT = "torchdelegate is"  # 16 bytes: the byte-level vocabulary reads it as 16 tokens


@dataclass(frozen=True)
class DemoResult:
    tokens: list[int]
    eager_tokens: list[int]
    max_logit_difference: float
    file_bytes: int
    eager_tokens_per_second: float
    program_tokens_per_second: float

    @property
    def matches(self) -> bool:
        return self.tokens == self.eager_tokens


def run_demo(*, tokens: int = 80, output_dir: Path | None = None, rounds: int = 3, out: TextIO) -> DemoResult:
    """Run the demo, printing each step to ``out``; the result says whether it matched eager."""
    model = trained_demo_model()
    config = model.config
    prompt = torch.tensor([list(PROMPT.encode())])
    if prompt.shape[1] + tokens - 1 > config.max_len:
        raise ValueError(f"at most {config.max_len - prompt.shape[1] + 1} tokens fit the demo model's cache")
    parameters = sum(p.numel() for p in model.parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    print(
        f"model: decoder-only LM, {config.n_layers} layers, d={config.d_model}, {config.n_heads} heads, "
        f"vocab {config.vocab_size} (bytes), cache {config.max_len}; {parameters:,} parameters "
        f"({human_bytes(weight_bytes)}), trained on Natsume Soseki's Botchan (1919 translation, public domain)",
        file=out,
    )
    started = time.perf_counter()
    programs = export_demo(model, prompt_len=prompt.shape[1])
    print(f"exported prefill + decode in {time.perf_counter() - started:.1f} s", file=out)

    backends = ["onnxruntime", "reference"]
    try:
        supports = backend_supports(backends)
    except BackendUnavailableError as error:
        print(f"note: {error}; lowering to reference only", file=out)
        backends, supports = ["reference"], backend_supports(["reference"])
    started = time.perf_counter()
    with preprocess_progress(_printer(out)):
        lowered = to_edge(programs).to_backend(CapabilityPartitioner(supports))
    report = lowered.report
    assert report is not None  # every lowering emits one
    print(f"lowered to {' then '.join(backends)} in {time.perf_counter() - started:.1f} s", file=out)
    print("", file=out)
    print(render_text(report), file=out)
    print("", file=out)

    with tempfile.TemporaryDirectory(prefix="torchdelegate-demo-") as scratch:
        directory = output_dir or Path(scratch)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / "demo.tdp"
        lowered.save(path)
        file_bytes = path.stat().st_size
        held, unique = sum(report.state_bytes.values()), report.unique_state_bytes
        kept = "" if output_dir is not None else " (for this run; --output-dir DIR keeps it)"
        print(
            f"saved {path.name}{kept}: {human_bytes(file_bytes)}; the two methods hold {human_bytes(held)} of "
            f"weights and cache, {human_bytes(unique)} unique, and the file stores them once "
            f"({file_bytes / unique:.3f} x unique)",
            file=out,
        )
        if output_dir is not None:
            (directory / "demo-report.html").write_text(render_html(report, title="torchdelegate demo"), "utf-8")
            print(f"kept {path} and {directory / 'demo-report.html'}", file=out)
        result = _generate_and_compare(model, path, prompt, tokens, rounds, file_bytes, out)
    return result


def _generate_and_compare(
    model: DecoderLM, path: Path, prompt: torch.Tensor, tokens: int, rounds: int, file_bytes: int, out: TextIO
) -> DemoResult:
    with load(path) as program:
        prefill, decode = program.method("prefill"), program.method("decode")
        with torch.no_grad():
            reset_cache(model)
            difference = float((prefill(prompt) - model.prefill(prompt)).abs().max())
        reset_cache(model)
        eager_tokens = generate(model.prefill, model.decode, prompt, tokens)
        program_tokens = generate(prefill, decode, prompt, tokens)
        timings: dict[str, list[float]] = {"eager": [], "program": []}
        for _ in range(rounds):  # alternating, so both see the same machine
            reset_cache(model)
            timings["eager"].append(_seconds(lambda: generate(model.prefill, model.decode, prompt, tokens)))
            timings["program"].append(_seconds(lambda: generate(prefill, decode, prompt, tokens)))
    reset_cache(model)
    eager_rate = tokens / statistics.median(timings["eager"])
    program_rate = tokens / statistics.median(timings["program"])
    matches = program_tokens == eager_tokens
    text = bytes(program_tokens).decode("utf-8", errors="replace")
    print(f"prompt {PROMPT!r} -> {len(program_tokens)} tokens:", file=out)
    print(f"  {PROMPT}{text}".replace("\n", "\n  "), file=out)
    print(f"token ids: {program_tokens}", file=out)
    verdict = "identical to eager" if matches else f"DIFFERENT from eager: {eager_tokens}"
    print(f"tokens {verdict}; prefill logits within {difference:.1e} of eager", file=out)
    print(
        f"speed ({tokens} tokens, prefill included, median of {rounds}): eager torch {eager_rate:.0f} tokens/s, "
        f"torchdelegate {program_rate:.0f} tokens/s ({program_rate / eager_rate:.2f} x)",
        file=out,
    )
    return DemoResult(program_tokens, eager_tokens, difference, file_bytes, eager_rate, program_rate)


def _seconds(work: Callable[[], object]) -> float:
    started = time.perf_counter()
    work()
    return time.perf_counter() - started


def _printer(out: TextIO) -> Callable[[PreprocessProgress], None]:
    def show(step: PreprocessProgress) -> None:
        print(f"  preprocess {step.done}/{step.total}: {step.backend_id}, {step.where}", file=out)

    return show
