"""CPU kernel (Numba's CPU target) of the orthogonalisation op (see ``providers.py``).

Imported on the cpu provider's first launch. CholeskyQR2 as the GPU kernels run it: per iteration the
fp64 Gram matrix G = A^T A, the upper-triangular T with T^T G T = I on the independent columns
(Gram-Schmidt in the G inner product, twice, r x r work), then A = A T; the iterations stop once the
stored matrix's G is the identity to within rounding (``_iterate``). A column whose part orthogonal
to the earlier ones is below ``rtol`` of its norm gets a zero column of T, so it becomes zero. fp32 and
fp64 matrices are worked on in place; 16-bit ones through an fp32 copy. A batch, or many matrices, go in
one call, through one span of memory and their offsets.

The two products are loops of this module, not BLAS (Numba's ``np.dot`` calls BLAS through SciPy, which
would make SciPy a dependency of the package): the matrix goes through in chunks of ``_C`` rows, each
converted to fp64 and transposed into an [rp, _C] buffer (rp: r rounded up to whole blocks of ``_RB``
columns, the extra rows zero), so that every inner loop runs over _C contiguous doubles whatever r is,
and vectorises. Both products work in 4 x 4 register blocks (16 running sums, or 16 entries of T, per
two loads of four rows): 4x fewer loads per multiply-add than a loop per pair of columns, which is
what made the kernel load-bound and slower than Householder QR (LAPACK) from r = 2 on. The transposes
are compiled once per common rank (1-8, 16, 32: the loads of a row are then one interleaved vector
access) and generically otherwise. Those loops are compiled with the reassociation and contraction of
floating-point operations allowed (``_fjit``: fp64 sums in the order LLVM's vector code takes, with
fused multiply-adds, as a BLAS sums them; no assumption that values are finite, so NaN and Inf
propagate and the finite check holds). Everything stays fp64 until a row is stored.
"""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from numba import njit

from ..cpu_common import arr, jit, span
from .providers import element_groups

__all__ = ["ortho_batch", "ortho_span", "ortho_tensor", "orthogonalize"]


@jit
def _gram_factor(g, tm, r, rtol2):
    """tm (r x r) = upper-triangular T with T^T G T = I on the independent columns. Column j's t has
    entries 0..j only (it starts as e_j and subtracts earlier columns of T), so every loop stops at j: the
    same sums (the entries past j are zeros), about half the work of loops over all r."""
    t = np.empty(r)
    gt = np.empty(r)
    c = np.empty(r)
    tm[:, :] = 0.0
    for j in range(r):
        n = j + 1
        for a in range(n):
            t[a] = 1.0 if a == j else 0.0
        for _ in range(2):
            for a in range(n):
                acc = 0.0
                for b in range(n):
                    acc += g[a, b] * t[b]
                gt[a] = acc
            for i in range(j):
                acc = 0.0
                for a in range(i + 1):  # (T is upper-triangular: tm[a, i] = 0 for a > i)
                    acc += tm[a, i] * gt[a]
                c[i] = acc
            for a in range(n):
                acc = t[a]
                for i in range(a, j):
                    acc -= tm[a, i] * c[i]
                t[a] = acc
        nrm2 = 0.0
        for a in range(n):
            acc = 0.0
            for b in range(n):
                acc += g[a, b] * t[b]
            nrm2 += t[a] * acc
        gjj = g[j, j]
        inv = 0.0
        if gjj > 0 and nrm2 > rtol2 * gjj:
            inv = 1.0 / math.sqrt(nrm2)
        for a in range(n):
            tm[a, j] = t[a] * inv


_C = 512  # rows per chunk up to r = 8: an [rp, _C] fp64 buffer per operand, 32 KiB each at r = 8
_C_WIDE = 128  # rows per chunk beyond (16 KiB each at r = 16, 32 KiB at r = 32)
_RB = 4  # columns per register block of the products

_EXACT = {torch.float32: 2.0**-26, torch.float64: 2.0**-55}
"""A factor within this of 1 leaves every element of the dtype as it is (see ``_one_column``)."""

_fjit = njit(cache=True, nogil=True, fastmath={"reassoc", "contract"})
"""The cpu provider's :func:`jit`, with fp sums reassociated and multiply-adds fused (the products)."""
_ijit = njit(cache=True, nogil=True, inline="always")
"""Inlined into its callers where ``r`` is a constant: the loops over a row's columns are then unrolled."""


