"""A small decoder-only byte language model with a static KV cache, exported as ``prefill`` + ``decode``.

Why it exists: examples, benchmarks and tests need a language model that exercises what
torchdelegate is for — two methods of one program sharing every weight and a KV cache that
``prefill`` writes and ``decode`` reads — without downloading anything or depending on
transformers. :func:`trained_demo_model` has the weights shipped in the package, trained on a
public-domain novel (``training/``), so that its greedy output reads as text.
:func:`build_demo_model` has random but deterministic weights for any config (a seed and a
local ``torch.Generator``; the global RNG is never touched). With the default scale greedy
generation wanders over many tokens (23 distinct in 64 from seed 0) instead of repeating
one; larger weights make the residual stream collapse onto a few tokens.

The contract, which the programs exported by :func:`export_demo` keep too:

- ``prefill(tokens: LongTensor[1, P]) -> logits[1, vocab]`` writes cache positions
  ``0 .. P-1`` and returns the logits of the last position; ``P`` is fixed at export.
- ``decode(token: LongTensor[1, 1], position: LongTensor[1]) -> logits[1, vocab]`` writes
  the cache at ``position`` and attends to positions ``0 .. position``.

Shapes are static: attention always reads the whole ``max_len`` cache, and a mask hides the
positions after the current one, so one ``decode`` program serves every step and stale
cache entries (from an earlier, longer generation) are never seen. The cache is one pair
of buffers per layer, ``k_cache_{i}`` and ``v_cache_{i}`` of shape
``[1, n_heads, max_len, head_dim]``, updated in place with ``index_copy_``: torch.export
records them as mutated buffers (functional ``index_put`` after decomposition, which ONNX
Runtime runs as ``ScatterND``). Positions must be ``< max_len``; that is not checked inside
the graph (it would be data-dependent control flow); :func:`generate` checks it when given
``max_len``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn
from torch.export import ExportedProgram


@dataclass(frozen=True)
class DemoConfig:
    """The model's sizes. The defaults (0.88 M parameters, 3.5 MB) are small enough that a token's
    decode is mostly per-op overhead, which lowering to ONNX Runtime removes: what the demo shows."""

    vocab_size: int = 256  # bytes
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    mlp_ratio: int = 4  # the MLP's hidden width is mlp_ratio * d_model
    max_len: int = 128  # cache length: prompt + generated tokens
    init_std: float = 0.02  # every weight matrix and embedding
    # The lm head's scale (its std is head_std / sqrt(d_model)): logits of std about head_std. Greedy
    # tokens do not depend on it; wide gaps between the top logits keep them the same across backends.
    head_std: float = 2.0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "mlp_ratio", "max_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"DemoConfig.{name} must be at least 1, got {getattr(self, name)}")
        if self.d_model % self.n_heads:
            raise ValueError(f"DemoConfig: d_model ({self.d_model}) must be a multiple of n_heads ({self.n_heads})")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


class Block(nn.Module):
    """Pre-LayerNorm transformer block: causal multi-head attention over the cache, then a GELU MLP."""

    def __init__(self, config: DemoConfig, device: torch.device | str) -> None:
        super().__init__()
        d = config.d_model
        self.n_heads, self.head_dim = config.n_heads, config.head_dim
        self.ln1 = nn.LayerNorm(d, device=device)
        self.qkv = nn.Linear(d, 3 * d, device=device)
        self.proj = nn.Linear(d, d, device=device)
        self.ln2 = nn.LayerNorm(d, device=device)
        self.fc1 = nn.Linear(d, config.mlp_ratio * d, device=device)
        self.fc2 = nn.Linear(config.mlp_ratio * d, d, device=device)

    def forward(self, x: Tensor, positions: Tensor, visible: Tensor, k_cache: Tensor, v_cache: Tensor) -> Tensor:
        """``x`` [1, T, d] at ``positions`` [T]; ``visible`` [T, max_len] is the causal mask over the cache.
        Writes this step's keys and values into the caches (in place) before attending."""
        batch, length, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(batch, length, self.n_heads, self.head_dim).transpose(1, 2) for z in (q, k, v))
        k_cache.index_copy_(2, positions, k)
        v_cache.index_copy_(2, positions, v)
        scores = (q @ k_cache.transpose(-2, -1)) * (self.head_dim**-0.5)  # [1, heads, T, max_len]
        weights = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        y = (weights @ v_cache).transpose(1, 2).reshape(batch, length, d)
        x = x + self.proj(y)
        return x + self.fc2(nn.functional.gelu(self.fc1(self.ln2(x))))


