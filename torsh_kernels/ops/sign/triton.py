"""Triton kernels of the sign op family (see ``api.py``).

Imported by the triton launchers on first use, so ``import torsh_kernels`` does not import Triton. Triton
reads ``TRITON_INTERPRET`` when these kernels are defined, i.e. on that first import.

Each kernel runs in two launches (see ``common.whole_programs``): the bulk (``EVEN``), whole programs from element 0,
unmasked, so every access of a 16-byte aligned tensor is vectorized (Triton cannot prove a mask constant
over a vector for an arbitrary size); then the rest, from ``start`` (a multiple of 8: whole sign bytes),
masked to ``< end``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..triton_common import cast, load_acc, store_out


@triton.jit
def _abs_sum_kernel(x_ptr, r_ptr, part_ptr, p0, start, end, BLOCK: tl.constexpr, HAS_R: tl.constexpr,
                    EVEN: tl.constexpr):  # fmt: skip
    """part[p0 + pid] = sum |x + r| over this program's BLOCK elements (from element 0 if EVEN, else from
    ``start``, masked to ``< end``)."""
    pid = tl.program_id(0).to(tl.int64)
    if EVEN:
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        v = tl.load(x_ptr + offs).to(tl.float32)
        if HAS_R:
            v = v + tl.load(r_ptr + offs).to(tl.float32)
    else:
        offs = start + pid * BLOCK + tl.arange(0, BLOCK)
        v = load_acc(x_ptr, r_ptr, offs, offs < end, HAS_R)
    tl.store(part_ptr + p0 + pid, tl.sum(tl.abs(v), axis=0))


@triton.jit
def _sign_pack_kernel(x_ptr, r_ptr, bits_ptr, scale_ptr, start, end, BYTES: tl.constexpr, HAS_R: tl.constexpr,
                      EVEN: tl.constexpr):  # fmt: skip
    """Bytes of 8 signs (bit j of byte i: element 8i + j >= 0) of BYTES bytes a program; with a residual,
    r = v - scale * sign(v)."""
    b = (0 if EVEN else start // 8) + tl.program_id(0).to(tl.int64) * BYTES + tl.arange(0, BYTES)
    j = tl.arange(0, 8)
    e = b[:, None] * 8 + j[None, :]  # [BYTES, 8]
    if EVEN:
        v = tl.load(x_ptr + e).to(tl.float32)
        if HAS_R:
            v = v + tl.load(r_ptr + e).to(tl.float32)
    else:
        m = e < end
        v = load_acc(x_ptr, r_ptr, e, m, HAS_R)
    pos = v >= 0
    if EVEN:
        tl.store(bits_ptr + b, tl.sum(tl.where(pos, 1 << j[None, :], 0), axis=1).to(tl.uint8))
    else:
        tl.store(bits_ptr + b, tl.sum(tl.where(pos & m, 1 << j[None, :], 0), axis=1).to(tl.uint8), mask=8 * b < end)
    if HAS_R:
        s = tl.load(scale_ptr)
        r = cast(v - tl.where(pos, s, -s), r_ptr.dtype.element_ty)
        if EVEN:
            tl.store(r_ptr + e, r)
        else:
            tl.store(r_ptr + e, r, mask=m)


@triton.jit
def _sign_unpack_kernel(bits_ptr, scale_ptr, out_ptr, start, end, alpha, BYTES: tl.constexpr,
                        ACCUMULATE: tl.constexpr, EVEN: tl.constexpr):  # fmt: skip
    """+-alpha * scale for the 8 elements of each of BYTES bytes a program (plus out with ACCUMULATE)."""
    b = (0 if EVEN else start // 8) + tl.program_id(0).to(tl.int64) * BYTES + tl.arange(0, BYTES)
    j = tl.arange(0, 8)
    e = b[:, None] * 8 + j[None, :]
    s = tl.load(scale_ptr) * alpha
    if EVEN:
        byte = tl.load(bits_ptr + b).to(tl.int32)
    else:
        byte = tl.load(bits_ptr + b, mask=8 * b < end, other=0).to(tl.int32)
    v = tl.where(((byte[:, None] >> j[None, :]) & 1) != 0, s, -s)
    store_out(out_ptr, e, v, end, ACCUMULATE, EVEN)
