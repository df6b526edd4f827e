"""CPU kernels (Numba's CPU target) of the quantization op family (see api.py).

Imported on the cpu provider's first launch. One pass per quantization block: the block's largest
magnitude from the fp32 bit patterns (an integer maximum, which vectorises and also finds NaN/Inf:
their patterns are the largest), then its codes, while the block is in L1. The arithmetic is the torch
reference's in fp32: ``scale = absmax / qmax``, codes ``rint(x / scale)`` (half to even) or
``floor(x / scale + u)`` with the reference's noise, clamped to +-qmax; a block whose scale is not
positive (all zeros, an underflowed scale) or NaN (a non-finite element) codes to 0.
"""

from __future__ import annotations

import numpy as np
import torch

from ..cpu_common import bits_f32, carray, f32, jit, p_f32, p_i8, p_u8, store, uniform


@jit
def _code(v, s, i, key, qmax, stochastic):
    y = v / s
    c = np.floor(y + uniform(i, key)) if stochastic else np.rint(y)
    c = c if c < qmax else qmax
    return c if c > -qmax else -qmax


@jit
def quantize_arrays(x, q, scales, bits, block, stochastic, key):
    """Codes and scales of fp32 ``x`` (1-D) into ``q`` (int8, or uint8 pairs for 4 bits) and ``scales``;
    returns the number of non-finite elements."""
    n = x.size
    xi = x.view(np.int32)
    qmax = np.float32(127.0) if bits == 8 else np.float32(7.0)
    bad = 0
    for b in range(scales.size):
        a = b * block
        e = min(a + block, n)
        m = e - a
        xb = x[a:e]
        xib = xi[a:e]
        mx = np.int32(0)
        for i in range(m):
            v = xib[i] & 0x7FFFFFFF
            mx = v if v > mx else mx
        if mx >= 0x7F800000:  # NaN or Inf in the block: NaN scale, codes 0, counted
            for i in range(m):
                bad += (xib[i] & 0x7FFFFFFF) >= 0x7F800000
            s = np.float32(np.nan)
        else:
            s = bits_f32(mx) / qmax
        scales[b] = s
        if bits == 8:
            qb = q[a:e]
            if not s > 0:
                for i in range(m):
                    qb[i] = 0
            elif stochastic:
                for i in range(m):
                    qb[i] = np.int8(_code(xb[i], s, a + i, key, qmax, True))
            else:
                for i in range(m):
                    c = np.rint(xb[i] / s)
                    c = c if c < qmax else qmax
                    c = c if c > -qmax else -qmax
                    qb[i] = np.int8(c)
        else:  # two codes a byte, element 2p in the low nibble (blocks are even: no byte straddles two)
            qb = q[a // 2 : (e + 1) // 2]
            if not s > 0:
                for p in range(qb.size):
                    qb[p] = 0
            else:
                for p in range(qb.size):
                    i = 2 * p
                    lo = np.int32(_code(xb[i], s, a + i, key, qmax, stochastic))
                    hi = np.int32(0)
                    if i + 1 < m:
                        hi = np.int32(_code(xb[i + 1], s, a + i + 1, key, qmax, stochastic))
                    qb[p] = np.uint8((lo & 15) | ((hi & 15) << 4))
    return bad


@jit
def dequantize_arrays(q, scales, out, bits, block, alpha, accumulate):
    """``out = (codes * scale) * alpha`` (``+ out`` with ``accumulate``), fp32, the torch provider's order."""
    n = out.size
    a32 = np.float32(alpha)
    scaled = alpha != 1.0
    for b in range(scales.size):
        a = b * block
        e = min(a + block, n)
        m = e - a
        s = scales[b]
        ob = out[a:e]
        if bits == 8:
            qb = q[a:e]
            for i in range(m):
                v = np.float32(qb[i]) * s
                if scaled:
                    v = v * a32
                ob[i] = ob[i] + v if accumulate else v
        else:
            qb = q[a // 2 : (e + 1) // 2]
            for i in range(m):
                byte = np.int32(qb[i >> 1])
                c = (byte >> 4) if i & 1 else (byte & 15)
                c = c - 16 if c >= 8 else c
                v = np.float32(c) * s
                if scaled:
                    v = v * a32
                ob[i] = ob[i] + v if accumulate else v


@jit
def quantize_ptr(xp, n, qp, sp, bits, block, stochastic, key):
    """:func:`quantize_arrays` on addresses: fp32 x [n], q int8 [n] or uint8 [ceil(n / 2)], scales fp32."""
    x = carray(p_f32(xp), (n,))
    s = carray(p_f32(sp), ((n + block - 1) // block,))
    if bits == 8:
        return quantize_arrays(x, carray(p_i8(qp), (n,)), s, 8, block, stochastic, key)
    return quantize_arrays(x, carray(p_u8(qp), ((n + 1) // 2,)), s, 4, block, stochastic, key)


@jit
def dequantize_ptr(qp, sp, op, n, bits, block, alpha, accumulate):
    """:func:`dequantize_arrays` on addresses: q int8 [n] or uint8 [ceil(n / 2)], scales, fp32 out [n]."""
    s = carray(p_f32(sp), ((n + block - 1) // block,))
    out = carray(p_f32(op), (n,))
    if bits == 8:
        dequantize_arrays(carray(p_i8(qp), (n,)), s, out, 8, block, alpha, accumulate)
    else:
        dequantize_arrays(carray(p_u8(qp), ((n + 1) // 2,)), s, out, 4, block, alpha, accumulate)


def quantize(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, bits: int, block: int, stochastic: bool,
             key: int) -> int:  # fmt: skip
    x = f32(x)
    return quantize_ptr(x.data_ptr(), x.numel(), q.data_ptr(), scales.data_ptr(), bits, block, bool(stochastic), key)


def dequantize(q, scales, out, bits, block, alpha, accumulate) -> None:
    n = out.numel()
    store(out, lambda o: dequantize_ptr(q.data_ptr(), scales.data_ptr(), o, n, bits, block, float(alpha),
                                        bool(accumulate)))  # fmt: skip
