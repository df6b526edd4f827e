"""Numba CUDA kernels of the orthogonalisation op (see ``providers.py``).

Imported on first use of the numba provider. Kernels are specialised per dtype (the load/store helpers
they close over) and accumulate the Gram matrix in fp64, as the Triton kernel does. ``cuda`` is a module
global: the simulator swaps it while a kernel runs.
"""

from __future__ import annotations

import math
from functools import cache

from numba import cuda, float64

from .. import numba_common as nb
from ..common import numba_span, ptr_table
from .providers import element_groups

# One CUDA block per matrix, CholeskyQR with an fp64 Gram matrix in shared memory.


@cache
def _ortho_kernel(md, rp):
    ld, st = nb.loader(md, "f64"), nb.storer(md)
    T = nb.THREADS
    RR = rp * rp

    @cuda.jit(device=True)
    def gram_factor(g, tm, r, rtol2):
        """tm (zeroed; r x r, row stride rp) = upper-triangular T with T^T G T = I on the independent
        columns: Gram-Schmidt in the G inner product, twice, as in the Triton kernel."""
        t = cuda.local.array(rp, float64)
        gt = cuda.local.array(rp, float64)
        c = cuda.local.array(rp, float64)
        for j in range(r):
            for a in range(r):
                t[a] = 1.0 if a == j else 0.0
            for _ in range(2):
                for a in range(r):
                    acc = 0.0
                    for b in range(r):
                        acc += g[a * rp + b] * t[b]
                    gt[a] = acc
                for i in range(j):
                    acc = 0.0
                    for a in range(r):
                        acc += tm[a * rp + i] * gt[a]
                    c[i] = acc
                for a in range(r):
                    acc = t[a]
                    for i in range(j):
                        acc -= tm[a * rp + i] * c[i]
                    t[a] = acc
            nrm2 = 0.0
            for a in range(r):
                acc = 0.0
                for b in range(r):
                    acc += g[a * rp + b] * t[b]
                nrm2 += t[a] * acc
            gjj = g[j * rp + j]
            inv = 0.0
            if gjj > 0 and nrm2 > rtol2 * gjj:
                inv = 1.0 / math.sqrt(nrm2)
            for a in range(r):
                tm[a * rp + j] = t[a] * inv

    @cuda.jit
    def kernel(table, base, r, rtol2, iters):
        g = cuda.shared.array(RR, float64)
        tm = cuda.shared.array(RR, float64)
        tid = cuda.threadIdx.x
        mat = cuda.blockIdx.x
        off = table[2 * mat]
        rows = table[2 * mat + 1]
        row = cuda.local.array(rp, float64)
        part = cuda.local.array(RR, float64)
        for _ in range(iters):
            for e in range(tid, RR, T):
                g[e] = 0.0
                tm[e] = 0.0
            for e in range(RR):
                part[e] = 0.0
            cuda.syncthreads()
            i = tid
            while i < rows:
                for p in range(r):
                    row[p] = ld(base, off + i * r + p)
                for p in range(r):
                    for q in range(r):
                        part[p * rp + q] += row[p] * row[q]
                i += T
            for p in range(r):
                for q in range(r):
                    cuda.atomic.add(g, p * rp + q, part[p * rp + q])
            cuda.syncthreads()
            if tid == 0:
                gram_factor(g, tm, r, rtol2)
            cuda.syncthreads()
            i = tid
            while i < rows:
                for p in range(r):
                    row[p] = ld(base, off + i * r + p)
                for q in range(r):
                    acc = 0.0
                    for p in range(q + 1):  # T is upper triangular
                        acc += row[p] * tm[p * rp + q]
                    st(base, off + i * r + q, acc)
                i += T
            cuda.syncthreads()

    return kernel


def orthogonalize(mats, rtol, iters):
    r = mats[0].shape[1]
    rp = 1
    while rp < r:
        rp *= 2
    k = _ortho_kernel(mats[0].dtype, rp)
    for ms in element_groups(mats):  # (not a whole number of elements apart: one launch each)
        base, span, offs = numba_span(ms)
        table = ptr_table([v for o, m in zip(offs, ms) for v in (o, m.shape[0])], ms[0].device, "numba-ortho")
        nb.launch(k, len(ms), nb.THREADS, ms[0].device, nb.as_array(table),
                  nb.span_array(base, span, ms[0].dtype), r, rtol * rtol, iters)  # fmt: skip
