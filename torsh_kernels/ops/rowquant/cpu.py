"""CPU kernels (Numba's CPU target) of the row ops (see api.py).

Imported on the cpu provider's first launch. ``quantize_rows``: per output row, the source row (a gather by
the index: the MoE permute), then per tile its largest magnitude from the fp32 bit patterns (an integer
maximum, which vectorises and finds NaN/Inf: their patterns are the largest), the scale, and the codes while
the tile is in L1; bf16 rows are read as their 16-bit patterns (bf16 -> fp32 is a shift), fp16 rows converted
by torch first. ``dequantize_rows``: codes times scale in fp32, written as fp32 or as bf16 (rounded to nearest
even in integer ops, torch's rounding), fp16 through torch's conversion. The fp8 arithmetic is
``ops/quantize/fp8.py``'s (``fp8_bits_py``, ``fp8_value_py``), transcribed."""

from __future__ import annotations

import numpy as np
import torch

from ..cpu_common import arr, bits_f32, f32_bits, jit

_FMT = {"e4m3": 0, "e5m2": 1, "int8": 2}
_QMAX = (448.0, 57344.0, 127.0)


@jit
def _load(x, xb, r, c, bf16):
    """Element (r, c) of the source rows as fp32: x fp32 [T, H], or xb the bf16 patterns (int16 [T, H])."""
    if bf16:
        return bits_f32(np.int32(xb[r, c]) << 16)
    return x[r, c]


@jit
def _fp8_bits(y, e4m3):
    """fp8 code (0..255) of a saturated, non-NaN fp32 value: fp8_bits_py."""
    b = np.int64(f32_bits(y)) & 0xFFFFFFFF
    sign = (b >> 24) & 0x80
    a = b & 0x7FFFFFFF
    if e4m3:
        small, magic, rebias, shift = (121 << 23), (141 << 23), (120 << 23), 20
    else:
        small, magic, rebias, shift = (113 << 23), (134 << 23), (112 << 23), 21
    if a < small:
        r = (np.int64(f32_bits(np.abs(y) + bits_f32(np.int32(magic)))) & 0xFFFFFFFF) - magic
    else:
        r = (a - rebias + ((1 << (shift - 1)) - 1) + ((a >> shift) & 1)) >> shift
    return r | sign


@jit
def _fp8_value(c, e4m3):
    """fp32 value of fp8 code c (0..255): fp8_value_py."""
    m = c & 0x7F
    if e4m3:
        if m < 8:
            v = np.float32(m) * np.float32(2.0**-9)
        elif m == 0x7F:
            v = np.float32(np.nan)
        else:
            v = bits_f32(np.int32((m << 20) + (120 << 23)))
    else:
        if m < 4:
            v = np.float32(m) * np.float32(2.0**-16)
        elif m >= 0x7C:
            v = bits_f32(np.int32(0x7F800000 | ((m & 3) << 21)))
        else:
            v = bits_f32(np.int32((m << 21) + (112 << 23)))
    return -v if c & 0x80 else v


@jit
def quantize_arrays(x, xb, bf16, index, has_index, codes, scales, fmt, block):
    """codes uint8 [N, RB] (the packed rows, codes part), scales fp32 [N, RB / 4] (the same memory; the scales
    from column A / 4 on: passed as the view starting there)."""
    N = codes.shape[0]
    H = x.shape[1] if not bf16 else xb.shape[1]
    nt = (H + block - 1) // block
    qmax = np.float32(448.0) if fmt == 0 else (np.float32(57344.0) if fmt == 1 else np.float32(127.0))
    pad = (H + 3) // 4 * 4
    for n in range(N):
        src = index[n] if has_index else n
        for c in range(H, pad):
            codes[n, c] = 0
        for t in range(nt):
            a = t * block
            e = min(a + block, H)
            mx = np.int32(0)
            if src >= 0:
                for c in range(a, e):
                    v = f32_bits(_load(x, xb, src, c, bf16)) & 0x7FFFFFFF
                    mx = v if v > mx else mx
            if mx >= 0x7F800000:
                s = np.float32(np.nan)
            else:
                s = bits_f32(mx) / qmax
            scales[n, t] = s
            if not s > 0:
                for c in range(a, e):
                    codes[n, c] = 0
            elif fmt == 2:
                for c in range(a, e):
                    y = np.rint(_load(x, xb, src, c, bf16) / s)
                    y = y if y < qmax else qmax
                    y = y if y > -qmax else -qmax
                    codes[n, c] = np.uint8(np.int32(y) & 0xFF)
            else:
                for c in range(a, e):
                    y = _load(x, xb, src, c, bf16) / s
                    y = y if y < qmax else qmax
                    y = y if y > -qmax else -qmax
                    codes[n, c] = np.uint8(_fp8_bits(y, fmt == 0))