@_ijit
def _load_r(af, n, r, xb):
    for k in range(n):
        for p in range(r):
            xb[p, k] = af[k * r + p]
    for k in range(xb.shape[1] - n):
        for p in range(r):
            xb[p, n + k] = 0.0


@_ijit
def _store_r(yb, af, n, r):
    for k in range(n):
        for q in range(r):
            af[k * r + q] = yb[q, k]


@jit
def _load(af, n, r, xb):
    """xb[p, k] = af[k * r + p] in fp64 for the chunk's n rows; zero for k >= n."""
    if r == 1:
        _load_r(af, n, 1, xb)
    elif r == 2:
        _load_r(af, n, 2, xb)
    elif r == 3:
        _load_r(af, n, 3, xb)
    elif r == 4:
        _load_r(af, n, 4, xb)
    elif r == 8:
        _load_r(af, n, 8, xb)
    elif r == 16:
        _load_r(af, n, 16, xb)
    elif r == 32:
        _load_r(af, n, 32, xb)
    else:
        _load_r(af, n, r, xb)


@jit
def _store(yb, af, n, r):
    """af[k * r + q] = yb[q, k] rounded to af's dtype, for the chunk's n rows."""
    if r == 1:
        _store_r(yb, af, n, 1)
    elif r == 2:
        _store_r(yb, af, n, 2)
    elif r == 3:
        _store_r(yb, af, n, 3)
    elif r == 4:
        _store_r(yb, af, n, 4)
    elif r == 8:
        _store_r(yb, af, n, 8)
    elif r == 16:
        _store_r(yb, af, n, 16)
    elif r == 32:
        _store_r(yb, af, n, 32)
    else:
        _store_r(yb, af, n, r)


@_fjit
def _gram_small(g, xb, r):
    """g[p, q] += the chunk's sum of x_p x_q for q >= p, below one block (r < _RB)."""
    for p in range(r):
        xp = xb[p]
        for q in range(p, r):
            xq = xb[q]
            s = 0.0
            for k in range(xb.shape[1]):
                s += xp[k] * xq[k]
            g[p, q] += s


@_fjit
def _gram_block(g, xb, pb, qb):
    """g[pb:pb+4, qb:qb+4] += the chunk's products of columns pb.. and qb.. (16 running sums)."""
    x0, x1, x2, x3 = xb[pb], xb[pb + 1], xb[pb + 2], xb[pb + 3]
    y0, y1, y2, y3 = xb[qb], xb[qb + 1], xb[qb + 2], xb[qb + 3]
    s00 = s01 = s02 = s03 = s10 = s11 = s12 = s13 = 0.0
    s20 = s21 = s22 = s23 = s30 = s31 = s32 = s33 = 0.0
    for k in range(xb.shape[1]):
        a0, a1, a2, a3 = x0[k], x1[k], x2[k], x3[k]
        b0, b1, b2, b3 = y0[k], y1[k], y2[k], y3[k]
        s00 += a0 * b0
        s01 += a0 * b1
        s02 += a0 * b2
        s03 += a0 * b3
        s10 += a1 * b0
        s11 += a1 * b1
        s12 += a1 * b2
        s13 += a1 * b3
        s20 += a2 * b0
        s21 += a2 * b1
        s22 += a2 * b2
        s23 += a2 * b3
        s30 += a3 * b0
        s31 += a3 * b1
        s32 += a3 * b2
        s33 += a3 * b3
    sums = ((s00, s01, s02, s03), (s10, s11, s12, s13), (s20, s21, s22, s23), (s30, s31, s32, s33))
    for i in range(_RB):
        for j in range(_RB):
            g[pb + i, qb + j] += sums[i][j]


@_fjit
def _gram_diag(g, xb, pb):
    """g[pb:pb+4, pb:pb+4] += the chunk's products of columns pb.. with each other, upper triangle (10 sums)."""
    x0, x1, x2, x3 = xb[pb], xb[pb + 1], xb[pb + 2], xb[pb + 3]
    s00 = s01 = s02 = s03 = s11 = s12 = s13 = s22 = s23 = s33 = 0.0
    for k in range(xb.shape[1]):
        a0, a1, a2, a3 = x0[k], x1[k], x2[k], x3[k]
        s00 += a0 * a0
        s01 += a0 * a1
        s02 += a0 * a2
        s03 += a0 * a3
        s11 += a1 * a1
        s12 += a1 * a2
        s13 += a1 * a3
        s22 += a2 * a2
        s23 += a2 * a3
        s33 += a3 * a3
    g[pb, pb] += s00
    g[pb, pb + 1] += s01
    g[pb, pb + 2] += s02
    g[pb, pb + 3] += s03
    g[pb + 1, pb + 1] += s11
    g[pb + 1, pb + 2] += s12
    g[pb + 1, pb + 3] += s13
    g[pb + 2, pb + 2] += s22
    g[pb + 2, pb + 3] += s23
    g[pb + 3, pb + 3] += s33


