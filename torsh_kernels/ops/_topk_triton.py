"""Triton kernels of the top-k op family (see topk.py).

Imported by the triton launchers on first use, so ``import torsh_kernels`` does not import Triton. Triton
reads ``TRITON_INTERPRET`` when these kernels are defined, i.e. on that first import.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._triton import _cast, _load_acc, _nonfinite


@triton.jit
def _topk_candidates_kernel(
    x_ptr, r_ptr, cval_ptr, cidx_ptr, cnt_ptr, n, thr, cap, BLOCK: tl.constexpr, HAS_R: tl.constexpr
):
    """Compact the elements with |x + r| >= thr (their fp32 value and index) into slots reserved with
    one atomic per program; cnt[0] counts all candidates (also those past cap), cnt[1] non-finite."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    v = _load_acc(x_ptr, r_ptr, offs, m, HAS_R)
    bad = _nonfinite(v) & m
    sel = m & (tl.abs(v) >= thr) & (~bad)
    s = sel.to(tl.int64)
    base = tl.atomic_add(cnt_ptr, tl.sum(s))
    pos = base + tl.cumsum(s, 0) - 1
    w = sel & (pos < cap)
    tl.store(cval_ptr + pos, v, mask=w)
    tl.store(cidx_ptr + pos, offs.to(cidx_ptr.dtype.element_ty), mask=w)
    tl.atomic_add(cnt_ptr + 1, tl.sum(bad.to(tl.int64)))


@triton.jit
def _scatter_kernel(
    val_ptr, idx_ptr, out_ptr, k, numel, alpha, BLOCK: tl.constexpr, ACCUMULATE: tl.constexpr,
    ATOMIC: tl.constexpr,
):  # fmt: skip
    """out[idx] = alpha * val (or +=; atomically when indices may repeat)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < k
    i = tl.load(idx_ptr + offs, mask=m, other=0).to(tl.int64)
    m = m & (i >= 0) & (i < numel)  # validated before the launch; this keeps memory safe regardless
    v = tl.load(val_ptr + offs, mask=m, other=0.0).to(tl.float32) * alpha
    if ACCUMULATE:
        if ATOMIC:
            tl.atomic_add(out_ptr + i, v, mask=m)
        else:
            v = tl.load(out_ptr + i, mask=m, other=0.0).to(tl.float32) + v
            tl.store(out_ptr + i, _cast(v, out_ptr.dtype.element_ty), mask=m)
    else:
        tl.store(out_ptr + i, _cast(v, out_ptr.dtype.element_ty), mask=m)
