"""Triton kernels of the quantization op family (see api.py).

Imported by the triton launchers on first use, so ``import torsh_kernels`` does not import Triton. Triton
reads ``TRITON_INTERPRET`` when these kernels are defined, i.e. on that first import.

Each kernel runs in two launches (see ``providers.py``): the bulk (``EVEN``), whole programs of GROUP
quantization blocks from element 0, unmasked, so every access of a 16-byte aligned tensor is vectorized
(Triton cannot prove a mask constant over a vector for an arbitrary size); then the rest, whole and partial
blocks from ``start`` (a multiple of QBLOCK), masked to ``< end``. A program loads its elements as one
contiguous tile and regroups them in registers ([GROUP, QBLOCK] for the scales; for int4, codes [TILE/4, 4]
packed into 16-bit words in the bulk, or split into nibble pairs [TILE/2, 2] in the tail), so int4's loads
and stores are as wide as int8's. The non-finite count is not kept here: a block holding NaN/Inf gets a NaN
scale, and the launcher counts from that when asked (``common.LazyNonFiniteCount``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..triton_common import store_out, uniform


@triton.jit
def _codes(v, s, e0, key, QMAXV: tl.constexpr, STOCHASTIC: tl.constexpr):
    """Integer codes (as fp32) of values v [G, QBLOCK] with block scales s [G, 1]; e0 is the index of v[0, 0]."""
    y = tl.where(s > 0, tl.math.div_rn(v, tl.where(s > 0, s, 1.0)), 0.0)
    if STOCHASTIC:
        # The element indices, with a term the compiler cannot fold that makes each element's hash wait for
        # its division (|y| is at most QMAXV, or a few hundred with a subnormal scale: z is 0); else it
        # computes every index and hash of the thread's tile first and holds them (int4: 91 registers, not 56).
        z = (y > 3.0e38).to(tl.uint32)
        G: tl.constexpr = v.shape[0]
        QB: tl.constexpr = v.shape[1]
        off = (tl.arange(0, G)[:, None] * QB + tl.arange(0, QB)[None, :]).to(tl.uint32)
        q = tl.floor(y + uniform((e0.to(tl.uint32) + off) | z, key))
    else:
        q = (y + 12582912.0) - 12582912.0  # 1.5 * 2**23: rounds fp32 |y| < 2**22 to nearest even
    q = tl.where(q == q, q, 0.0)
    return tl.minimum(tl.maximum(q, -QMAXV), QMAXV)


@triton.jit(do_not_specialize=["key"])
def _quantize_kernel(
    x_ptr, q_ptr, s_ptr, start, end, key, QBLOCK: tl.constexpr, GROUP: tl.constexpr,
    BITS: tl.constexpr, QMAXV: tl.constexpr, STOCHASTIC: tl.constexpr, EVEN: tl.constexpr,
):  # fmt: skip
    """GROUP blocks of QBLOCK elements a program: EVEN, whole programs from element 0 (``start``/``end``
    unused); else from element ``start`` (a multiple of QBLOCK), masked to ``< end``."""
    TILE: tl.constexpr = GROUP * QBLOCK
    pid = tl.program_id(0).to(tl.int64)
    blk0 = pid * GROUP if EVEN else start // QBLOCK + pid * GROUP
    e = blk0 * QBLOCK + tl.arange(0, TILE)  # [TILE] element indices (the noise's counter)
    if EVEN:
        v = tl.load(x_ptr + e).to(tl.float32)
    else:
        v = tl.load(x_ptr + e, mask=e < end, other=0.0).to(tl.float32)  # masked elements: 0, finite, code 0
    v = tl.reshape(v, [GROUP, QBLOCK])
    a = tl.abs(v)
    amax = tl.max(tl.where(a == a, a, float("inf")), axis=1)  # [GROUP]: inf iff the block holds NaN or Inf
    s = tl.where(amax < float("inf"), tl.math.div_rn(amax, QMAXV), float("nan"))
    q = _codes(v, s[:, None], blk0 * QBLOCK, key.to(tl.uint32), QMAXV, STOCHASTIC)
    if BITS == 8:
        q = tl.reshape(q, [TILE]).to(tl.int8)
        if EVEN:
            tl.store(q_ptr + e, q)
        else:
            tl.store(q_ptr + e, q, mask=e < end)
    elif EVEN and TILE >= 4:
        # nibbles packed into 16-bit words of 4 codes (each within one thread's contiguous elements), stored
        # through a 16-bit view of q
        c = tl.reshape(q.to(tl.int32) & 15, [TILE // 4, 4])
        w = tl.sum(c << (tl.arange(0, 4) * 4)[None, :], axis=1).to(tl.int16)
        tl.store(q_ptr.to(tl.pointer_type(tl.int16)) + pid * (TILE // 4) + tl.arange(0, TILE // 4), w)
    else:
        lo, hi = tl.split(tl.reshape(q.to(tl.int32), [TILE // 2, 2]))  # elements 2i and 2i + 1
        byte = ((lo & 15) | ((hi & 15) << 4)).to(tl.uint8)
        b = blk0 * (QBLOCK // 2) + tl.arange(0, TILE // 2)
        tl.store(q_ptr + b, byte, mask=2 * b < end)
    blk = blk0 + tl.arange(0, GROUP)
    if EVEN:
        tl.store(s_ptr + blk, s)
    else:
        tl.store(s_ptr + blk, s, mask=blk * QBLOCK < end)


@triton.jit
def _dequantize_kernel(
    q_ptr, s_ptr, out_ptr, start, end, alpha, QBLOCK: tl.constexpr, GROUP: tl.constexpr, BITS: tl.constexpr,
    ACCUMULATE: tl.constexpr, EVEN: tl.constexpr,
):  # fmt: skip
    """GROUP blocks of QBLOCK elements a program, as in _quantize_kernel."""
    TILE: tl.constexpr = GROUP * QBLOCK
    pid = tl.program_id(0).to(tl.int64)
    blk0 = pid * GROUP if EVEN else start // QBLOCK + pid * GROUP
    e = blk0 * QBLOCK + tl.arange(0, TILE)
    if BITS == 8:
        blk = blk0 + tl.arange(0, GROUP)
        if EVEN:
            s = tl.load(s_ptr + blk)
            c = tl.load(q_ptr + e)
        else:
            s = tl.load(s_ptr + blk, mask=blk * QBLOCK < end, other=0.0)
            c = tl.load(q_ptr + e, mask=e < end, other=0)
        v = tl.reshape(tl.reshape(c.to(tl.float32), [GROUP, QBLOCK]) * s[:, None], [TILE]) * alpha
    else:
        HALF: tl.constexpr = QBLOCK // 2
        b = blk0 * HALF + tl.arange(0, TILE // 2)
        if EVEN:
            byte = tl.load(q_ptr + b)
            s = tl.load(s_ptr + b // HALF)  # each byte's scale: one address per thread's 16 bytes
        else:
            byte = tl.load(q_ptr + b, mask=2 * b < end, other=0)
            s = tl.load(s_ptr + b // HALF, mask=2 * b < end, other=0.0)
        byte = byte.to(tl.int8, bitcast=True).to(tl.int32)
        lo = ((byte << 28) >> 28).to(tl.float32) * s  # arithmetic shifts sign-extend the nibbles
        hi = (byte >> 4).to(tl.float32) * s
        v = tl.interleave(lo, hi) * alpha
    store_out(out_ptr, e, v, end, ACCUMULATE, EVEN)