@jit
def _gram_add(g, xb, r):
    """g[p, q] += the chunk's sum of x_p x_q, for q >= p (the mirror fills q < p)."""
    rp = xb.shape[0]
    if rp < _RB:
        _gram_small(g, xb, r)
        return
    for pb in range(0, rp, _RB):
        _gram_diag(g, xb, pb)
        for qb in range(pb + _RB, rp, _RB):
            _gram_block(g, xb, pb, qb)


@jit
def _mirror(g, r):
    for p in range(r):
        for q in range(p):
            g[p, q] = g[q, p]


@_fjit
def _mul_small(xb, tm, yb, r):
    for q in range(r):
        zq = yb[q]
        for k in range(xb.shape[1]):
            zq[k] = 0.0
        for p in range(q + 1):
            t = tm[p, q]
            xp = xb[p]
            for k in range(xb.shape[1]):
                zq[k] += xp[k] * t


@_fjit
def _mul_block(xb, tm, yb, pb, qb):
    """yb[qb:qb+4] += the chunk's columns pb..pb+3 times T[pb:pb+4, qb:qb+4] (16 entries held)."""
    x0, x1, x2, x3 = xb[pb], xb[pb + 1], xb[pb + 2], xb[pb + 3]
    z0, z1, z2, z3 = yb[qb], yb[qb + 1], yb[qb + 2], yb[qb + 3]
    t00, t01, t02, t03 = tm[pb, qb], tm[pb, qb + 1], tm[pb, qb + 2], tm[pb, qb + 3]
    t10, t11, t12, t13 = tm[pb + 1, qb], tm[pb + 1, qb + 1], tm[pb + 1, qb + 2], tm[pb + 1, qb + 3]
    t20, t21, t22, t23 = tm[pb + 2, qb], tm[pb + 2, qb + 1], tm[pb + 2, qb + 2], tm[pb + 2, qb + 3]
    t30, t31, t32, t33 = tm[pb + 3, qb], tm[pb + 3, qb + 1], tm[pb + 3, qb + 2], tm[pb + 3, qb + 3]
    for k in range(xb.shape[1]):
        a0, a1, a2, a3 = x0[k], x1[k], x2[k], x3[k]
        z0[k] += (a0 * t00 + a1 * t10) + (a2 * t20 + a3 * t30)
        z1[k] += (a0 * t01 + a1 * t11) + (a2 * t21 + a3 * t31)
        z2[k] += (a0 * t02 + a1 * t12) + (a2 * t22 + a3 * t32)
        z3[k] += (a0 * t03 + a1 * t13) + (a2 * t23 + a3 * t33)


@jit
def _mul(xb, tm, yb, r):
    """yb = the chunk's rows of A T (T upper-triangular, zero past r: block qb sums blocks pb <= qb)."""
    rp = xb.shape[0]
    if rp < _RB:
        _mul_small(xb, tm, yb, r)
        return
    yb[:, :] = 0.0
    for qb in range(0, rp, _RB):
        for pb in range(0, qb + _RB, _RB):
            _mul_block(xb, tm, yb, pb, qb)


@jit
def _gram(af, m, r, xb, g):
    """g = the fp64 Gram matrix of af ([m, r], flat), its upper triangle mirrored."""
    g[:, :] = 0.0
    c = xb.shape[1]
    for k0 in range(0, m, c):
        n = min(c, m - k0)
        _load(af[k0 * r : (k0 + n) * r], n, r, xb)
        _gram_add(g, xb, r)
    _mirror(g, r)


@jit
def _round32(yb):
    """yb's values rounded to fp32 (as storing them in an fp32 matrix rounds them), kept in fp64."""
    for p in range(yb.shape[0]):
        row = yb[p]
        for k in range(row.size):
            row[k] = np.float64(np.float32(row[k]))


