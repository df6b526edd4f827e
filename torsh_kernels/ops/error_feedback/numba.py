"""Numba CUDA kernels of the error-feedback op family (see ``providers.py``).

Imported on first use of the numba provider. Kernels are specialised per dtype combination (the
load/store helpers they close over) and compute in fp32, with every Python scalar argument cast
to fp32 inside the kernel so the rounding matches the Triton kernels and the torch reference. ``cuda``
is a module global: the simulator swaps it while a kernel runs.
"""

from __future__ import annotations

from functools import cache

from numba import cuda, float32

from .. import numba_common as nb
from ..common import new_counter
from ..numba_common import TILE, block_count, nonfinite, tile_range


@cache
def _axpby_kernel(xd, yd, od, count_bad):
    ldx, ldy, st = nb.loader(xd, "f32"), nb.loader(yd, "f32"), nb.storer(od)

    @cuda.jit
    def kernel(x, y, out, bad, n, beta):
        b = float32(beta)
        i, end = tile_range(n)
        nbad = 0
        while i < end:
            v = ldx(x, i) + b * ldy(y, i)
            if count_bad and nonfinite(v):
                nbad += 1
            st(out, i, v)
            i += cuda.blockDim.x
        if nbad:
            cuda.atomic.add(bad, 0, nbad)

    return kernel


def axpby(x, y, out, beta, count_bad):
    bad = new_counter(x.device)
    k = _axpby_kernel(x.dtype, y.dtype, out.dtype, bool(count_bad))
    n = x.numel()
    nb.launch(k, block_count(n, TILE), nb.THREADS, x.device, nb.as_array(x), nb.as_array(y), nb.as_array(out),
              nb.as_array(bad), n, beta)  # fmt: skip
    return bad if count_bad else None


@cache
def _error_update_kernel(ad, pd, rd, od, has_out):
    lda, ldp, st_r = nb.loader(ad, "f32"), nb.loader(pd, "f32"), nb.storer(rd)
    st_o = nb.storer(od)

    @cuda.jit
    def kernel(acc, approx, res, out, n):
        i, end = tile_range(n)
        while i < end:
            a = ldp(approx, i)
            v = lda(acc, i) - a
            st_r(res, i, v)
            if has_out:
                st_o(out, i, a)
            i += cuda.blockDim.x

    return kernel


def error_update(acc, approx, res, out):
    o = out if out is not None else res
    k = _error_update_kernel(acc.dtype, approx.dtype, res.dtype, o.dtype, out is not None)
    n = acc.numel()
    nb.launch(k, block_count(n, TILE), nb.THREADS, acc.device, nb.as_array(acc), nb.as_array(approx), nb.as_array(res),
              nb.as_array(o), n)  # fmt: skip
