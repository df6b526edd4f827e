"""Triton kernels of the top-k op family (see ``providers.py``).

Imported by the triton launchers on first use, so ``import torsh_kernels`` does not import Triton. Triton
reads ``TRITON_INTERPRET`` when these kernels are defined, i.e. on that first import.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..triton_common import cast, load_acc, nonfinite


@triton.jit
def _topk_candidates_kernel(x_ptr, r_ptr, cval_ptr, cidx_ptr, cnt_ptr, start, end, thr, cap, BLOCK: tl.constexpr,
                            VEC: tl.constexpr, HAS_R: tl.constexpr):  # fmt: skip
    """Compact the elements of [start, end) (see common.spans) with |x + r| >= thr (their fp32 value and global
    index) into slots reserved with one atomic per program; cnt[0] counts all candidates (also those past cap),
    cnt[1] the non-finite ones. Candidates keep their order inside a program.

    The block is a [BLOCK // VEC, VEC] tile whose rows are 16 bytes of x: each thread loads whole rows (128-bit
    loads in the bulk launch) and stores its candidates one column at a time, so the one-element stores (their
    slots are data-dependent) need no layout conversion of the tile through shared memory (what a flat block's
    scattered store costs: 80-96 registers). The slot counts are int32 scans (a block holds < 2**31)."""
    ROWS: tl.constexpr = BLOCK // VEC
    blk = start + tl.program_id(0).to(tl.int64) * BLOCK
    rows = tl.arange(0, ROWS)
    cols = tl.arange(0, VEC)
    offs = blk + (rows[:, None] * VEC + cols[None, :])  # [ROWS, VEC] global indices
    m = offs < end
    v = load_acc(x_ptr, r_ptr, offs, m, HAS_R)
    bad = nonfinite(v) & m
    sel = m & (tl.abs(v) >= thr) & (~bad)
    s = sel.to(tl.int32)
    rs = tl.sum(s, 1)  # [ROWS] candidates per row
    base = tl.atomic_add(cnt_ptr, tl.sum(rs, 0).to(tl.int64))
    pos = (tl.cumsum(rs, 0) - rs)[:, None] + (tl.cumsum(s, 1) - s)  # [ROWS, VEC] slot in the reservation
    room = tl.minimum(tl.maximum(cap - base, 0), BLOCK).to(tl.int32)  # the reservation's slots below cap
    pos = tl.where(sel & (pos < room), pos, -1)  # -1: not stored
    bits = v.to(tl.int32, bitcast=True)
    for j in tl.static_range(VEC):  # column j (in-thread selects: exact, whatever the values)
        pj = tl.sum(tl.where(cols[None, :] == j, pos, 0), 1)
        vj = tl.sum(tl.where(cols[None, :] == j, bits, 0), 1).to(tl.float32, bitcast=True)
        ok = pj >= 0
        tl.store(cval_ptr + base + pj, vj, mask=ok)
        tl.store(cidx_ptr + base + pj, (blk + (rows * VEC + j)).to(cidx_ptr.dtype.element_ty), mask=ok)
    nbad = tl.sum(tl.sum(bad.to(tl.int32), 1), 0)
    if nbad > 0:
        tl.atomic_add(cnt_ptr + 1, nbad.to(tl.int64))


@triton.jit
def _scatter_kernel(val_ptr, idx_ptr, out_ptr, start, end, numel, alpha, BLOCK: tl.constexpr, VEC: tl.constexpr,
                    ACCUMULATE: tl.constexpr, ATOMIC: tl.constexpr):  # fmt: skip
    """out[idx] = alpha * val (or +=; atomically when indices may repeat) for the entries [start, end) (see
    common.spans). Values and indices are read as a [BLOCK // VEC, VEC] tile with 128-bit loads in the bulk launch
    (their mask is the span's alone); the scattered accesses of out, one element each, go one column at a time
    (no layout conversion through shared memory, as in _topk_candidates_kernel)."""
    ROWS: tl.constexpr = BLOCK // VEC
    rows = tl.arange(0, ROWS)
    cols = tl.arange(0, VEC)
    offs = start + tl.program_id(0).to(tl.int64) * BLOCK + (rows[:, None] * VEC + cols[None, :])
    m = offs < end
    i = tl.load(idx_ptr + offs, mask=m, other=-1).to(tl.int64)
    v = (tl.load(val_ptr + offs, mask=m, other=0.0).to(tl.float32) * alpha).to(tl.int32, bitcast=True)
    i = tl.where((i >= 0) & (i < numel), i, -1)  # validated before the launch; this keeps memory safe regardless
    for j in tl.static_range(VEC):  # column j (in-thread selects: exact)
        ij = tl.sum(tl.where(cols[None, :] == j, i, 0), 1)
        vj = tl.sum(tl.where(cols[None, :] == j, v, 0), 1).to(tl.float32, bitcast=True)
        mj = ij >= 0
        if ACCUMULATE:
            if ATOMIC:
                tl.atomic_add(out_ptr + ij, vj, mask=mj)
            else:
                vj = tl.load(out_ptr + ij, mask=mj, other=0.0).to(tl.float32) + vj
                tl.store(out_ptr + ij, cast(vj, out_ptr.dtype.element_ty), mask=mj)
        else:
            tl.store(out_ptr + ij, cast(vj, out_ptr.dtype.element_ty), mask=mj)
