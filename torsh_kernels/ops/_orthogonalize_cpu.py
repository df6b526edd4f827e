"""CPU kernel (Numba's CPU target) of the orthogonalisation op (see orthogonalize.py).

Imported on the cpu provider's first launch. CholeskyQR2 as the GPU kernels run it: per iteration the
fp64 Gram matrix G = A^T A, the upper-triangular T with T^T G T = I on the independent columns
(Gram-Schmidt in the G inner product, twice, r x r work), then A = A T; the two products are BLAS calls
(Numba's ``np.dot``, through SciPy's BLAS) on an fp64 copy of the matrix. A column whose part
orthogonal to the earlier ones is below ``rtol`` of its norm gets a zero column of T, so it becomes
zero. fp32 and fp64 matrices are worked on in place; 16-bit ones through an fp32 copy. Many matrices go
in one call, through one span of memory and their offsets.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ._cpu import arr, carray, jit, p_f32, span


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


@jit
def ortho_matrix(a, rtol2, iters, check_finite):
    """Orthonormalise the columns of ``a`` [m, r] in place; False (nothing written) when ``check_finite``
    and an element is NaN/Inf (its column's squared norm in fp64 is then not finite). The two products
    per iteration are BLAS calls on an fp64 copy (G = B^T B, B = B T); the matrix is rounded to its
    dtype after each iteration, as the GPU kernels store it."""
    m, r = a.shape
    af = a.reshape(-1)
    b = np.empty((m, r))
    bf = b.reshape(-1)
    for k in range(m * r):
        bf[k] = af[k]
    tm = np.empty((r, r))
    for it in range(iters):
        g = np.dot(b.T, b)
        if it == 0 and check_finite:
            for p in range(r):
                if not np.isfinite(g[p, p]):
                    return False
        _gram_factor(g, tm, r, rtol2)
        b = np.dot(b, tm)
        bf = b.reshape(-1)
        for k in range(m * r):
            af[k] = bf[k]
            if it + 1 < iters:
                bf[k] = af[k]
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
    isz = work[0].element_size()
    groups = [work] if len({m.data_ptr() % isz for m in work}) == 1 else [[m] for m in work]
    for ms in groups:
        base, offs = span(ms)
        rows = np.array([m.shape[0] for m in ms], dtype=np.int64)
        ortho_span(base, offs, rows, r, rtol * rtol, iters)
    if work is not mats:
        for m, w in zip(mats, work):
            m.copy_(w)
