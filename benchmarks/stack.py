"""The benchmarks' model: a stack of L pre-norm transformer blocks (attention + MLP) of width d.

Plain torch, so that the ExecuTorch side of a benchmark (in its own virtual environment)
builds exactly the same model from the same seed.
"""

from __future__ import annotations

import torch


class Block(torch.nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = torch.nn.LayerNorm(d)
        self.qkv = torch.nn.Linear(d, 3 * d)
        self.proj = torch.nn.Linear(d, d)
        self.ln2 = torch.nn.LayerNorm(d)
        self.fc1 = torch.nn.Linear(d, 4 * d)
        self.fc2 = torch.nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=-1)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        attention = ((q @ k.transpose(-2, -1)) * (c // self.heads) ** -0.5).softmax(-1)
        y = (attention @ v).transpose(1, 2).reshape(b, t, c)
        x = x + self.proj(y)
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(x))))


class Stack(torch.nn.Module):
    def __init__(self, layers: int, d: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.blocks = torch.nn.Sequential(*(Block(d, heads) for _ in range(layers)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


def seeded_stack(layers: int, d: int, seed: int = 0) -> tuple[Stack, torch.Tensor]:
    """The model and a one-token input, the same on every side of a comparison."""
    torch.manual_seed(seed)
    model = Stack(layers, d).eval()
    return model, torch.randn(1, 1, d)
