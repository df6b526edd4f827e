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
def _fp8_bits(y, small, magic, rebias, shift):
    """fp8 code (0..255) of a saturated, non-NaN fp32 value: fp8_bits_py, branch-free (both roundings computed,
    one selected), with the format's constants passed in (e4m3: 121 << 23, 141 << 23, 120 << 23, 20)."""
    b = np.int64(f32_bits(y)) & 0xFFFFFFFF
    sign = (b >> 24) & 0x80
    a = b & 0x7FFFFFFF
    sub = (np.int64(f32_bits(np.abs(y) + bits_f32(np.int32(magic)))) & 0xFFFFFFFF) - magic
    nor = (a - rebias + ((1 << (shift - 1)) - 1) + ((a >> shift) & 1)) >> shift
    return (sub if a < small else nor) | sign


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
    from column A / 4 on: passed as the view starting there). Per tile: the source values into an fp32 buffer
    (a bf16 pattern shifted), the absmax of their bit patterns, then the codes: loops from 0 over slices, which
    LLVM vectorises."""
    N = codes.shape[0]
    H = x.shape[1] if not bf16 else xb.shape[1]
    nt = (H + block - 1) // block
    qmax = np.float32(448.0) if fmt == 0 else (np.float32(57344.0) if fmt == 1 else np.float32(127.0))
    if fmt == 0:
        small, magic, rebias, shift = 121 << 23, 141 << 23, 120 << 23, 20
    else:
        small, magic, rebias, shift = 113 << 23, 134 << 23, 112 << 23, 21
    pad = (H + 3) // 4 * 4
    buf = np.empty(block, dtype=np.float32)
    bits = buf.view(np.int32)
    for n in range(N):
        src = index[n] if has_index else n
        row = codes[n]
        for c in range(H, pad):
            row[c] = 0
        for t in range(nt):
            a = t * block
            m = min(a + block, H) - a
            if src < 0:
                for i in range(m):
                    buf[i] = 0.0
            elif bf16:
                xr = xb[src, a : a + m]
                for i in range(m):
                    bits[i] = np.int32(xr[i]) << 16
            else:
                xr = x[src, a : a + m]
                for i in range(m):
                    buf[i] = xr[i]
            mx = np.int32(0)
            for i in range(m):
                v = bits[i] & 0x7FFFFFFF
                mx = v if v > mx else mx
            s = np.float32(np.nan) if mx >= 0x7F800000 else bits_f32(mx) / qmax
            scales[n, t] = s
            out = row[a : a + m]
            if not s > 0:
                for i in range(m):
                    out[i] = 0
            elif fmt == 2:
                for i in range(m):
                    y = np.rint(buf[i] / s)
                    y = y if y < qmax else qmax
                    y = y if y > -qmax else -qmax
                    out[i] = np.uint8(np.int32(y) & 0xFF)
            else:
                for i in range(m):
                    y = buf[i] / s
                    y = y if y < qmax else qmax
                    y = y if y > -qmax else -qmax
                    out[i] = np.uint8(_fp8_bits(y, small, magic, rebias, shift))


@jit
def dequantize_arrays(codes, scales, index, has_index, out, ob, bf16, fmt, block):
    """out fp32 [N, H] (or ob: the bf16 patterns, int16 [N, H]) from packed rows (codes uint8 [M, RB], scales
    fp32 view from column A / 4): per tile, loops from 0 over slices (LLVM vectorises them)."""
    N = out.shape[0] if not bf16 else ob.shape[0]
    H = out.shape[1] if not bf16 else ob.shape[1]
    nt = (H + block - 1) // block
    buf = np.empty(block, dtype=np.float32)
    bits = buf.view(np.int32)
    for n in range(N):
        src = index[n] if has_index else n
        for t in range(nt):
            a = t * block
            m = min(a + block, H) - a
            if src < 0:
                for i in range(m):
                    buf[i] = 0.0
            else:
                s = scales[src, t]
                cr = codes[src, a : a + m]
                if fmt == 2:
                    for i in range(m):
                        q = np.int32(cr[i])
                        buf[i] = np.float32(q - ((q & 0x80) << 1)) * s
                else:
                    for i in range(m):
                        buf[i] = _fp8_value(np.int32(cr[i]), fmt == 0) * s
            if bf16:
                orow = ob[n, a : a + m]
                for i in range(m):
                    b = np.int64(bits[i]) & 0xFFFFFFFF
                    r = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) & 0xFFFF
                    r = 0x7FC0 if (b & 0x7FFFFFFF) > 0x7F800000 else r
                    orow[i] = np.int16(r - ((r & 0x8000) << 1))
            else:
                orow = out[n, a : a + m]
                for i in range(m):
                    orow[i] = buf[i]


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