@jit
def dequantize_arrays(codes, scales, index, has_index, out, ob, bf16, fmt, block):
    """out fp32 [N, H] (or ob: the bf16 patterns, int16 [N, H]) from packed rows (codes uint8 [M, RB], scales
    fp32 view from column A / 4)."""
    N = out.shape[0] if not bf16 else ob.shape[0]
    H = out.shape[1] if not bf16 else ob.shape[1]
    nt = (H + block - 1) // block
    for n in range(N):
        src = index[n] if has_index else n
        for t in range(nt):
            a = t * block
            e = min(a + block, H)
            s = scales[src, t] if src >= 0 else np.float32(0.0)
            for c in range(a, e):
                if src < 0:
                    v = np.float32(0.0)
                elif fmt == 2:
                    q = np.int32(codes[src, c])
                    v = np.float32(q - ((q & 0x80) << 1)) * s
                else:
                    v = _fp8_value(np.int32(codes[src, c]), fmt == 0) * s
                if bf16:
                    b = np.int64(f32_bits(v)) & 0xFFFFFFFF
                    if (b & 0x7FFFFFFF) > 0x7F800000:
                        r = np.int64(0x7FC0)
                    else:
                        r = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) & 0xFFFF
                    ob[n, c] = np.int16(r - ((r & 0x8000) << 1))
                else:
                    out[n, c] = v


_EMPTY_F32 = np.zeros((1, 1), dtype=np.float32)
_EMPTY_I16 = np.zeros((1, 1), dtype=np.int16)
_EMPTY_I64 = np.zeros(1, dtype=np.int64)


def _views(packed: torch.Tensor, hidden: int, block: int):
    """(codes uint8 [N, RB], scales fp32 [N, nt]) views of packed rows."""
    rb = packed.shape[1]
    a = -(-hidden // 4) * 4
    nt = -(-hidden // block)
    p = arr(packed)
    return p, p.view(np.float32).reshape(packed.shape[0], rb // 4)[:, a // 4 : a // 4 + nt]


def quantize_rows(x, index, packed, fmt, block) -> None:
    bf16 = x.dtype == torch.bfloat16
    if not bf16 and x.dtype != torch.float32:
        x = x.float()
    xs, xb = (_EMPTY_F32, arr(x.view(torch.int16))) if bf16 else (arr(x), _EMPTY_I16)
    codes, scales = _views(packed, x.shape[1], block)
    idx = arr(index) if index is not None else _EMPTY_I64
    quantize_arrays(xs, xb, bf16, idx, index is not None, codes, scales, _FMT[fmt], block)


def dequantize_rows(packed, index, out, fmt, block) -> None:
    H = out.shape[1]
    codes, scales = _views(packed, H, block)
    idx = arr(index) if index is not None else _EMPTY_I64
    if out.dtype == torch.bfloat16:
        dequantize_arrays(codes, scales, idx, index is not None, _EMPTY_F32, arr(out.view(torch.int16)), True,
                          _FMT[fmt], block)  # fmt: skip
        return
    tmp = out if out.dtype == torch.float32 else torch.empty(out.shape, dtype=torch.float32)
    dequantize_arrays(codes, scales, idx, index is not None, arr(tmp), _EMPTY_I16, False, _FMT[fmt], block)
    if tmp is not out:
        out.copy_(tmp)