class DecoderLM(nn.Module):
    """The demo language model; see the module's docstring for ``prefill`` and ``decode``.

    Built on the meta device and materialized with weights from ``seed`` (a local generator),
    so constructing it never draws from the global RNG. The lm head is not tied to the
    embedding, so that its scale (``head_std``) is set apart from the embedding's.
    """

    def __init__(self, config: DemoConfig = DemoConfig(), seed: int = 0) -> None:
        super().__init__()
        self.config = config
        meta = torch.device("meta")
        d, shape = config.d_model, (1, config.n_heads, config.max_len, config.head_dim)
        self.tok_emb = nn.Embedding(config.vocab_size, d, device=meta)
        self.pos_emb = nn.Embedding(config.max_len, d, device=meta)
        self.blocks = nn.ModuleList(Block(config, meta) for _ in range(config.n_layers))
        self.ln_f = nn.LayerNorm(d, device=meta)
        self.head = nn.Linear(d, config.vocab_size, bias=False, device=meta)
        for i in range(config.n_layers):
            self.register_buffer(f"k_cache_{i}", torch.empty(shape, device=meta))
            self.register_buffer(f"v_cache_{i}", torch.empty(shape, device=meta))
        self.to_empty(device="cpu")
        self.init_weights(seed)

    def init_weights(self, seed: int) -> None:
        """Deterministic weights from ``seed`` (normal, std ``init_std``; the head ``head_std / sqrt(d)``;
        LayerNorms 1 and 0; biases 0), empty caches. Draws only from a local generator."""
        generator = torch.Generator().manual_seed(seed)
        config = self.config
        with torch.no_grad():
            for name, parameter in self.named_parameters():
                if name.startswith("head."):
                    parameter.normal_(0.0, config.head_std / math.sqrt(config.d_model), generator=generator)
                elif ".ln" in name or name.startswith("ln_"):
                    parameter.fill_(1.0 if name.endswith("weight") else 0.0)
                elif name.endswith("bias"):
                    parameter.zero_()
                else:
                    parameter.normal_(0.0, config.init_std, generator=generator)
        reset_cache(self)

    def cache_names(self) -> list[str]:
        """The cache buffers' names: ``k_cache_0``, ``v_cache_0``, ``k_cache_1``, ..."""
        return [f"{kind}_cache_{i}" for i in range(self.config.n_layers) for kind in "kv"]

    def caches(self) -> Iterator[tuple[Tensor, Tensor]]:
        """Each layer's (key, value) cache buffers."""
        for i in range(self.config.n_layers):
            yield self.get_buffer(f"k_cache_{i}"), self.get_buffer(f"v_cache_{i}")

    def forward(self, tokens: Tensor, positions: Tensor) -> Tensor:
        """``tokens`` [1, T] at cache ``positions`` [T] -> the logits of the last one, [1, vocab].
        Writes the caches at ``positions``; each token attends to the cache up to its own position."""
        slots = torch.arange(self.config.max_len, device=tokens.device)
        visible = slots[None, :] <= positions[:, None]  # [T, max_len]
        x = self.tok_emb(tokens) + self.pos_emb(positions)[None]
        for block, (k_cache, v_cache) in zip(self.blocks, self.caches(), strict=True):
            x = block(x, positions, visible, k_cache, v_cache)
        return self.head(self.ln_f(x[:, -1]))

    def prefill(self, tokens: Tensor) -> Tensor:
        """``tokens`` [1, P] at positions ``0 .. P-1`` -> logits of the last position, [1, vocab]."""
        return self(tokens, torch.arange(tokens.shape[1], device=tokens.device))

    def decode(self, token: Tensor, position: Tensor) -> Tensor:
        """``token`` [1, 1] at ``position`` [1] (a tensor, so one program serves every step) -> [1, vocab]."""
        return self(token, position)


def reset_cache(model: DecoderLM) -> None:
    """Zero the KV cache. Not needed between generations (prefill overwrites what it reads, the
    mask hides the rest), but it makes the model's state equal to a fresh one's."""
    with torch.no_grad():
        for k_cache, v_cache in model.caches():
            k_cache.zero_()
            v_cache.zero_()


def build_demo_model(config: DemoConfig = DemoConfig(), seed: int = 0) -> DecoderLM:
    """The demo model in eval mode: equal weights for equal ``(config, seed)``, empty caches."""
    return DecoderLM(config, seed).eval()


DEMO_WEIGHTS = Path(__file__).with_name("weights.pt")
"""The trained weights the package ships (``training/train_demo_model.py`` writes them)."""


