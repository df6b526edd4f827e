"""Numba CUDA kernels of the row ops (see api.py).

Imported on first use of the numba provider. One CUDA block per (output row, scale tile): its threads
stride over the tile's channels, reduce the absmax in shared memory, then write the codes (and thread 0 the
scale); decoding, one block per (row, tile) likewise. fp32 arithmetic with the divisions correctly rounded,
the fp8 codes by ``numba_common.fp8_bits`` / ``fp8_value`` (``ops/quantize/fp8.py``'s arithmetic); bf16 travels
as int16 patterns (``numba_common``). ``cuda`` is a module global: the simulator swaps it while a kernel runs.
"""

from __future__ import annotations

from functools import cache

import torch
from numba import cuda, float32, int64

from .. import numba_common as nb
from ..numba_common import fp8_bits, fp8_value

_FMT = {"e4m3": 0, "e5m2": 1, "int8": 2}
_QMAX = {"e4m3": 448.0, "e5m2": 57344.0, "int8": 127.0}
_MAGIC = 12582912.0  # 1.5 * 2**23: (y + _MAGIC) - _MAGIC rounds fp32 |y| < 2**22 to nearest even


@cache
def _quantize_kernel(xd):
    ldx = nb.loader(xd, "f32")
    T = nb.THREADS

    @cuda.jit
    def kernel(x, idx, has_index, codes, scales, H, RB, A, nt, block, fmt, qmax_in):
        qmax = float32(qmax_in)
        amax_sh = cuda.shared.array(T, float32)
        tid = cuda.threadIdx.x
        b = int64(cuda.blockIdx.x)
        n = b // nt
        t = b - n * nt
        src = idx[n] if has_index else n
        a = t * block
        e = a + block
        if e > H:
            e = H
        m = float32(0.0)
        i = a + tid
        while i < e and src >= 0:
            v = abs(ldx(x, src * H + i))
            if not v <= m:  # larger, or NaN (Inf and NaN make the scale NaN)
                m = v if v == v else float32(float("inf"))
            i += T
        amax_sh[tid] = m
        cuda.syncthreads()
        h = T // 2
        while h > 0:  # a tree reduction (T is a power of two)
            if tid < h and amax_sh[tid + h] > amax_sh[tid]:
                amax_sh[tid] = amax_sh[tid + h]
            cuda.syncthreads()
            h //= 2
        mm = amax_sh[0]
        if mm == float32(float("inf")):
            s = float32(float("nan"))
        else:
            s = mm / qmax
        if tid == 0:
            scales[n * (RB // 4) + A // 4 + t] = s
            if t == 0:
                for p in range(H, A):
                    codes[n * RB + p] = 0
        i = a + tid
        while i < e:
            if s > 0:
                y = ldx(x, src * H + i) / s
                if y > qmax:
                    y = qmax
                if y < -qmax:
                    y = -qmax
                if fmt == 2:
                    c = int64((y + float32(_MAGIC)) - float32(_MAGIC)) & 0xFF
                else:
                    c = fp8_bits(y, fmt == 0)
            else:
                c = 0
            codes[n * RB + i] = c
            i += T

    return kernel


@cache
def _dequantize_kernel(od):
    st = nb.storer(od)
    T = nb.THREADS

    @cuda.jit
    def kernel(codes, scales, idx, has_index, out, H, RB, A, nt, block, fmt):
        tid = cuda.threadIdx.x
        b = int64(cuda.blockIdx.x)
        n = b // nt
        t = b - n * nt
        src = idx[n] if has_index else n
        a = t * block
        e = a + block
        if e > H:
            e = H
        s = scales[src * (RB // 4) + A // 4 + t] if src >= 0 else float32(0.0)
        i = a + tid
        while i < e:
            if src < 0:
                v = float32(0.0)
            else:
                c = int64(codes[src * RB + i])
                if fmt == 2:
                    v = float32(c - ((c & 0x80) << 1)) * s
                else:
                    v = fp8_value(c, fmt == 0) * s
            st(out, n * H + i, v)
            i += T

    return kernel


_NO_INDEX = {}


def _index(index, device):
    if index is not None:
        return nb.as_array(index)
    if device not in _NO_INDEX:
        _NO_INDEX[device] = torch.zeros(1, dtype=torch.int64, device=device)
    return nb.as_array(_NO_INDEX[device])


def quantize_rows(x, index, packed, fmt, block) -> None:
    H = x.shape[1]
    N, RB = packed.shape
    A = -(-H // 4) * 4
    nt = -(-H // block)
    nb.launch(
        _quantize_kernel(x.dtype), N * nt, nb.THREADS, x.device, nb.as_array(x.view(-1)), _index(index, x.device),
        index is not None, nb.as_array(packed.view(-1)), nb.as_array(packed.view(-1).view(torch.float32)), H, RB, A,
        nt, block, _FMT[fmt], _QMAX[fmt],
    )  # fmt: skip


def dequantize_rows(packed, index, out, fmt, block) -> None:
    N, H = out.shape
    RB = packed.shape[1]
    A = -(-H // 4) * 4
    nt = -(-H // block)
    nb.launch(
        _dequantize_kernel(out.dtype), N * nt, nb.THREADS, out.device, nb.as_array(packed.view(-1)),
        nb.as_array(packed.view(-1).view(torch.float32)), _index(index, out.device), index is not None,
        nb.as_array(out.view(-1)), H, RB, A, nt, block, _FMT[fmt],
    )  # fmt: skip
