"""Training the demo model on a text, so that what it generates reads as text.

Run once by ``training/train_demo_model.py``, which writes the weights the package ships
(``demo/weights.pt``). Training reads windows of the text as bytes and predicts each next
byte. It runs the model's own layers without the KV cache (causal attention over the
window), which computes what the cached ``forward`` computes; the trained weights then
export, lower and run unchanged. Deterministic for a seed on one machine: batches come from a
local generator, and the global RNG is never used.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch
from torch import Tensor, nn

from torchdelegate.demo.model import Block, DecoderLM


@dataclass(frozen=True)
class TrainingPlan:
    """How long and how fast to train: ``steps`` of ``batch`` windows of the model's ``max_len`` bytes,
    AdamW at ``learning_rate`` after ``warmup`` steps, decaying on a cosine to a tenth of it."""

    steps: int = 3000
    batch: int = 32
    learning_rate: float = 3e-3
    warmup: int = 100
    weight_decay: float = 0.1
    held_out: float = 0.05  # the text's last part, kept to measure loss on text not trained on
    seed: int = 0


@dataclass(frozen=True)
class TrainingReport:
    steps: int
    train_loss: float
    held_out_loss: float
    seconds: float


def block_without_cache(block: Block, x: Tensor) -> Tensor:
    """One block over a batch of whole windows ``x`` [B, T, d], each position attending to those before it."""
    batch, length, d = x.shape
    q, k, v = block.qkv(block.ln1(x)).split(d, dim=-1)
    q, k, v = (z.view(batch, length, block.n_heads, block.head_dim).transpose(1, 2) for z in (q, k, v))
    y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    x = x + block.proj(y.transpose(1, 2).reshape(batch, length, d))
    return x + block.fc2(nn.functional.gelu(block.fc1(block.ln2(x))))


def window_logits(model: DecoderLM, tokens: Tensor) -> Tensor:
    """The logits at every position of ``tokens`` [B, T], T at most ``max_len``: [B, T, vocab]."""
    positions = torch.arange(tokens.shape[1], device=tokens.device)
    x = model.tok_emb(tokens) + model.pos_emb(positions)[None]
    for block in cast("list[Block]", model.blocks):
        x = block_without_cache(block, x)
    return model.head(model.ln_f(x))


def train(
    model: DecoderLM,
    text: bytes,
    plan: TrainingPlan = TrainingPlan(),
    on_progress: Callable[[int, float], None] | None = None,
) -> TrainingReport:
    """Train ``model`` in place on ``text``; ``on_progress(step, loss)`` is called every 100 steps."""
    window = model.config.max_len
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    split = int(len(data) * (1 - plan.held_out))
    train_data, held_out = data[:split], data[split:]
    if len(train_data) <= window + 1 or len(held_out) <= window + 1:
        raise ValueError(f"the text ({len(text)} bytes) is too short for windows of {window} bytes")
    generator = torch.Generator().manual_seed(plan.seed)
    decays = {n: p.dim() >= 2 and "emb" not in n for n, p in model.named_parameters()}  # matrices, not embeddings
    decay = [p for n, p in model.named_parameters() if decays[n]]
    rest = [p for n, p in model.named_parameters() if not decays[n]]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": plan.weight_decay}, {"params": rest, "weight_decay": 0.0}],
        lr=plan.learning_rate,
        betas=(0.9, 0.95),
    )
    model.train()
    started = time.perf_counter()
    loss = torch.tensor(float("nan"))
    for step in range(plan.steps):
        for group in optimizer.param_groups:
            group["lr"] = _learning_rate(plan, step)
        inputs, targets = _batch(train_data, window, plan.batch, generator)
        loss = _loss(model, inputs, targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if on_progress is not None and (step + 1) % 100 == 0:
            on_progress(step + 1, loss.item())
    model.eval()
    return TrainingReport(plan.steps, loss.item(), held_out_loss(model, held_out), time.perf_counter() - started)


def held_out_loss(model: DecoderLM, data: Tensor) -> float:
    """Mean cross-entropy (nats per byte) over consecutive windows of ``data``."""
    window = model.config.max_len
    starts = range(0, len(data) - window - 1, window)
    with torch.no_grad():
        inputs = torch.stack([data[s : s + window] for s in starts])
        targets = torch.stack([data[s + 1 : s + window + 1] for s in starts])
        return float(_loss(model, inputs, targets))


def _loss(model: DecoderLM, inputs: Tensor, targets: Tensor) -> Tensor:
    """Mean cross-entropy of predicting ``targets`` (each input's next byte), in nats."""
    return nn.functional.cross_entropy(window_logits(model, inputs).flatten(0, 1), targets.flatten())


def _batch(data: Tensor, window: int, batch: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    starts = torch.randint(0, len(data) - window - 1, (batch,), generator=generator)
    rows = torch.stack([data[s : s + window + 1] for s in starts.tolist()])
    return rows[:, :-1], rows[:, 1:]


def _learning_rate(plan: TrainingPlan, step: int) -> float:
    if step < plan.warmup:
        return plan.learning_rate * (step + 1) / plan.warmup
    progress = (step - plan.warmup) / max(1, plan.steps - plan.warmup)
    return plan.learning_rate * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
