"""Triton kernels of the quantization op family (see quantize.py).

Imported by the triton launchers on first use, so ``import torsh_kernels`` does not import Triton. Triton
reads ``TRITON_INTERPRET`` when these kernels are defined, i.e. on that first import.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._triton import _cast, _nonfinite, _uniform


@triton.jit
def _codes(v, s, e, key, QMAXV: tl.constexpr, STOCHASTIC: tl.constexpr):
    """Integer codes (as fp32) of values v with block scales s."""
    y = tl.where(s > 0, tl.math.div_rn(v, tl.where(s > 0, s, 1.0)), 0.0)
    if STOCHASTIC:
        q = tl.floor(y + _uniform(e, key))
    else:
        q = (y + 12582912.0) - 12582912.0  # 1.5 * 2**23: rounds fp32 |y| < 2**22 to nearest even
    q = tl.where(q == q, q, 0.0)
    return tl.minimum(tl.maximum(q, -QMAXV), QMAXV)


@triton.jit(do_not_specialize=["key"])
def _quantize_kernel(
    x_ptr, q_ptr, s_ptr, bad_ptr, n, nblocks, key, QBLOCK: tl.constexpr, GROUP: tl.constexpr,
    BITS: tl.constexpr, QMAXV: tl.constexpr, STOCHASTIC: tl.constexpr,
):  # fmt: skip
    blk = tl.program_id(0).to(tl.int64) * GROUP + tl.arange(0, GROUP)  # [G] quantization blocks
    key = key.to(tl.uint32)
    if BITS == 8:
        e = blk[:, None] * QBLOCK + tl.arange(0, QBLOCK)[None, :]  # [G, QBLOCK]
        m = e < n
        v = tl.load(x_ptr + e, mask=m, other=0.0).to(tl.float32)
        nbad = tl.sum((_nonfinite(v) & m).to(tl.int32), axis=1)
        s = tl.math.div_rn(tl.max(tl.where(m, tl.abs(v), 0.0), axis=1), QMAXV)
        s = tl.where(nbad > 0, float("nan"), s)
        q = _codes(v, s[:, None], e, key, QMAXV, STOCHASTIC)
        tl.store(q_ptr + e, q.to(tl.int8), mask=m)
    else:
        HALF: tl.constexpr = QBLOCK // 2
        j = tl.arange(0, HALF)[None, :]
        e0 = blk[:, None] * QBLOCK + 2 * j  # [G, HALF] even elements; e0 + 1 the odd ones
        m0 = e0 < n
        m1 = (e0 + 1) < n
        v0 = tl.load(x_ptr + e0, mask=m0, other=0.0).to(tl.float32)
        v1 = tl.load(x_ptr + e0 + 1, mask=m1, other=0.0).to(tl.float32)
        nbad = tl.sum((_nonfinite(v0) & m0).to(tl.int32), axis=1)
        nbad += tl.sum((_nonfinite(v1) & m1).to(tl.int32), axis=1)
        amax = tl.max(tl.where(m0, tl.abs(v0), 0.0), axis=1)
        amax = tl.maximum(amax, tl.max(tl.where(m1, tl.abs(v1), 0.0), axis=1))
        s = tl.where(nbad > 0, float("nan"), tl.math.div_rn(amax, QMAXV))
        q0 = _codes(v0, s[:, None], e0, key, QMAXV, STOCHASTIC).to(tl.int32)
        q1 = _codes(v1, s[:, None], e0 + 1, key, QMAXV, STOCHASTIC).to(tl.int32)
        q1 = tl.where(m1, q1, 0)
        byte = (q0 & 15) | ((q1 & 15) << 4)
        tl.store(q_ptr + blk[:, None] * HALF + j, byte.to(tl.uint8), mask=m0)
    tl.store(s_ptr + blk, s, mask=blk < nblocks)
    tl.atomic_add(bad_ptr, tl.sum(nbad).to(tl.int64))


@triton.jit
def _dequantize_kernel(
    q_ptr, s_ptr, out_ptr, n, nblocks, alpha, QBLOCK: tl.constexpr, GROUP: tl.constexpr,
    BITS: tl.constexpr, ACCUMULATE: tl.constexpr,
):  # fmt: skip
    blk = tl.program_id(0).to(tl.int64) * GROUP + tl.arange(0, GROUP)
    s = tl.load(s_ptr + blk, mask=blk < nblocks, other=0.0)[:, None]
    if BITS == 8:
        e = blk[:, None] * QBLOCK + tl.arange(0, QBLOCK)[None, :]
        m = e < n
        v = tl.load(q_ptr + e, mask=m, other=0).to(tl.float32) * s * alpha
        if ACCUMULATE:
            v = tl.load(out_ptr + e, mask=m, other=0.0).to(tl.float32) + v
        tl.store(out_ptr + e, _cast(v, out_ptr.dtype.element_ty), mask=m)
    else:
        HALF: tl.constexpr = QBLOCK // 2
        j = tl.arange(0, HALF)[None, :]
        e0 = blk[:, None] * QBLOCK + 2 * j
        m0 = e0 < n
        m1 = (e0 + 1) < n
        byte = tl.load(q_ptr + blk[:, None] * HALF + j, mask=m0, other=0).to(tl.int32)
        lo = byte & 15
        hi = (byte >> 4) & 15
        v0 = tl.where(lo >= 8, lo - 16, lo).to(tl.float32) * s * alpha
        v1 = tl.where(hi >= 8, hi - 16, hi).to(tl.float32) * s * alpha
        if ACCUMULATE:
            v0 = tl.load(out_ptr + e0, mask=m0, other=0.0).to(tl.float32) + v0
            v1 = tl.load(out_ptr + e0 + 1, mask=m1, other=0.0).to(tl.float32) + v1
        tl.store(out_ptr + e0, _cast(v0, out_ptr.dtype.element_ty), mask=m0)
        tl.store(out_ptr + e0 + 1, _cast(v1, out_ptr.dtype.element_ty), mask=m1)