@jit
def _settled(g, r, tau2):
    """Every column of the columns' Gram matrix g is the identity's within ``sqrt(tau2)`` in 2-norm (a zero
    column, one the last iteration zeroed, aside: a further iteration leaves it zero)."""
    for q in range(r):
        if g[q, q] == 0.0:
            continue
        s = 0.0
        for p in range(r):
            if g[p, p] != 0.0:
                e = g[p, q] - (1.0 if p == q else 0.0)
                s += e * e
        if not s <= tau2:  # (a NaN is not settled)
            return False
    return True


@jit
def _iterate(af, m, r, g, rtol2, iters, xb, yb, tm, tau2):
    """The CholeskyQR iterations on af, given its Gram matrix g. Each iteration reads the matrix as stored:
    it is rounded to its dtype after each iteration, as the GPU kernels store it; the next iteration's G
    is summed in the same pass as the rows are stored. Once each column of that G = I + E is the
    identity's within half the unit roundoff u (||E e_j|| <= u / 2, ``tau2`` = (u / 2)^2), the iterations
    left stop: the next one's T is I - E / 2 to first order (its strict upper part -E), which moves column
    j by at most ||Q E e_j|| ~ ||E e_j||, below the rounding it is stored with again. (With fp64 sums a
    fp32 matrix of moderate condition takes one iteration: CholeskyQR2's second finds nothing to fix.)"""
    for it in range(iters):
        if it > 0 and _settled(g, r, tau2):
            break
        _gram_factor(g[:r, :r], tm[:r, :r], r, rtol2)
        more = it + 1 < iters
        if more:
            g[:, :] = 0.0
        c = xb.shape[1]
        for k0 in range(0, m, c):
            n = min(c, m - k0)
            seg = af[k0 * r : (k0 + n) * r]
            _load(seg, n, r, xb)
            _mul(xb, tm, yb, r)
            _store(yb, seg, n, r)
            if more:  # the next G, of the rows as stored (yb rounded as the store rounded them)
                if af.itemsize == 4:
                    _round32(yb)
                _gram_add(g, yb, r)
        if more:
            _mirror(g, r)


@_fjit
def _finite_probe(a):
    """0.0 when every element of ``a`` is finite, else NaN (x * 0 is NaN for NaN and Inf)."""
    s = 0.0
    for k in range(a.size):
        s += a[k] * 0.0
    return s


@_fjit
def _square_norm(af):
    g = 0.0
    for k in range(af.size):
        g += np.float64(af[k]) * np.float64(af[k])
    return g


@_fjit
def _one_column(af, g, rtol2, iters, exact):
    """``_iterate`` for r = 1, straight on the column, given its squared norm ``g`` (G; T is its inverse
    norm, zero for a zero column: the test of ``_gram_factor`` with j = 0 is g > 0). A later iteration
    whose factor is within ``exact`` of 1 (a quarter of the dtype's relative half ulp) would store every
    element unchanged (each product is nearer its element than a quarter ulp), so it and the ones after
    it are skipped: the same bits, one pass less."""
    for it in range(iters):
        inv = 1.0 / math.sqrt(g) if g > 0 and g > rtol2 * g else 0.0
        if it > 0 and abs(inv - 1.0) < exact:
            break
        g = 0.0
        for k in range(af.size):
            af[k] = np.float64(af[k]) * inv  # rounded to af's dtype
            v = np.float64(af[k])
            g += v * v
    return True


@jit
def _all_finite(base, offs, rows, r):
    """Every element of every matrix is finite (one pass over all of them, nothing written)."""
    bad = 0.0
    for k in range(offs.size):
        bad += _finite_probe(base[offs[k] : offs[k] + rows[k] * r])
    return bad == 0.0


