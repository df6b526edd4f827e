"""Numba CUDA kernels of the sign op family (see ``api.py``).

Imported on first use of the numba provider. Kernels are specialised per dtype combination (the
load/store helpers they close over) and compute in fp32, with every Python scalar argument cast
to fp32 inside the kernel so the rounding matches the Triton kernels and the torch reference. ``cuda``
is a module global: the simulator swaps it while a kernel runs.
"""

from __future__ import annotations

from functools import cache

import torch
from numba import cuda, float32, int64

from .. import numba_common as nb
from ..common import new_counter
from ..numba_common import TILE, block_count, nonfinite, tile_range


@cache
def _abs_sum_kernel(xd, rd, has_r):
    ldx, ldr = nb.loader(xd, "f32"), nb.loader(rd, "f32")
    T = nb.THREADS

    @cuda.jit
    def kernel(x, r, part, bad, n):
        sh = cuda.shared.array(T, float32)
        tid = cuda.threadIdx.x
        i, end = tile_range(n)
        acc = float32(0.0)
        nbad = 0
        while i < end:
            v = ldx(x, i)
            if has_r:
                v = v + ldr(r, i)
            if nonfinite(v):
                nbad += 1
            acc += abs(v)
            i += T
        sh[tid] = acc
        cuda.syncthreads()
        if tid == 0:
            tot = sh[0]
            for t in range(1, T):
                tot += sh[t]
            part[cuda.blockIdx.x] = tot
        if nbad:
            cuda.atomic.add(bad, 0, nbad)

    return kernel


def abs_sum(x, r):
    n = x.numel()
    blocks = block_count(n, TILE)
    part = torch.empty(blocks, dtype=torch.float32, device=x.device)
    bad = new_counter(x.device)
    rr = r if r is not None else x
    k = _abs_sum_kernel(x.dtype, rr.dtype, r is not None)
    nb.launch(k, blocks, nb.THREADS, x.device, nb.as_array(x), nb.as_array(rr), nb.as_array(part), nb.as_array(bad), n)
    return part.sum(dtype=torch.float64), bad


@cache
def _sign_pack_kernel(xd, rd, has_r):
    ldx, ldr, st_r = nb.loader(xd, "f32"), nb.loader(rd, "f32"), nb.storer(rd)

    @cuda.jit
    def kernel(x, r, bits, scale, n, nbytes):
        s = scale[0]
        by = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        while by < nbytes:
            word = 0
            for j in range(8):
                i = by * 8 + j
                if i < n:
                    v = ldx(x, i)
                    if has_r:
                        v = v + ldr(r, i)
                    if v >= 0:
                        word |= 1 << j
                        if has_r:
                            st_r(r, i, v - s)
                    elif has_r:
                        st_r(r, i, v + s)
            bits[by] = word
            by += cuda.gridDim.x * cuda.blockDim.x

    return kernel


def sign_pack(x, r, bits, scale):
    rr = r if r is not None else x
    k = _sign_pack_kernel(x.dtype, rr.dtype, r is not None)
    nbytes = bits.numel()
    nb.launch(k, block_count(nbytes, TILE // 8), nb.THREADS, x.device, nb.as_array(x), nb.as_array(rr),
              nb.as_array(bits), nb.as_array(scale.view(1)), x.numel(), nbytes)  # fmt: skip


@cache
def _sign_unpack_kernel(od, accumulate):
    ldo, st = nb.loader(od, "f32"), nb.storer(od)

    @cuda.jit
    def kernel(bits, scale, out, n, nbytes, alpha):
        s = scale[0] * float32(alpha)
        by = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        while by < nbytes:
            word = int64(bits[by])
            for j in range(8):
                i = by * 8 + j
                if i < n:
                    v = s if (word >> j) & 1 else -s
                    if accumulate:
                        v = ldo(out, i) + v
                    st(out, i, v)
            by += cuda.gridDim.x * cuda.blockDim.x

    return kernel


def sign_unpack(bits, scale, out, alpha, accumulate):
    k = _sign_unpack_kernel(out.dtype, bool(accumulate))
    nbytes = bits.numel()
    nb.launch(k, block_count(nbytes, TILE // 8), nb.THREADS, out.device, nb.as_array(bits),
              nb.as_array(scale.view(1)), nb.as_array(out), out.numel(), nbytes, alpha)  # fmt: skip