def trained_demo_model(path: Path = DEMO_WEIGHTS) -> DecoderLM:
    """The demo model with the weights trained on a public-domain novel, in eval mode, empty caches:
    its greedy output reads as (broken) English. Loaded without unpickling code (``weights_only``)."""
    model = DecoderLM(DemoConfig())
    state = torch.load(path, map_location="cpu", weights_only=True)
    model.load_state_dict(state, strict=False)
    missing = {name for name, _ in model.named_parameters()} - set(state)
    if missing:
        raise ValueError(f"{path} lacks the demo model's weights {sorted(missing)}")
    return model.eval()


def save_demo_weights(model: DecoderLM, path: Path) -> None:
    """``model``'s parameters (not its cache) as :func:`trained_demo_model` reads them."""
    torch.save({name: p.detach().contiguous() for name, p in model.named_parameters()}, path)


class _Prefill(nn.Module):
    def __init__(self, model: DecoderLM) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: Tensor) -> Tensor:
        return self.model.prefill(tokens)


class _Decode(nn.Module):
    def __init__(self, model: DecoderLM) -> None:
        super().__init__()
        self.model = model

    def forward(self, token: Tensor, position: Tensor) -> Tensor:
        return self.model.decode(token, position)


@contextmanager
def _fresh_caches(model: DecoderLM) -> Iterator[None]:
    """Give the model new, empty cache tensors for the duration, then put its own back.

    The exported programs then hold caches of their own (the same tensors in both methods,
    under the same names), whatever the model's cache holds, and running the model afterwards
    does not write into the programs' state (nor tracing into the model's). Parameters are shared.
    """
    saved = {name: model.get_buffer(name) for name in model.cache_names()}
    try:
        for name, tensor in saved.items():
            setattr(model, name, torch.zeros_like(tensor))
        yield
    finally:
        for name, tensor in saved.items():
            setattr(model, name, tensor)


def export_demo(model: DecoderLM, prompt_len: int) -> dict[str, ExportedProgram]:
    """``{"prefill": ..., "decode": ...}``, exported from one model so they share their tensors.

    Both are wrappers holding the model as ``model``, so every parameter and cache buffer has
    the same fully qualified name (``model.k_cache_0``, ...) in both methods: a runtime that
    shares state by name (``torchdelegate.load``) shares the cache between them. The prompt
    length is fixed here. The model is left as it was: the programs get fresh, empty caches
    (see ``_fresh_caches``); its parameters are shared, not copied.
    """
    config = model.config
    if not 1 <= prompt_len < config.max_len:
        raise ValueError(f"prompt_len must be in [1, {config.max_len - 1}] (max_len leaves room to decode)")
    tokens = torch.zeros(1, prompt_len, dtype=torch.long)
    token, position = torch.zeros(1, 1, dtype=torch.long), torch.tensor([prompt_len])
    with torch.no_grad(), _fresh_caches(model):
        return {
            "prefill": torch.export.export(_Prefill(model), (tokens,), strict=False),
            "decode": torch.export.export(_Decode(model), (token, position), strict=False),
        }


def generate(
    prefill: Callable[[Tensor], Tensor],
    decode: Callable[[Tensor, Tensor], Tensor],
    prompt: Tensor,
    new_tokens: int,
    max_len: int | None = None,
) -> list[int]:
    """Greedy generation: ``new_tokens`` token ids following ``prompt`` [1, P].

    ``prefill`` and ``decode`` are any callables with the methods' calling convention: the
    eager model's methods, ``ExportedProgram.module()``\\ s, or ``program.method(...)`` of a
    loaded program. Calls ``prefill`` once and ``decode`` ``new_tokens - 1`` times, under
    ``torch.no_grad``. ``max_len`` (the cache length), when given, is checked up front.
    """
    if prompt.dim() != 2 or prompt.shape[0] != 1 or prompt.dtype != torch.long:
        raise ValueError(f"prompt must be a LongTensor [1, P], got {prompt.dtype} {list(prompt.shape)}")
    if new_tokens < 0:
        raise ValueError(f"new_tokens must be >= 0, got {new_tokens}")
    position = prompt.shape[1]
    if max_len is not None and position + new_tokens - 1 > max_len:
        raise ValueError(f"prompt ({position}) + new_tokens ({new_tokens}) - 1 exceeds the cache ({max_len})")
    tokens: list[int] = []
    if new_tokens == 0:
        return tokens
    with torch.no_grad():
        logits = prefill(prompt)
        while True:
            tokens.append(int(logits[0].argmax()))
            if len(tokens) == new_tokens:
                return tokens
            logits = decode(torch.tensor([[tokens[-1]]]), torch.tensor([position]))
            position += 1