@jit
def ortho_span(base, offs, rows, r, rtol2, iters, check_finite, exact):
    """Every matrix k ([rows[k], r] at base[offs[k]:]) orthonormalised in place; False, with nothing
    written, when ``check_finite`` and an element is NaN/Inf (one column: a non-finite squared norm of any
    matrix, all computed before the first write; one matrix: a non-finite diagonal of its Gram matrix;
    several: every element probed before the first write)."""
    nb = offs.size
    if r == 1:  # the norms first (which see any NaN/Inf), then one scaling pass: two passes, as in plain torch
        gs = np.empty(nb)
        for k in range(nb):
            gs[k] = _square_norm(base[offs[k] : offs[k] + rows[k]])
            if check_finite and not np.isfinite(gs[k]):
                return False
        for k in range(nb):
            _one_column(base[offs[k] : offs[k] + rows[k]], gs[k], rtol2, iters, exact)
        return True
    if check_finite and nb > 1 and not _all_finite(base, offs, rows, r):
        return False
    rp = r if r < _RB else -(-r // _RB) * _RB  # whole blocks of columns (below one block: r itself)
    c = _C if rp <= 8 else _C_WIDE  # chunk rows: both buffers within L1 and L2
    c = min(c, -(-rows.max() // 8) * 8)  # no longer than the longest matrix (whole vectors): the loops run over c
    xb = np.zeros((rp, c))  # rows p >= r stay zero
    yb = np.zeros((rp, c))
    tm = np.zeros((rp, rp))
    g = np.zeros((rp, rp))
    for k in range(nb):
        af = base[offs[k] : offs[k] + rows[k] * r]
        _gram(af, rows[k], r, xb, g)
        if check_finite and nb == 1:
            for p in range(r):
                if not np.isfinite(g[p, p]):
                    return False
        _iterate(af, rows[k], r, g, rtol2, iters, xb, yb, tm, 4.0 * exact * exact)
    return True


@jit
def ortho_batch(flat, b, m, r, rtol2, iters, check_finite, exact):
    """``ortho_span`` on ``b`` matrices [m, r] back to back in ``flat`` (the offsets made here: a call
    from Python with scalars costs less than building them there)."""
    offs = np.arange(0, b * m * r, m * r)
    rows = np.full(b, m, dtype=np.int64)
    return ortho_span(flat, offs, rows, r, rtol2, iters, check_finite, exact)


PARALLEL_MIN_WORK = 1 << 20
"""A batch whose work (elements x columns) is at least this is split over torch's intra-op threads
(``torch.get_num_threads()``): the kernel releases the GIL, and each thread takes whole matrices. Below it
(64 x [2048, 2] on a 2-core VM) the threads' start costs more than they save."""
_pool: tuple[int, int, ThreadPoolExecutor] | None = None  # (its process, its size, the pool)


def _workers(n: int) -> ThreadPoolExecutor:
    """A pool of at least ``n`` threads of this process (a forked child makes its own: its parent's threads
    did not follow it)."""
    global _pool
    if _pool is None or _pool[0] != os.getpid() or _pool[1] < n:
        _pool = (os.getpid(), n, ThreadPoolExecutor(n, thread_name_prefix="torsh-orthogonalize"))
    return _pool[2]


def ortho_tensor(t: torch.Tensor, rtol: float, iters: int, check_finite: bool) -> bool:
    """One contiguous fp32/fp64 CPU [m, r] matrix or [B, m, r] batch (m, r >= 1), orthonormalised in place
    by the kernel (a large batch of two or more columns: its matrices split over torch's intra-op threads);
    False, with nothing written, on a NaN/Inf element when ``check_finite``."""
    shape = t.shape
    m, r = shape[-2], shape[-1]
    b = shape[0] if len(shape) == 3 else 1
    flat, exact = arr(t).reshape(-1), _EXACT[t.dtype]
    if r == 1 or b < 2 or t.numel() * r < PARALLEL_MIN_WORK or (n := min(torch.get_num_threads(), b)) < 2:
        return ortho_batch(flat, b, m, r, rtol * rtol, iters, check_finite, exact)
    offs = np.arange(0, b * m * r, m * r, dtype=np.int64)
    rows = np.full(b, m, dtype=np.int64)
    if check_finite and not _all_finite(flat, offs, rows, r):  # every element, before any thread writes
        return False
    parts = np.array_split(np.arange(b), n)
    done = [_workers(n).submit(ortho_span, flat, offs[p], rows[p], r, rtol * rtol, iters, False, exact)
            for p in parts]  # fmt: skip
    for f in done:
        f.result()
    return True


def orthogonalize(mats: list[torch.Tensor], rtol: float, iters: int) -> None:
    r = mats[0].shape[1]
    work = mats
    if mats[0].dtype not in (torch.float32, torch.float64):  # 16-bit: through fp32 copies
        work = [m.float() for m in mats]
    for ms in element_groups(work):
        base, offs = span(ms)
        rows = np.array([m.shape[0] for m in ms], dtype=np.int64)
        ortho_span(base, offs, rows, r, rtol * rtol, iters, False, _EXACT[work[0].dtype])
    if work is not mats:
        for m, w in zip(mats, work):
            m.copy_(w)
