"""CPU kernel (Numba's CPU target) of the orthogonalisation op (see ``providers.py``).

Imported on the cpu provider's first launch. CholeskyQR2 as the GPU kernels run it: per iteration the
fp64 Gram matrix G = A^T A, the upper-triangular T with T^T G T = I on the independent columns
(Gram-Schmidt in the G inner product, twice, r x r work), then A = A T. A column whose part orthogonal
to the earlier ones is below ``rtol`` of its norm gets a zero column of T, so it becomes zero. fp32 and
fp64 matrices are worked on in place; 16-bit ones through an fp32 copy. Many matrices go in one call,
through one span of memory and their offsets.

The two products are loops of this module, not BLAS (Numba's ``np.dot`` calls BLAS through SciPy, which
would make SciPy a dependency of the package): the matrix goes through in chunks of ``_C`` rows, each
converted to fp64 and transposed into an [r, _C] buffer, so that every inner loop runs over _C
contiguous doubles whatever r is, and vectorises. Those two loops are compiled with the reassociation
and contraction of floating-point operations allowed (``_fjit``: fp64 sums in the order LLVM's vector
code takes, with fused multiply-adds, as a BLAS sums them; no assumption that values are finite, so
NaN and Inf propagate and the finite check holds). Everything stays fp64 until a row is stored.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from numba import njit

from ..cpu_common import arr, carray, jit, p_f32, span
from .providers import element_groups


@jit
def _gram_factor(g, tm, r, rtol2):
    """tm (r x r) = upper-triangular T with T^T G T = I on the independent columns."""
    t = np.empty(r)
    gt = np.empty(r)
    c = np.empty(r)
    tm[:, :] = 0.0
    for j in range(r):
        for a in range(r):
            t[a] = 1.0 if a == j else 0.0
        for _ in range(2):
            for a in range(r):
                acc = 0.0
                for b in range(r):
                    acc += g[a, b] * t[b]
                gt[a] = acc
            for i in range(j):
                acc = 0.0
                for a in range(r):
                    acc += tm[a, i] * gt[a]
                c[i] = acc
            for a in range(r):
                acc = t[a]
                for i in range(j):
                    acc -= tm[a, i] * c[i]
                t[a] = acc
        nrm2 = 0.0
        for a in range(r):
            acc = 0.0
            for b in range(r):
                acc += g[a, b] * t[b]
            nrm2 += t[a] * acc
        gjj = g[j, j]
        inv = 0.0
        if gjj > 0 and nrm2 > rtol2 * gjj:
            inv = 1.0 / math.sqrt(nrm2)
        for a in range(r):
            tm[a, j] = t[a] * inv


_C = 64  # rows per chunk: an [r, _C] fp64 buffer per operand, 16 KiB each at r = 32

_fjit = njit(cache=True, nogil=True, fastmath={"reassoc", "contract"})
"""The cpu provider's :func:`jit`, with fp sums reassociated and multiply-adds fused (the products)."""


@jit
def _load(af, n, r, xb):
    """xb[p, k] = af[k * r + p] in fp64 for the chunk's n rows; zero for k >= n."""
    for p in range(r):
        xp = xb[p]
        for k in range(n):
            xp[k] = af[k * r + p]
        for k in range(_C - n):
            xp[n + k] = 0.0


@_fjit
def _gram_add(g, xb, r):
    """g[p, q] += the chunk's sum of x_p x_q, for q >= p (the rows past the chunk's end are zero)."""
    for p in range(r):
        xp = xb[p]
        for q in range(p, r):
            xq = xb[q]
            s = 0.0
            for k in range(_C):
                s += xp[k] * xq[k]
            g[p, q] += s


@jit
def _mirror(g, r):
    for p in range(r):
        for q in range(p):
            g[p, q] = g[q, p]


@_fjit
def _mul_store(xb, tm, yb, af, n, r):
    """The chunk's rows of A T (T upper-triangular: column j sums rows p <= j), stored to af, rounded to
    its dtype."""
    for j in range(r):
        yj = yb[j]
        for k in range(_C):
            yj[k] = 0.0
        p = 0
        while p + 4 <= j + 1:
            t0 = tm[p, j]
            t1 = tm[p + 1, j]
            t2 = tm[p + 2, j]
            t3 = tm[p + 3, j]
            x0 = xb[p]
            x1 = xb[p + 1]
            x2 = xb[p + 2]
            x3 = xb[p + 3]
            for k in range(_C):
                yj[k] += (x0[k] * t0 + x1[k] * t1) + (x2[k] * t2 + x3[k] * t3)
            p += 4
        while p <= j:
            t = tm[p, j]
            xp = xb[p]
            for k in range(_C):
                yj[k] += xp[k] * t
            p += 1
        for k in range(n):
            af[k * r + j] = yj[k]


@jit
def ortho_matrix(a, rtol2, iters, check_finite):
    """Orthonormalise the columns of ``a`` [m, r] in place; False (nothing written) when ``check_finite``
    and an element is NaN/Inf (its column's squared norm in fp64 is then not finite). Each iteration
    reads the matrix as stored: it is rounded to its dtype after each iteration, as the GPU kernels
    store it; the next iteration's G is summed in the same pass as the rows are stored."""
    m, r = a.shape
    af = a.reshape(-1)
    xb = np.zeros((r, _C))
    yb = np.empty((r, _C))
    g = np.zeros((r, r))
    tm = np.empty((r, r))
    for k0 in range(0, m, _C):
        n = min(_C, m - k0)
        _load(af[k0 * r : (k0 + n) * r], n, r, xb)
        _gram_add(g, xb, r)
    _mirror(g, r)
    if check_finite:
        for p in range(r):
            if not np.isfinite(g[p, p]):
                return False
    for it in range(iters):
        _gram_factor(g, tm, r, rtol2)
        more = it + 1 < iters
        if more:
            g[:, :] = 0.0
        for k0 in range(0, m, _C):
            n = min(_C, m - k0)
            seg = af[k0 * r : (k0 + n) * r]
            _load(seg, n, r, xb)
            _mul_store(xb, tm, yb, seg, n, r)
            if more:
                _load(seg, n, r, xb)
                _gram_add(g, xb, r)
        if more:
            _mirror(g, r)
    return True


@jit
def ortho_ptr(ap, m, r, rtol2, iters, check_finite):
    """:func:`ortho_matrix` on the address of an fp32 [m, r] matrix."""
    return ortho_matrix(carray(p_f32(ap), (m, r)), rtol2, iters, check_finite)


@jit
def ortho_span(base, offs, rows, r, rtol2, iters):
    for k in range(offs.size):
        o = offs[k]
        ortho_matrix(base[o : o + rows[k] * r].reshape((rows[k], r)), rtol2, iters, False)


def orthogonalize(mats: list[torch.Tensor], rtol: float, iters: int) -> None:
    r = mats[0].shape[1]
    work = mats
    if mats[0].dtype not in (torch.float32, torch.float64):  # 16-bit: through fp32 copies
        work = [m.float() for m in mats]
    elif len(mats) == 1:
        ortho_matrix(arr(mats[0]), rtol * rtol, iters, False)
        return
    for ms in element_groups(work):
        base, offs = span(ms)
        rows = np.array([m.shape[0] for m in ms], dtype=np.int64)
        ortho_span(base, offs, rows, r, rtol * rtol, iters)
    if work is not mats:
        for m, w in zip(mats, work):
            m.copy_(w)
