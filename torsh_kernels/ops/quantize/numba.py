"""Numba CUDA kernels of the quantization op family (see api.py).

Imported on first use of the numba provider. Kernels are specialised per dtype combination (the
load/store helpers they close over) and compute in fp32, with every Python scalar argument cast
to fp32 inside the kernel so the rounding matches the Triton kernels and the torch reference. ``cuda``
is a module global: the simulator swaps it while a kernel runs.
"""

from __future__ import annotations

import math
from functools import cache

from numba import cuda, float32, int64

from .. import numba_common as nb
from ..common import new_counter
from ..numba_common import nonfinite, uniform

_MAGIC = 12582912.0  # 1.5 * 2**23: (y + _MAGIC) - _MAGIC rounds fp32 |y| < 2**22 to nearest even


# Quantization: one CUDA block per quantization block (shared-memory absmax), threads stride inside it.


@cuda.jit(device=True, inline=True)
def _code(v, s, i, key, qmax, stochastic):
    if s > 0:
        y = v / s
    else:
        y = float32(0.0)
    if stochastic:
        q = float32(math.floor(y + uniform(i, key)))
    else:
        q = (y + float32(_MAGIC)) - float32(_MAGIC)
    if math.isnan(q):
        q = float32(0.0)
    if q > qmax:
        q = qmax
    if q < -qmax:
        q = -qmax
    return int64(q)


@cache
def _quantize_kernel(xd, bits, stochastic):
    ldx = nb.loader(xd, "f32")
    T = nb.THREADS

    @cuda.jit
    def kernel(x, q, scales, bad, n, block, key, qmax_in):
        qmax = float32(qmax_in)
        amax_sh = cuda.shared.array(T, float32)
        bad_sh = cuda.shared.array(T, int64)
        tid = cuda.threadIdx.x
        b = cuda.blockIdx.x
        start = b * block
        end = start + block
        if end > n:
            end = n
        m = float32(0.0)
        nbad = 0
        i = start + tid
        while i < end:
            v = ldx(x, i)
            if nonfinite(v):
                nbad += 1
            elif abs(v) > m:
                m = abs(v)
            i += T
        amax_sh[tid] = m
        bad_sh[tid] = nbad
        cuda.syncthreads()
        if tid == 0:
            mm = amax_sh[0]
            tb = bad_sh[0]
            for t in range(1, T):
                if amax_sh[t] > mm:
                    mm = amax_sh[t]
                tb += bad_sh[t]
            s = mm / qmax
            if tb > 0:
                s = float32(math.nan)
                cuda.atomic.add(bad, 0, tb)
            scales[b] = s
            amax_sh[0] = s
        cuda.syncthreads()
        s = amax_sh[0]
        if bits == 8:
            i = start + tid
            while i < end:
                q[i] = _code(ldx(x, i), s, i, key, qmax, stochastic)
                i += T
        else:
            p = start + 2 * tid  # element pairs -> one byte each
            while p < end:
                lo = _code(ldx(x, p), s, p, key, qmax, stochastic) & 15
                hi = 0
                if p + 1 < end:
                    hi = _code(ldx(x, p + 1), s, p + 1, key, qmax, stochastic) & 15
                q[p // 2] = lo | (hi << 4)
                p += 2 * T

    return kernel


def quantize(x, q, scales, bits, block, stochastic, key):
    bad = new_counter(x.device)
    k = _quantize_kernel(x.dtype, bits, bool(stochastic))
    nb.launch(k, scales.numel(), nb.THREADS, x.device, nb.as_array(x), nb.as_array(q), nb.as_array(scales),
              nb.as_array(bad), x.numel(), block, key, 127.0 if bits == 8 else 7.0)  # fmt: skip
    return bad


@cache
def _dequantize_kernel(od, bits, accumulate):
    ldo, st = nb.loader(od, "f32"), nb.storer(od)

    @cuda.jit
    def kernel(q, scales, out, n, block, alpha):
        a = float32(alpha)
        b = cuda.blockIdx.x
        s = scales[b]
        start = b * block
        end = start + block
        if end > n:
            end = n
        i = start + cuda.threadIdx.x
        while i < end:
            if bits == 8:
                c = int64(q[i])
            else:
                byte = int64(q[i // 2])
                c = (byte >> 4) & 15 if i % 2 else byte & 15
                if c >= 8:
                    c -= 16
            v = float32(c) * s * a
            if accumulate:
                v = ldo(out, i) + v
            st(out, i, v)
            i += cuda.blockDim.x

    return kernel


def dequantize(q, scales, out, bits, block, alpha, accumulate):
    k = _dequantize_kernel(out.dtype, bits, bool(accumulate))
    nb.launch(k, scales.numel(), nb.THREADS, out.device, nb.as_array(q), nb.as_array(scales), nb.as_array(out),
              out.numel(), block, alpha)  # fmt: skip
