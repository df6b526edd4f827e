"""The blockwise int8 / int4 format itself: the code range (:data:`QMAX`), the stochastic rounding noise (a
counter-based hash of (seed, element index), the same bits in every provider: the Triton and Numba kernels
compute it in uint32 / masked int64, the cpu kernels in ``_cpu.py``; tested bit for bit against
:func:`uniform_noise`), and the torch references :func:`quantize_ref` / :func:`dequantize_ref`, the oracles of
the tests (plain PyTorch, any device). The ops are in :mod:`torsh_kernels.ops.quantize`."""

from __future__ import annotations

import torch

from ..checks import check_int
from .common import store_ref

__all__ = ["QMAX", "dequantize_ref", "quantize_ref", "seed_key", "uniform_noise"]

QMAX = {8: 127.0, 4: 7.0}
"""The largest code of each bit width (symmetric: codes lie in [-QMAX, QMAX])."""


_M32 = 0xFFFFFFFF


def _lowbias32_int(h: int) -> int:
    h &= _M32
    h ^= h >> 16
    h = (h * 0x7FEB352D) & _M32
    h ^= h >> 15
    h = (h * 0x846CA68B) & _M32
    h ^= h >> 16
    return h


def seed_key(seed: int) -> int:
    """The 32-bit key the kernels mix with element indices (any Python int seed, folded to 64 bits)."""
    if seed.__class__ is not int:
        check_int(seed, "torsh_kernels.seed_key", "seed")
    s = seed & 0xFFFFFFFFFFFFFFFF
    return _lowbias32_int((s & _M32) ^ _lowbias32_int((s >> 32) + 0x9E3779B9))


def _i32(c: int) -> int:
    """A 32-bit pattern as the signed int32 value with the same bits."""
    return c - (1 << 32) if c & 0x80000000 else c


def _lowbias32_t(h: torch.Tensor) -> torch.Tensor:
    """lowbias32 on int32 tensors: two's-complement multiplication wraps modulo 2**32 (as on every
    platform PyTorch runs on), and the masks turn the arithmetic shifts into logical ones. The Triton
    and Numba kernels compute the same bits in uint32 / masked int64 (tested bit for bit)."""
    h = h ^ (h >> 16).bitwise_and_(0xFFFF)
    h.mul_(0x7FEB352D)
    h.bitwise_xor_((h >> 15).bitwise_and_(0x1FFFF))
    h.mul_(_i32(0x846CA68B))
    return h.bitwise_xor_((h >> 16).bitwise_and_(0xFFFF))


def uniform_noise(idx: torch.Tensor, key: int) -> torch.Tensor:
    """u in [0, 1) (fp32, 24 random bits) for integer element indices ``idx`` (used modulo 2**32) and a
    seed key."""
    if idx.dtype != torch.int32:
        idx = ((idx & _M32) ^ 0x80000000).to(torch.int32) ^ _i32(0x80000000)  # low 32 bits, no overflow
    h = _lowbias32_t(_lowbias32_t(idx).bitwise_xor_(_i32(key)))
    return h.__irshift__(8).bitwise_and_(0xFFFFFF).to(torch.float32).mul_(1.0 / 16777216.0)


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
