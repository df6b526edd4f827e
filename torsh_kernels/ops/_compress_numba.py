"""Numba CUDA kernels of the compression op family (see compress.py for what each op computes).

Imported on first use of the numba provider. Kernels are specialised per dtype combination (the
load/store helpers they close over) and compute in fp32 (fp64 for the orthogonalisation's Gram
matrix), with every Python scalar argument cast to fp32 inside the kernel so the rounding matches the
Triton kernels and the torch reference. ``cuda`` is a module global: the simulator swaps it while a
kernel runs.
"""

from __future__ import annotations

import math
from functools import cache

import torch
from numba import cuda, float32, float64, int64

from . import _numba as nb
from .bucket import _numba_span, _ptr_table

TILE = 2048  # elements per CUDA block in the elementwise passes
_M32 = 0xFFFFFFFF
_INV24 = 1.0 / 16777216.0
_MAGIC = 12582912.0


def _blocks(n: int, per_block: int) -> int:
    return max(1, -(-n // per_block))


def _counter(device: torch.device, n: int = 1) -> torch.Tensor:
    return torch.zeros(n, dtype=torch.int64, device=device)


@cuda.jit(device=True, inline=True)
def _nonfinite(v):
    return math.isnan(v) or math.isinf(v)


@cuda.jit(device=True, inline=True)
def _mul32(h, c):
    return ((h * (c & 0xFFFF)) + (((h * (c >> 16)) & 0xFFFF) << 16)) & _M32


@cuda.jit(device=True, inline=True)
def _lowbias32(h):
    h = h ^ (h >> 16)
    h = _mul32(h, 0x7FEB352D)
    h = h ^ (h >> 15)
    h = _mul32(h, 0x846CA68B)
    return h ^ (h >> 16)


@cuda.jit(device=True, inline=True)
def _uniform(i, key):
    h = _lowbias32(_lowbias32(int64(i) & _M32) ^ key)
    return float32(h >> 8) * float32(_INV24)


@cuda.jit(device=True, inline=True)
def _tile_range(n):
    start = cuda.blockIdx.x * TILE
    end = start + TILE
    if end > n:
        end = n
    return start + cuda.threadIdx.x, end


# --------------------------------------------------------------------------------------------------
# Elementwise error-feedback passes


@cache
def _axpby_kernel(xd, yd, od, count_bad):
    ldx, ldy, st = nb.loader(xd, "f32"), nb.loader(yd, "f32"), nb.storer(od)

    @cuda.jit
    def kernel(x, y, out, bad, n, beta):
        b = float32(beta)
        i, end = _tile_range(n)
        nbad = 0
        while i < end:
            v = ldx(x, i) + b * ldy(y, i)
            if count_bad and _nonfinite(v):
                nbad += 1
            st(out, i, v)
            i += cuda.blockDim.x
        if nbad:
            cuda.atomic.add(bad, 0, nbad)

    return kernel


def axpby(x, y, out, beta, count_bad):
    bad = _counter(x.device)
    k = _axpby_kernel(x.dtype, y.dtype, out.dtype, bool(count_bad))
    n = x.numel()
    nb.launch(k, _blocks(n, TILE), nb.THREADS, x.device, nb.as_array(x), nb.as_array(y), nb.as_array(out),
              nb.as_array(bad), n, beta)  # fmt: skip
    return bad if count_bad else None


@cache
def _error_update_kernel(ad, pd, rd, od, has_out):
    lda, ldp, st_r = nb.loader(ad, "f32"), nb.loader(pd, "f32"), nb.storer(rd)
    st_o = nb.storer(od)

    @cuda.jit
    def kernel(acc, approx, res, out, n):
        i, end = _tile_range(n)
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
    nb.launch(k, _blocks(n, TILE), nb.THREADS, acc.device, nb.as_array(acc), nb.as_array(approx), nb.as_array(res),
              nb.as_array(o), n)  # fmt: skip


# --------------------------------------------------------------------------------------------------
# Top-k


@cache
def _candidates_kernel(xd, rd, has_r):
    ldx, ldr = nb.loader(xd, "f32"), nb.loader(rd, "f32")

    @cuda.jit
    def kernel(x, r, cval, cidx, cnt, n, thr, cap):
        t = float32(thr)
        i, end = _tile_range(n)
        nbad = 0
        while i < end:
            v = ldx(x, i)
            if has_r:
                v = v + ldr(r, i)
            if _nonfinite(v):
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
    cnt = _counter(x.device, 2)
    rr = r if r is not None else x
    k = _candidates_kernel(x.dtype, rr.dtype, r is not None)
    n = x.numel()
    nb.launch(k, _blocks(n, TILE), nb.THREADS, x.device, nb.as_array(x), nb.as_array(rr), nb.as_array(cval),
              nb.as_array(cidx), nb.as_array(cnt), n, thr, cap)  # fmt: skip
    return cval, cidx, cnt


@cache
def _scatter_kernel(vd, od, accumulate, atomic):
    ldv, ldo, st = nb.loader(vd, "f32"), nb.loader(od, "f32"), nb.storer(od)

    @cuda.jit
    def kernel(values, indices, out, k, numel, alpha):
        a = float32(alpha)
        i, end = _tile_range(k)
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
    nb.launch(kern, _blocks(k, TILE), nb.THREADS, out.device, nb.as_array(values), nb.as_array(indices),
              nb.as_array(out), k, out.numel(), alpha)  # fmt: skip


# --------------------------------------------------------------------------------------------------
# Quantization: one CUDA block per quantization block (shared-memory absmax), threads stride inside it.


@cuda.jit(device=True, inline=True)
def _code(v, s, i, key, qmax, stochastic):
    if s > 0:
        y = v / s
    else:
        y = float32(0.0)
    if stochastic:
        q = float32(math.floor(y + _uniform(i, key)))
    else:
        q = (y + float32(_MAGIC)) - float32(_MAGIC)
    if math.isnan(q):
        q = float32(0.0)
    if q > qmax:
        q = qmax
    if q < -qmax:
        q = -qmax
    return int64(q)


@cache
def _quantize_kernel(xd, bits, stochastic):
    ldx = nb.loader(xd, "f32")
    T = nb.THREADS

    @cuda.jit
    def kernel(x, q, scales, bad, n, block, key, qmax_in):
        qmax = float32(qmax_in)
        amax_sh = cuda.shared.array(T, float32)
        bad_sh = cuda.shared.array(T, int64)
        tid = cuda.threadIdx.x
        b = cuda.blockIdx.x
        start = b * block
        end = start + block
        if end > n:
            end = n
        m = float32(0.0)
        nbad = 0
        i = start + tid
        while i < end:
            v = ldx(x, i)
            if _nonfinite(v):
                nbad += 1
            elif abs(v) > m:
                m = abs(v)
            i += T
        amax_sh[tid] = m
        bad_sh[tid] = nbad
        cuda.syncthreads()
        if tid == 0:
            mm = amax_sh[0]
            tb = bad_sh[0]
            for t in range(1, T):
                if amax_sh[t] > mm:
                    mm = amax_sh[t]
                tb += bad_sh[t]
            s = mm / qmax
            if tb > 0:
                s = float32(math.nan)
                cuda.atomic.add(bad, 0, tb)
            scales[b] = s
            amax_sh[0] = s
        cuda.syncthreads()
        s = amax_sh[0]
        if bits == 8:
            i = start + tid
            while i < end:
                q[i] = _code(ldx(x, i), s, i, key, qmax, stochastic)
                i += T
        else:
            p = start + 2 * tid  # element pairs -> one byte each
            while p < end:
                lo = _code(ldx(x, p), s, p, key, qmax, stochastic) & 15
                hi = 0
                if p + 1 < end:
                    hi = _code(ldx(x, p + 1), s, p + 1, key, qmax, stochastic) & 15
                q[p // 2] = lo | (hi << 4)
                p += 2 * T

    return kernel


def quantize(x, q, scales, bits, block, stochastic, key):
    bad = _counter(x.device)
    k = _quantize_kernel(x.dtype, bits, bool(stochastic))
    nb.launch(k, scales.numel(), nb.THREADS, x.device, nb.as_array(x), nb.as_array(q), nb.as_array(scales),
              nb.as_array(bad), x.numel(), block, key, 127.0 if bits == 8 else 7.0)  # fmt: skip
    return bad


@cache
def _dequantize_kernel(od, bits, accumulate):
    ldo, st = nb.loader(od, "f32"), nb.storer(od)

    @cuda.jit
    def kernel(q, scales, out, n, block, alpha):
        a = float32(alpha)
        b = cuda.blockIdx.x
        s = scales[b]
        start = b * block
        end = start + block
        if end > n:
            end = n
        i = start + cuda.threadIdx.x
        while i < end:
            if bits == 8:
                c = int64(q[i])
            else:
                byte = int64(q[i // 2])
                c = (byte >> 4) & 15 if i % 2 else byte & 15
                if c >= 8:
                    c -= 16
            v = float32(c) * s * a
            if accumulate:
                v = ldo(out, i) + v
            st(out, i, v)
            i += cuda.blockDim.x

    return kernel


def dequantize(q, scales, out, bits, block, alpha, accumulate):
    k = _dequantize_kernel(out.dtype, bits, bool(accumulate))
    nb.launch(k, scales.numel(), nb.THREADS, out.device, nb.as_array(q), nb.as_array(scales), nb.as_array(out),
              out.numel(), block, alpha)  # fmt: skip


# --------------------------------------------------------------------------------------------------
# Signs


@cache
def _abs_sum_kernel(xd, rd, has_r):
    ldx, ldr = nb.loader(xd, "f32"), nb.loader(rd, "f32")
    T = nb.THREADS

    @cuda.jit
    def kernel(x, r, part, bad, n):
        sh = cuda.shared.array(T, float32)
        tid = cuda.threadIdx.x
        i, end = _tile_range(n)
        acc = float32(0.0)
        nbad = 0
        while i < end:
            v = ldx(x, i)
            if has_r:
                v = v + ldr(r, i)
            if _nonfinite(v):
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
    blocks = _blocks(n, TILE)
    part = torch.empty(blocks, dtype=torch.float32, device=x.device)
    bad = _counter(x.device)
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
    nb.launch(k, _blocks(nbytes, TILE // 8), nb.THREADS, x.device, nb.as_array(x), nb.as_array(rr),
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
    nb.launch(k, _blocks(nbytes, TILE // 8), nb.THREADS, out.device, nb.as_array(bits),
              nb.as_array(scale.view(1)), nb.as_array(out), out.numel(), nbytes, alpha)  # fmt: skip


# --------------------------------------------------------------------------------------------------
# Orthogonalisation: one CUDA block per matrix, CholeskyQR with an fp64 Gram matrix in shared memory.


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
    isz = mats[0].element_size()
    groups = [mats]
    if len({m.data_ptr() % isz for m in mats}) > 1:  # not a whole number of elements apart: one launch each
        groups = [[m] for m in mats]
    for ms in groups:
        base, span, offs = _numba_span(ms)
        table = _ptr_table([v for o, m in zip(offs, ms) for v in (o, m.shape[0])], ms[0].device, "numba-ortho")
        nb.launch(k, len(ms), nb.THREADS, ms[0].device, nb.as_array(table),
                  nb.span_array(base, span, ms[0].dtype), r, rtol * rtol, iters)  # fmt: skip
