"""Triton kernels of the orthogonalisation op (see ``providers.py``).

Imported by the triton launchers on first use, so ``import torsh_kernels`` does not import Triton. Triton
reads ``TRITON_INTERPRET`` when these kernels are defined, i.e. on that first import.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..triton_common import cast


@triton.jit
def _gram_factor(G, r, rtol2, RP: tl.constexpr):
    """Upper-triangular T with T^T G T = I on the independent columns (Gram-Schmidt in the G inner
    product, twice); dependent or zero columns get a zero column in T."""
    cols = tl.arange(0, RP)
    T = tl.zeros((RP, RP), dtype=tl.float64)
    for j in range(0, r):  # a runtime loop: unrolling RP=32 columns made 200k-line PTX
        ej = (cols == j).to(tl.float64)
        t = ej
        for _ in tl.static_range(2):
            gt = tl.sum(G * t[None, :], axis=1)
            c = tl.sum(T * gt[:, None], axis=0)
            t = t - tl.sum(T * c[None, :], axis=1)
        nrm2 = tl.sum(t * tl.sum(G * t[None, :], axis=1), axis=0)
        gjj = tl.sum(tl.sum(G * (ej[:, None] * ej[None, :]), axis=1), axis=0)
        ok = (nrm2 > rtol2 * gjj) & (gjj > 0)
        inv = tl.where(ok, 1.0 / tl.sqrt(tl.where(ok, nrm2, 1.0)), 0.0)
        T = T + (t * inv)[:, None] * ej[None, :]
    return T


@triton.jit
def _orthogonalize_kernel(table_ptr, ref_ptr, r, rtol2, ROWS: tl.constexpr, RP: tl.constexpr, ITERS: tl.constexpr):
    """One program per matrix: CholeskyQR, ITERS times, with an fp64 Gram matrix."""
    pid = tl.program_id(0).to(tl.int64)
    base = tl.load(table_ptr + 2 * pid).to(ref_ptr.dtype)
    rows = tl.load(table_ptr + 2 * pid + 1)
    cols = tl.arange(0, RP)
    cm = cols < r
    ri = tl.arange(0, ROWS).to(tl.int64)
    for _ in tl.static_range(ITERS):
        G = tl.zeros((RP, RP), dtype=tl.float64)
        for r0 in range(0, rows, ROWS):
            rr = r0 + ri
            msk = (rr < rows)[:, None] & cm[None, :]
            a = tl.load(base + rr[:, None] * r + cols[None, :], mask=msk, other=0.0).to(tl.float64)
            G += tl.sum(a[:, :, None] * a[:, None, :], axis=0)
        T = _gram_factor(G, r, rtol2, RP)
        for r0 in range(0, rows, ROWS):
            rr = r0 + ri
            msk = (rr < rows)[:, None] & cm[None, :]
            ptrs = base + rr[:, None] * r + cols[None, :]
            a = tl.load(ptrs, mask=msk, other=0.0).to(tl.float64)
            o = tl.sum(a[:, :, None] * T[None, :, :], axis=1)
            tl.store(ptrs, cast(o, ref_ptr.dtype.element_ty), mask=msk)
