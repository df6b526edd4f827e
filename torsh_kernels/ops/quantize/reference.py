"""The torch references of the quantization ops, :func:`quantize_ref` and :func:`dequantize_ref`: plain PyTorch,
any device, written from the format's definition (``format.py``) and not from the providers: the oracles of
the tests."""

from __future__ import annotations

import torch

from ..common import store_ref
from .format import QMAX, seed_key, uniform_noise

__all__ = ["dequantize_ref", "quantize_ref"]


def quantize_ref(
    x: torch.Tensor, *, bits: int = 8, block: int = 256, stochastic: bool = False, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    v = x.reshape(-1).float()
    n = v.numel()
    nb = -(-n // block)
    padded = torch.zeros(nb * block, device=v.device)
    padded[:n] = v
    blocks = padded.view(nb, block)
    qmax = QMAX[bits]
    scales = blocks.abs().amax(dim=1) / qmax
    bad = ~torch.isfinite(blocks).all(dim=1)
    scales = torch.where(bad, torch.full_like(scales, float("nan")), scales)
    y = torch.where(scales[:, None] > 0, blocks / scales[:, None], torch.zeros_like(blocks)).view(-1)[:n]
    if stochastic:
        u = uniform_noise(torch.arange(n, device=v.device), seed_key(seed))
        q = torch.floor(y + u)
    else:
        q = torch.round(y)  # half to even
    q = torch.nan_to_num(q, nan=0.0).clamp(-qmax, qmax).to(torch.int8)
    if bits == 4:
        if n % 2:
            q = torch.cat([q, q.new_zeros(1)])
        pair = q.view(-1, 2).to(torch.int32) & 15
        q = (pair[:, 0] | (pair[:, 1] << 4)).to(torch.uint8)
    return q, scales


def dequantize_ref(
    q: torch.Tensor, scales: torch.Tensor, *, numel: int, block: int = 256, dtype=torch.float32,
    out=None, accumulate=False, alpha=1.0,
) -> torch.Tensor:  # fmt: skip
    if q.dtype == torch.uint8:
        b = q.to(torch.int32)
        codes = torch.stack([b & 15, (b >> 4) & 15], dim=1).view(-1)
        codes = torch.where(codes >= 8, codes - 16, codes)[:numel]
    else:
        codes = q[:numel].to(torch.int32)
    s = scales.repeat_interleave(block)[:numel]
    return store_ref(codes.float() * s * alpha, out, dtype, accumulate)
