"""Numba CUDA kernels of the top-k op family (see ``providers.py``).

Imported on first use of the numba provider. Kernels are specialised per dtype combination (the
load/store helpers they close over) and compute in fp32, with every Python scalar argument cast
to fp32 inside the kernel so the rounding matches the Triton kernels and the torch reference. ``cuda``
is a module global: the simulator swaps it while a kernel runs.
"""

from __future__ import annotations

from functools import cache

import torch
from numba import cuda, float32

from .. import numba_common as nb
from ..common import new_counter
from ..numba_common import TILE, block_count, nonfinite, tile_range


@cache
def _candidates_kernel(xd, rd, has_r):
    ldx, ldr = nb.loader(xd, "f32"), nb.loader(rd, "f32")

    @cuda.jit
    def kernel(x, r, cval, cidx, cnt, n, thr, cap):
        t = float32(thr)
        i, end = tile_range(n)
        nbad = 0
        while i < end:
            v = ldx(x, i)
            if has_r:
                v = v + ldr(r, i)
            if nonfinite(v):
                nbad += 1
            elif abs(v) >= t:
                pos = cuda.atomic.add(cnt, 0, 1)
                if pos < cap:
                    cval[pos] = v
                    cidx[pos] = i
            i += cuda.blockDim.x
        if nbad:
            cuda.atomic.add(cnt, 1, nbad)

    return kernel


def candidates(x, r, thr, cap, idx_dtype):
    cval = torch.empty(cap, dtype=torch.float32, device=x.device)
    cidx = torch.empty(cap, dtype=idx_dtype, device=x.device)
    cnt = new_counter(x.device, 2)
    rr = r if r is not None else x
    k = _candidates_kernel(x.dtype, rr.dtype, r is not None)
    n = x.numel()
    nb.launch(k, block_count(n, TILE), nb.THREADS, x.device, nb.as_array(x), nb.as_array(rr), nb.as_array(cval),
              nb.as_array(cidx), nb.as_array(cnt), n, thr, cap)  # fmt: skip
    return cval, cidx, cnt


@cache
def _scatter_kernel(vd, od, accumulate, atomic):
    ldv, ldo, st = nb.loader(vd, "f32"), nb.loader(od, "f32"), nb.storer(od)

    @cuda.jit
    def kernel(values, indices, out, k, numel, alpha):
        a = float32(alpha)
        i, end = tile_range(k)
        while i < end:
            j = indices[i]
            if j >= 0 and j < numel:
                v = ldv(values, i) * a
                if accumulate:
                    if atomic:
                        cuda.atomic.add(out, j, v)
                    else:
                        st(out, j, ldo(out, j) + v)
                else:
                    st(out, j, v)
            i += cuda.blockDim.x

    return kernel


def scatter(values, indices, out, alpha, accumulate, atomic):
    k = values.numel()
    kern = _scatter_kernel(values.dtype, out.dtype, bool(accumulate), bool(atomic))
    nb.launch(kern, block_count(k, TILE), nb.THREADS, out.device, nb.as_array(values), nb.as_array(indices),
              nb.as_array(out), k, out.numel(), alpha)  # fmt: skip
