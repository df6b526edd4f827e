"""Triton kernels of the sign op family (see sign.py).

Imported by the triton launchers on first use, so ``import torsh_kernels`` does not import Triton. Triton
reads ``TRITON_INTERPRET`` when these kernels are defined, i.e. on that first import.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._triton import _cast, _load_acc, _nonfinite


@triton.jit
def _abs_sum_kernel(x_ptr, r_ptr, part_ptr, bad_ptr, n, BLOCK: tl.constexpr, HAS_R: tl.constexpr):
    """part[pid] = sum |x + r| over this program's elements; bad += non-finite count."""
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    v = _load_acc(x_ptr, r_ptr, offs, m, HAS_R)
    tl.store(part_ptr + pid, tl.sum(tl.abs(v), axis=0))
    tl.atomic_add(bad_ptr, tl.sum((_nonfinite(v) & m).to(tl.int64)))


@triton.jit
def _sign_pack_kernel(x_ptr, r_ptr, bits_ptr, scale_ptr, n, nbytes, BYTES: tl.constexpr, HAS_R: tl.constexpr):
    b = tl.program_id(0).to(tl.int64) * BYTES + tl.arange(0, BYTES)
    j = tl.arange(0, 8)
    e = b[:, None] * 8 + j[None, :]  # [BYTES, 8]
    m = e < n
    v = _load_acc(x_ptr, r_ptr, e, m, HAS_R)
    pos = v >= 0
    byte = tl.sum(tl.where(pos & m, 1 << j[None, :], 0), axis=1)
    tl.store(bits_ptr + b, byte.to(tl.uint8), mask=b < nbytes)
    if HAS_R:
        s = tl.load(scale_ptr)
        tl.store(r_ptr + e, _cast(v - tl.where(pos, s, -s), r_ptr.dtype.element_ty), mask=m)


@triton.jit
def _sign_unpack_kernel(bits_ptr, scale_ptr, out_ptr, n, nbytes, alpha, BYTES: tl.constexpr, ACCUMULATE: tl.constexpr):
    b = tl.program_id(0).to(tl.int64) * BYTES + tl.arange(0, BYTES)
    j = tl.arange(0, 8)
    e = b[:, None] * 8 + j[None, :]
    m = e < n
    byte = tl.load(bits_ptr + b, mask=b < nbytes, other=0).to(tl.int32)
    s = tl.load(scale_ptr) * alpha
    v = tl.where(((byte[:, None] >> j[None, :]) & 1) != 0, s, -s)
    if ACCUMULATE:
        v = tl.load(out_ptr + e, mask=m, other=0.0).to(tl.float32) + v
    tl.store(out_ptr + e, _cast(v, out_ptr.dtype.element_ty), mask=m)
