"""The torch references of the row ops, :func:`quantize_rows_ref` and :func:`dequantize_rows_ref`: plain PyTorch,
any device, written from the format's definition (``api.py``'s module docstring; the fp8 codes from
``ops/quantize/fp8.py``'s oracle, the int8 codes from the int8 format's rule): the oracles of the tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..quantize.fp8 import FP8, fp8_codes

__all__ = ["dequantize_rows_ref", "quantize_rows_ref", "row_layout"]


def row_layout(hidden: int, block: int) -> tuple[int, int, int]:
    """(code bytes with padding ``A``, tiles ``nt``, row bytes ``A + 4 * nt``) of a packed row."""
    nt = -(-hidden // block)
    a = -(-hidden // 4) * 4
    return a, nt, a + 4 * nt


def _qmax(fmt: str) -> float:
    return FP8[fmt].max if fmt in FP8 else 127.0


def quantize_rows_ref(x: torch.Tensor, fmt: str, block: int, index: torch.Tensor | None = None) -> torch.Tensor:
    T, H = x.shape
    a, nt, rb = row_layout(H, block)
    v = x.float()
    if index is not None:
        v = torch.where(index[:, None] >= 0, v[index.clamp(min=0)], 0.0) if T else v.new_zeros(len(index), H)
    N = v.shape[0]
    tiles = F.pad(v, (0, nt * block - H)).view(N, nt, block)
    amax = tiles.abs().amax(dim=2)
    bad = ~torch.isfinite(tiles).all(dim=2)
    s = torch.where(bad, float("nan"), amax / _qmax(fmt))
    y = torch.where(s[:, :, None] > 0, tiles / torch.where(s > 0, s, 1.0)[:, :, None], 0.0)
    if fmt in FP8:
        codes = fp8_codes(y, FP8[fmt]).view(torch.uint8)
    else:
        codes = torch.round(y).clamp(-127, 127).to(torch.int8).view(torch.uint8)
    packed = torch.zeros(N, rb, dtype=torch.uint8, device=x.device)
    packed[:, :H] = codes.reshape(N, nt * block)[:, :H]
    packed[:, a:] = s.contiguous().view(torch.uint8).view(N, 4 * nt)
    return packed


def dequantize_rows_ref(
    packed: torch.Tensor, fmt: str, block: int, hidden: int, dtype: torch.dtype, index: torch.Tensor | None = None
) -> torch.Tensor:
    a, nt, _ = row_layout(hidden, block)
    M = packed.shape[0]
    codes = packed[:, :hidden].contiguous()
    c = codes.view(FP8[fmt].dtype).float() if fmt in FP8 else codes.view(torch.int8).float()
    s = packed[:, a:].contiguous().view(torch.float32).view(M, nt)
    v = c * s.repeat_interleave(block, dim=1)[:, :hidden]
    if index is not None:
        v = torch.where(index[:, None] >= 0, v[index.clamp(min=0)], 0.0) if M else v.new_zeros(len(index), hidden)
    return v.to(dtype)
