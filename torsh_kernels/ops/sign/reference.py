"""Torch references of the sign ops: the plain oracles the tests compare every provider with (any device,
plain PyTorch)."""

from __future__ import annotations

import torch

from ..common import acc_ref, store_ref

__all__ = ["sign_compress_ref", "sign_decompress_ref"]


def sign_compress_ref(x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    acc = acc_ref(x, residual)
    n = acc.numel()
    scale = (acc.abs().sum(dtype=torch.float64) / n).float() if n else torch.zeros((), device=acc.device)
    pos = acc >= 0
    nbytes = -(-n // 8)
    padded = torch.zeros(nbytes * 8, dtype=torch.int32, device=acc.device)
    padded[:n] = pos.to(torch.int32)
    weights = torch.tensor([1 << j for j in range(8)], dtype=torch.int32, device=acc.device)
    bits = (padded.view(nbytes, 8) * weights).sum(dim=1).to(torch.uint8)
    if residual is not None:
        residual.view(-1).copy_(acc - torch.where(pos, scale, -scale))
    return bits, scale


def sign_decompress_ref(bits, scale, numel, *, dtype=torch.float32, out=None, accumulate=False, alpha=1.0):
    b = bits.to(torch.int32)
    pos = ((b[:, None] >> torch.arange(8, device=bits.device)) & 1).view(-1)[:numel] != 0
    s = scale.float() * alpha
    return store_ref(torch.where(pos, s, -s), out, dtype, accumulate)
