"""Numba CUDA kernels of the MoE op family (see the package docstring, ``moe/__init__.py``).

Imported on first use of the numba provider. Kernels are built per dtype (they close over the load and
store helpers of ``_numba``); ``cuda`` must be a module global (the simulator swaps it while a kernel runs).

- route top-k: one thread per token; the scores are recomputed per selection round instead of held in
  a per-thread array (E is not a compile-time constant); with a score bias or groups (``moe_route``'s selection
  options) a second kernel: group scores and kept groups in [T, G] scratch arrays, the rounds on the keys;
- route assign: one thread per expert (per sequence and expert with a capacity per sequence), walking the
  assignments in token order (capacity threshold by a bisection over the score bits, as the Triton kernel
  does);
- route rows: one thread per assignment (its sequence found by a bisection over the sequences' offsets);
- permute of a padded routing: one block per row, zeros for a padding row;
- permute / unpermute: one block per token, the threads striding over H;
- unpermute backward's weight gradients: one thread per assignment, a sequential fp32 dot product.
"""

from __future__ import annotations

import math
from functools import cache

import torch
from numba import cuda, float32, int64

from .. import numba_common as nb


def _blocks(n: int, threads: int) -> int:
    return max(1, -(-n // threads))


@cache
def _topk_kernel(dtype: torch.dtype, softmax: bool, renorm: bool, has_bias: bool, grouped: bool):
    """The routing top-K, one thread per token, with the selection options of ``moe_route``: keys ``score + bias`` (NaN
    scores: -inf, so they rank last; the plain route has no bias), the TG best of G groups (kept groups in
    ``gkeep`` [T, G], group scores in ``gsc`` [T, G], both scratch), K rounds of a strict maximum of the keys
    over the kept groups' experts (equal keys keep the lower expert); weights from the unbiased scores."""
    load = nb.loader(dtype, "f32")
    ninf = float32(-math.inf)

    @cuda.jit(device=True, inline=True)
    def prob(logits, base, e, mx, tot):
        v = load(logits, base + e)
        if softmax:
            return float32(math.exp(v - mx) / tot)
        return float32(float32(1.0) / (float32(1.0) + math.exp(-v)))

    @cuda.jit(device=True, inline=True)
    def key_of(logits, bias, base, e, mx, tot):
        p = prob(logits, base, e, mx, tot)
        if p != p:
            return ninf
        if has_bias:
            return float32(p + bias[e])
        return p

    @cuda.jit
    def kernel(logits, bias, gsc, gkeep, idx, w, s, bad, T, E, K, G, TG, scale):
        t = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        if t >= T:
            return
        base = t * E
        mx = float32(-math.inf)
        tot = float32(0.0)
        if softmax:
            for e in range(E):
                v = load(logits, base + e)
                if v > mx:
                    mx = v
            for e in range(E):
                tot += math.exp(load(logits, base + e) - mx)
        nan_row = False
        for e in range(E):
            p = prob(logits, base, e, mx, tot)
            if p != p:
                nan_row = True
        if nan_row:
            cuda.atomic.add(bad, 0, 1)
        size = E // G if grouped else E
        if grouped:
            for g in range(G):
                m1 = ninf
                m2 = ninf
                for i in range(size):
                    v = key_of(logits, bias, base, g * size + i, mx, tot)
                    if v > m1:
                        m2 = m1
                        m1 = v
                    elif v > m2:
                        m2 = v
                gsc[t * G + g] = float32(m1 + m2) if size > 1 else m1
            for g in range(G):  # kept: fewer than TG groups rank above it (a higher sum, or equal and lower)
                above = 0
                for h in range(G):
                    if gsc[t * G + h] > gsc[t * G + g] or (gsc[t * G + h] == gsc[t * G + g] and h < g):
                        above += 1
                gkeep[t * G + g] = 1 if above < TG else 0
        total = float32(0.0)
        for j in range(K):
            best = ninf
            pick = int64(-1)
            for e in range(E):
                if grouped and gkeep[t * G + e // size] == 0:
                    continue
                taken = False
                for i in range(j):
                    if idx[t * K + i] == e:
                        taken = True
                if taken:
                    continue
                v = key_of(logits, bias, base, e, mx, tot)
                if pick < 0 or v > best:  # strict: equal keys keep the lower expert
                    best = v
                    pick = e
            idx[t * K + j] = pick
            pj = prob(logits, base, pick, mx, tot)
            s[t * K + j] = pj
            total += pj
        for j in range(K):
            if renorm and total != 0:
                w[t * K + j] = s[t * K + j] / total * scale
            else:
                w[t * K + j] = s[t * K + j] * scale

    return kernel


def route_topk(logits: torch.Tensor, k: int, softmax: bool, renorm: bool, bias: torch.Tensor | None = None,
               G: int = 0, TG: int = 0, scaling: float = 1.0):  # fmt: skip
    T, E = logits.shape
    dev = logits.device
    idx = torch.empty(T * k, dtype=torch.int64, device=dev)
    w = torch.empty(T * k, dtype=torch.float32, device=dev)
    s = torch.empty(T * k, dtype=torch.float32, device=dev)
    bad = torch.zeros(1, dtype=torch.int32, device=dev)
    common = (nb.as_array(idx), nb.as_array(w), nb.as_array(s), nb.as_array(bad), T, E, k)
    kernel = _topk_kernel(logits.dtype, softmax, renorm, bias is not None, G > 0)
    gsc = torch.empty(max(T * G, 1), dtype=torch.float32, device=dev)  # scratch: group scores, kept groups
    gkeep = torch.empty(max(T * G, 1), dtype=torch.int32, device=dev)
    b = bias.contiguous() if bias is not None else w  # (not read without a bias)
    nb.launch(
        kernel, _blocks(T, nb.THREADS), nb.THREADS, dev,
        nb.as_array(logits.reshape(-1)), nb.as_array(b), nb.as_array(gsc), nb.as_array(gkeep), *common, G, TG,
        float32(scaling),
    )  # fmt: skip
    return idx.view(T, k), w.view(T, k), s.view(T, k), bad


@cuda.jit(device=True, inline=True)
def _bits(v):
    """fp32 -> its bits as a signed 32-bit integer (order-preserving for non-negative floats)."""
    b = int64(nb.f32_bits(v))
    if b >= 2**31:
        b -= 2**32
    return b


@cuda.jit(device=True, inline=True)
def _count_ge(idx, s, lo, hi, e, b):
    c = int64(0)
    for i in range(lo, hi):
        if idx[i] == e and _bits(s[i]) >= b:
            c += 1
    return c


@cuda.jit
def _assign_kernel(idx, s, pos, counts, n, E, cap, policy, seg, caps, nseq):
    """One thread per expert (nseq > 0: per (sequence, expert), thread q * E + e, the assignments
    [seg[q], seg[q + 1]) with capacity caps[q]); counts[thread] = kept assignments."""
    g = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if nseq == 0:
        if g >= E:
            return
        e = g
        lo = int64(0)
        hi = int64(n)
        c = int64(cap)
    else:
        if g >= nseq * E:
            return
        q = g // E
        e = g - q * E
        lo = seg[q]
        hi = seg[q + 1]
        c = caps[q]
    thr = int64(-(2**31) - 1)
    quota = int64(2**62)
    if policy == 2:
        total = _count_ge(idx, s, lo, hi, e, -(2**31))
        if total > c:
            blo = int64(-(2**31))
            bhi = int64(2**31)
            while bhi - blo > 1:
                mid = blo + (bhi - blo) // 2
                if _count_ge(idx, s, lo, hi, e, mid) >= c:
                    blo = mid
                else:
                    bhi = mid
            thr = blo
            quota = c - _count_ge(idx, s, lo, hi, e, blo + 1)
    kept = int64(0)
    seen = int64(0)
    for i in range(lo, hi):
        if idx[i] != e:
            continue
        keep = True
        if policy == 2:
            b = _bits(s[i])
            if b == thr:
                keep = seen < quota
                seen += 1
            else:
                keep = b > thr
        elif policy == 1:
            keep = seen < c
            seen += 1
        if keep:
            pos[i] = kept
            kept += 1
        else:
            pos[i] = -1
    counts[g] = kept


def route_assign(idx: torch.Tensor, s: torch.Tensor, E: int, cap: int, policy: int, seg: torch.Tensor | None = None,
                 caps: torch.Tensor | None = None):  # fmt: skip
    """Positions inside each expert's group (``seg`` [S + 1] assignment offsets and ``caps`` [S]: inside each
    (sequence, expert) group) and the kept counts ([E], or [S * E] sequence-major)."""
    n = idx.numel()
    nseq = 0 if seg is None else seg.numel() - 1
    pos = torch.empty(n, dtype=torch.int64, device=idx.device)
    counts = torch.empty(E if nseq == 0 else nseq * E, dtype=torch.int64, device=idx.device)
    seg_a = nb.as_array(counts if seg is None else seg)  # (a placeholder in the call scope: not read)
    caps_a = nb.as_array(counts if caps is None else caps)
    nb.launch(
        _assign_kernel, _blocks(counts.numel(), nb.THREADS), nb.THREADS, idx.device,
        nb.as_array(idx.reshape(-1)), nb.as_array(s.reshape(-1)), nb.as_array(pos), nb.as_array(counts), n, E, cap,
        policy, seg_a, caps_a, nseq,
    )  # fmt: skip
    return pos, counts


@cuda.jit
def _rows_kernel(idx, pos, starts, tok, n, K, seg, nseq, E):
    """row = start of the assignment's group + position: starts[expert], or (nseq > 0) starts[s * E + expert]
    with s the sequence holding the assignment (the last s with seg[s] <= i, by bisection)."""
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if i < n and pos[i] >= 0:
        g = idx[i]
        if nseq > 0:
            lo = 0
            hi = nseq
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if seg[mid] <= i:
                    lo = mid
                else:
                    hi = mid
            g += lo * E
        r = starts[g] + pos[i]
        pos[i] = r
        tok[r] = i // K


def route_rows(idx: torch.Tensor, pos: torch.Tensor, starts: torch.Tensor, tok: torch.Tensor, k: int,
               seg: torch.Tensor | None = None, E: int = 0) -> None:  # fmt: skip
    n = idx.numel()
    nseq = 0 if seg is None else seg.numel() - 1
    nb.launch(
        _rows_kernel, _blocks(n, nb.THREADS), nb.THREADS, idx.device,
        nb.as_array(idx.reshape(-1)), nb.as_array(pos), nb.as_array(starts.contiguous()), nb.as_array(tok), n, k,
        nb.as_array(starts if seg is None else seg), nseq, E,
    )  # fmt: skip


@cache
def _permute_padded_kernel(dtype: torch.dtype):
    load, store = nb.loader(dtype, "f32"), nb.storer(dtype)

    @cuda.jit
    def kernel(x, tok, out, H, T):
        i = cuda.blockIdx.x
        t = tok[i]
        ok = t >= 0 and t < T  # -1: a padding row (zeros); outside [0, T): not read either
        h = cuda.threadIdx.x
        while h < H:
            store(out, i * H + h, load(x, t * H + h) if ok else float32(0.0))
            h += cuda.blockDim.x

    return kernel


def permute_padded(x: torch.Tensor, tok: torch.Tensor, out: torch.Tensor) -> None:
    """out[i] = x[tok[i]], zero rows where tok[i] is -1 (one block per row)."""
    nb.launch(
        _permute_padded_kernel(x.dtype), out.shape[0], nb.THREADS, x.device,
        nb.as_array(x.reshape(-1)), nb.as_array(tok), nb.as_array(out.reshape(-1)), x.shape[1], x.shape[0],
    )  # fmt: skip


@cache
def _scatter_kernel(src: torch.dtype, dst: torch.dtype, has_w: bool):
    load, store = nb.loader(src, "f32"), nb.storer(dst)

    @cuda.jit
    def kernel(x, rows, w, out, H, K):
        t = cuda.blockIdx.x
        for j in range(K):
            r = rows[t * K + j]
            if r < 0 or (r + 1) * H > out.shape[0]:  # dropped (-1), or outside out: nothing written
                continue
            wt = w[t * K + j] if has_w else float32(1.0)
            h = cuda.threadIdx.x
            while h < H:
                v = load(x, t * H + h)
                store(out, r * H + h, v * wt if has_w else v)
                h += cuda.blockDim.x

    return kernel


def scatter_rows(x: torch.Tensor, rows: torch.Tensor, w: torch.Tensor | None, out: torch.Tensor) -> None:
    """out[rows[t, j]] = x[t] (* w[t, j])."""
    T, K = rows.shape
    kernel = _scatter_kernel(x.dtype, out.dtype, w is not None)
    nb.launch(
        kernel, T, nb.THREADS, x.device,
        nb.as_array(x.reshape(-1)), nb.as_array(rows.reshape(-1)), nb.as_array((w if w is not None else rows.float())
                                                                               .reshape(-1)),
        nb.as_array(out.reshape(-1)), x.shape[1], K,
    )  # fmt: skip


@cache
def _gather_kernel(dtype: torch.dtype, has_w: bool):
    load, store = nb.loader(dtype, "f32"), nb.storer(dtype)

    @cuda.jit
    def kernel(y, rows, w, out, H, K):
        t = cuda.blockIdx.x
        h = cuda.threadIdx.x
        while h < H:
            acc = float32(0.0)
            for j in range(K):
                r = rows[t * K + j]
                if r >= 0 and (r + 1) * H <= y.shape[0]:  # (a row outside y is not read)
                    v = load(y, r * H + h)
                    if has_w:
                        v = v * w[t * K + j]
                    acc += v
            store(out, t * H + h, acc)
            h += cuda.blockDim.x

    return kernel


def gather_rows(y: torch.Tensor, rows: torch.Tensor, w: torch.Tensor | None, out: torch.Tensor) -> None:
    """out[t] = sum_j w[t, j] * y[rows[t, j]] in fp32."""
    T, K = rows.shape
    kernel = _gather_kernel(y.dtype, w is not None)
    nb.launch(
        kernel, T, nb.THREADS, y.device,
        nb.as_array(y.reshape(-1)), nb.as_array(rows.reshape(-1)),
        nb.as_array((w if w is not None else rows.float()).reshape(-1)), nb.as_array(out.reshape(-1)), out.shape[1], K,
    )  # fmt: skip


@cache
def _dots_kernel(dtype: torch.dtype):
    load = nb.loader(dtype, "f32")

    @cuda.jit
    def kernel(gy, y, rows, gw, n, H, K):
        i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        if i >= n:
            return
        r = rows[i]
        acc = float32(0.0)
        if r >= 0 and (r + 1) * H <= y.shape[0]:
            t = i // K
            for h in range(H):
                acc += load(gy, t * H + h) * load(y, r * H + h)
        gw[i] = acc

    return kernel


def row_dots(gy: torch.Tensor, y: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """gw[t, j] = <gy[t], y[rows[t, j]]> in fp32 (0 for dropped assignments)."""
    n = rows.numel()
    gw = torch.empty(rows.shape, dtype=torch.float32, device=gy.device)
    nb.launch(
        _dots_kernel(gy.dtype), _blocks(n, nb.THREADS), nb.THREADS, gy.device,
        nb.as_array(gy.reshape(-1)), nb.as_array(y.reshape(-1)), nb.as_array(rows.reshape(-1)),
        nb.as_array(gw.view(-1)), n, gy.shape[1], rows.shape[1],
    )  # fmt: skip
    return gw
