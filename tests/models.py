"""Small models for the lowering tests."""

from __future__ import annotations

from pathlib import Path

import torch

aten = torch.ops.aten


class TwoLinears(torch.nn.Module):
    """linear -> relu | sigmoid (unsupported) | linear + residual: two partitions."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = torch.nn.Linear(4, 4)
        self.l2 = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.l1(x).relu()
        z = torch.sigmoid(y)
        return self.l2(z) + y


LINEAR_OPS = {aten.permute.default, aten.addmm.default, aten.relu.default, aten.add.Tensor}


class SharedConstant(torch.nn.Module):
    """One weight read by two partitions (split by sigmoid) and by an untagged node."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 4))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a = torch.mm(x, self.w)
        b = torch.mm(torch.sigmoid(a), self.w)
        return b, torch.tanh(self.w)


class KVCache(torch.nn.Module):
    """A projection written into a static cache at ``pos``, read back whole."""

    def __init__(self, length: int = 4, d: int = 4) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(d, d)
        self.register_buffer("cache", torch.zeros(length, d))

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        k = self.proj(x)
        self.cache.index_copy_(0, pos, k)
        return (self.cache * 2).sum(0) + k.sum(0)


class ReadThenWrite(torch.nn.Module):
    """Reads its buffer before updating it: the old value is used after the update."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("state", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        old = self.state * 3
        self.state.add_(x)
        return old.tanh() + self.state


class Cond(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def true_fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return (x @ w).relu() + 1

        def false_fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return (x - 1).sigmoid() * 2

        return torch.cond(x.sum() > 0, true_fn, false_fn, (x, self.w)) + x


class WhileLoop(torch.nn.Module):
    def forward(self, x: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        def cond_fn(i: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
            return i < n.size(0)

        def body_fn(i: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return i + 1, (x * 2).sin() + 1

        i0 = torch.zeros((), dtype=torch.int64)
        return torch._higher_order_ops.while_loop(cond_fn, body_fn, (i0, x))[1]


class TwiceInner(torch.nn.Module):
    """A module around another (a lowered delegate, say): twice what it returns."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) * 2


def export(model: torch.nn.Module, *args: torch.Tensor, **kwargs: object) -> torch.export.ExportedProgram:
    return torch.export.export(model, args, **kwargs).run_decompositions()  # type: ignore[arg-type]


class TinyDecoder(torch.nn.Module):
    """An embedding, one attention layer over a static KV cache, and a head.

    Exported twice from one instance, as ``prefill`` (several tokens) and ``decode`` (one),
    the two methods share every weight and both caches.
    """

    def __init__(self, vocab: int = 256, d: int = 256, max_len: int = 32) -> None:
        super().__init__()
        self.d = d
        self.embed = torch.nn.Embedding(vocab, d)
        self.qkv = torch.nn.Linear(d, 3 * d)
        self.out = torch.nn.Linear(d, d)
        self.head = torch.nn.Linear(d, vocab)
        self.register_buffer("k_cache", torch.zeros(max_len, d))
        self.register_buffer("v_cache", torch.zeros(max_len, d))
        self.register_buffer("slots", torch.arange(max_len), persistent=False)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        self.k_cache.index_copy_(0, positions, k)
        self.v_cache.index_copy_(0, positions, v)
        scores = (q @ self.k_cache.T) / self.d**0.5
        visible = self.slots[None, :] <= positions[:, None]
        attention = scores.masked_fill(~visible, float("-inf")).softmax(-1) @ self.v_cache
        return self.head(self.out(attention) + x)

    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parameters())


def decoder_methods(model: TinyDecoder, prompt_length: int = 8) -> dict[str, torch.export.ExportedProgram]:
    """``prefill`` and ``decode`` exported from one decoder (so they share its tensors)."""
    with torch.no_grad():
        return {
            "prefill": torch.export.export(
                model, (torch.zeros(prompt_length, dtype=torch.long), torch.arange(prompt_length))
            ),
            "decode": torch.export.export(model, (torch.zeros(1, dtype=torch.long), torch.tensor([prompt_length]))),
        }


def attention_block(d: int = 32, heads: int = 4) -> torch.nn.Module:
    """A pre-norm transformer block (attention + GELU MLP): the benchmark stack's block."""
    from stack import Block

    return Block(d, heads)


class CumprodBetweenLinears(torch.nn.Module):
    """linear -> cumprod (no ONNX translation) -> linear, with a user input and two weights."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = torch.nn.Linear(8, 16)
        self.l2 = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.cumprod(torch.sigmoid(self.l1(x)), dim=-1))


class NormAndMlp(torch.nn.Module):
    """A transformer block's shape without attention: modules nested two deep."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(8)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


def layered_program(path: Path) -> Path:
    """Two blocks and a head, two methods, saved with its report: linear layers and additions on the
    reference backend, norms and GELUs left in the program."""
    import torchdelegate as td
    from torchdelegate import CapabilityPartitioner, DelegationSpec

    model = torch.nn.Sequential(NormAndMlp(), NormAndMlp(), torch.nn.Linear(8, 2)).eval()
    programs = {
        "forward": torch.export.export(model, (torch.randn(2, 8),)),
        "batch": torch.export.export(model, (torch.randn(4, 8),)),
    }
    supported = {aten.linear.default, aten.addmm.default, aten.permute.default, aten.t.default, aten.add.Tensor}
    lowered = td.to_edge(programs).to_backend(CapabilityPartitioner(supported, DelegationSpec("reference")))
    lowered.save(path)
    return path
