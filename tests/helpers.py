"""Factories and models the test modules share: one home for what several of them need.

(``conftest.py`` holds the harness itself: interpreter switches, devices, dtype tolerances, fixtures.)
"""

from __future__ import annotations

import dataclasses
import itertools

import torch
from torch import nn

from torsh_kernels.compression import BF16, FP16, Compressor, PowerSGD, Quantize, Sign, TopK

_COMPRESSORS = {
    "none": lambda p: None,
    "fp16": lambda p: FP16(provider=p),
    "bf16": lambda p: BF16(provider=p),
    "topk": lambda p: TopK(0.1, provider=p),
    "topk-exact": lambda p: TopK(0.05, exact=True, provider=p),
    "int8": lambda p: Quantize(8, block=64, provider=p),
    "int4": lambda p: Quantize(4, block=32, stochastic=True, provider=p),
    "sign": lambda p: Sign(provider=p),
    "powersgd": lambda p: PowerSGD(2, start_iter=1, provider=p),
}
COMPRESSOR_NAMES = tuple(_COMPRESSORS)


def make_compressor(name: str, provider: str | None = None, **overrides) -> Compressor | None:
    """A compressor by test name (small blocks and ratios for small tensors); ``None`` for "none".
    A suffix after the base name ("int8-gather", "int4-shared") names the same compressor under another
    scheme. ``overrides`` replace fields (e.g. ``ratio=0.05``)."""
    base = name if name in _COMPRESSORS else name.rsplit("-", 1)[0]
    c = _COMPRESSORS[base](provider)
    return dataclasses.replace(c, **overrides) if overrides else c


def batch(step: int, rank: int, *, rows: int, features: int, classes: int, salt: tuple[int, int] = (7919, 31)):
    """A classification batch (x [rows, features], labels [rows]), different per step and rank."""
    g = torch.Generator().manual_seed(salt[0] * step + salt[1] * rank)
    return torch.randn(rows, features, generator=g), torch.randint(0, classes, (rows,), generator=g)


class MLP(nn.Module):
    """Linear layers named a, b, c, ... with an activation between them, initialised from ``seed``. With
    ``side=True`` also a linear branch from input to output that ``forward`` uses only when asked, so its
    parameters get no gradient otherwise (unused-parameter cases)."""

    def __init__(self, *sizes: int, act: type[nn.Module] = nn.ReLU, side: bool = False, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.names = []
        for i, (a, b) in enumerate(itertools.pairwise(sizes)):
            name = "abcdefghijklmnop"[i]
            setattr(self, name, nn.Linear(a, b))
            self.names.append(name)
        self.act = act()
        self.side = nn.Linear(sizes[0], sizes[-1]) if side else None

    def forward(self, x: torch.Tensor, side: bool = False) -> torch.Tensor:
        h = x
        for i, name in enumerate(self.names):
            h = getattr(self, name)(h)
            if i + 1 < len(self.names):
                h = self.act(h)
        return h + self.side(x) if side else h
