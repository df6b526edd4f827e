"""The blockwise int8 / int4 format itself: the code range (:data:`QMAX`), the sizes and dtypes of the codes and
scales (:func:`code_count`, :func:`scale_count`, :data:`CODE_DTYPE`), the stochastic rounding noise (a
counter-based hash of (seed, element index), the same bits in every provider: the Triton and Numba kernels
compute it in uint32 / masked int64, the cpu kernels in ``cpu_common.py``; tested bit for bit against
:func:`uniform_noise`) and the codes of fp32 blocks on a grid of scales (:func:`round_codes`, the torch
provider's arithmetic). The torch references are in ``reference.py``, the ops in ``api.py``."""

from __future__ import annotations

import torch

from ...checks import check_int

__all__ = ["CODE_DTYPE", "QMAX", "code_count", "round_codes", "scale_count", "seed_key", "uniform_noise"]

QMAX = {8: 127.0, 4: 7.0}
"""The largest code of each bit width (symmetric: codes lie in [-QMAX, QMAX])."""
CODE_DTYPE = {8: torch.int8, 4: torch.uint8}
"""The codes' dtype by bit width: int8 codes one a byte; int4 codes two a byte (uint8)."""


def code_count(n: int, bits: int) -> int:
    """Bytes of codes for ``n`` elements: one an element at 8 bits, one a pair at 4."""
    return n if bits == 8 else (n + 1) // 2


def scale_count(n: int, block: int) -> int:
    """Scales for ``n`` elements in blocks of ``block`` (the last block may be partial)."""
    return (n + block - 1) // block


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


def round_codes(
    blocks: torch.Tensor, scales: torch.Tensor, qmax: float, stochastic: bool, key: int, offset: int = 0
) -> torch.Tensor:
    """fp32 integer codes of fp32 ``blocks`` [nb, block] on the grid of ``scales`` [nb], clamped to +-qmax: round
    half to even, or ``floor(y + u)`` with the (key, element index) noise, element indices starting at
    ``offset``; NaN codes become 0. Arguments unchecked (``block_codes`` is the checked public form)."""
    nb, block = blocks.shape
    y = blocks / torch.where(scales > 0, scales, 1.0)[:, None]  # an all-zero block has s == 0 and y == 0
    if stochastic:
        end = offset + nb * block
        idx = torch.arange(offset, end, device=y.device, dtype=torch.int32 if end < 2**31 else torch.int64)
        c = torch.floor_(y.view(-1).add_(uniform_noise(idx, key))).view(nb, block)
    else:
        c = torch.round(y)
    return c.nan_to_num_(nan=0.0).clamp_(-qmax, qmax)
