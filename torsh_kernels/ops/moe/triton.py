"""Triton kernels of the MoE routing op family (see the package docstring, ``moe/__init__.py``).

Imported by the triton launchers on first use, so ``import torsh_kernels`` does not import Triton. Triton
reads ``TRITON_INTERPRET`` when these kernels are defined, i.e. on that first import.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..triton_common import cast


@triton.jit
def _route_topk_kernel(
    logits_ptr, bias_ptr, idx_ptr, w_ptr, s_ptr, bad_ptr, T, E, stride_t, NG, TG, GS, scale,
    K: tl.constexpr, KP: tl.constexpr, EP: tl.constexpr, GP: tl.constexpr, BLOCK_T: tl.constexpr,
    SCORE: tl.constexpr, RENORM: tl.constexpr, HAS_BIAS: tl.constexpr, GROUPED: tl.constexpr,
):  # fmt: skip
    """Per token: fp32 scores, the top K (ties to the lower expert), weights (times ``scale``); bad +=
    NaN-score rows. With HAS_BIAS / GROUPED (the selection options of ``moe_route``) the top K of ``score + bias``
    (NaN scores: -inf) inside the TG best of the NG groups of GS experts (a group's score: the sum of its
    two highest keys; equal sums: the lower group)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BT]
    cols = tl.arange(0, EP)  # [EP]
    rmask = rows < T
    valid = rmask[:, None] & (cols < E)[None, :]  # [BT, EP]
    x = tl.load(logits_ptr + rows[:, None] * stride_t + cols[None, :], mask=valid, other=float("-inf"))
    x = x.to(tl.float32)
    if SCORE == 0:
        mx = tl.max(x, axis=1)
        mx = tl.where(rmask, mx, 0.0)
        e = tl.where(valid, tl.exp(x - mx[:, None]), 0.0)
        tot = tl.sum(e, axis=1)
        p = e / tl.where(rmask, tot, 1.0)[:, None]
    else:
        p = 1.0 / (1.0 + tl.exp(-x))
    isnan = (p != p) & valid
    tl.atomic_add(bad_ptr, tl.sum((tl.sum(isnan.to(tl.int32), axis=1) > 0).to(tl.int32), axis=0))
    kcols = tl.arange(0, KP)
    S = tl.zeros((BLOCK_T, KP), dtype=tl.float32)
    I = tl.zeros((BLOCK_T, KP), dtype=tl.int64)  # noqa: E741
    if HAS_BIAS or GROUPED:
        # selection keys: score + bias, NaN scores -inf; `avail`: experts still choosable (kept groups)
        key = p
        if HAS_BIAS:
            b = tl.load(bias_ptr + cols, mask=cols < E, other=0.0)
            key = p + b[None, :]
        key = tl.where(isnan, float("-inf"), key)
        avail = valid
        if GROUPED:
            gid = cols // GS  # [EP] each expert's group
            gcols = tl.arange(0, GP)
            gsc = tl.full((BLOCK_T, GP), float("-inf"), tl.float32)  # group scores
            for g in range(NG):
                inm = valid & (gid == g)[None, :]
                m1 = tl.max(tl.where(inm, key, float("-inf")), axis=1)
                i1 = tl.min(tl.where(inm & (key == m1[:, None]), cols[None, :], EP), axis=1)
                m2 = tl.max(tl.where(inm & (cols[None, :] != i1[:, None]), key, float("-inf")), axis=1)
                sc = tl.where(GS > 1, m1 + m2, m1)
                gsc = tl.where(gcols[None, :] == g, sc[:, None], gsc)
            gav = (gcols < NG)[None, :] & rmask[:, None]  # [BT, GP] groups not yet kept
            keep = valid & (cols < 0)[None, :]  # [BT, EP] experts of the kept groups (none yet)
            for _ in range(TG):
                gb = tl.max(tl.where(gav, gsc, float("-inf")), axis=1)
                gp = tl.min(tl.where(gav & (gsc == gb[:, None]), gcols[None, :], GP), axis=1)
                gav = gav & (gcols[None, :] != gp[:, None])
                keep = keep | (gid[None, :] == gp[:, None])
            avail = valid & keep
        for j in tl.static_range(K):
            best = tl.max(tl.where(avail, key, float("-inf")), axis=1)
            pick = tl.min(tl.where(avail & (key == best[:, None]), cols[None, :], EP), axis=1)  # lowest of the max
            hit = cols[None, :] == pick[:, None]
            sj = tl.sum(tl.where(hit, p, 0.0), axis=1)
            S = tl.where(kcols[None, :] == j, sj[:, None], S)
            I = tl.where(kcols[None, :] == j, pick.to(tl.int64)[:, None], I)  # noqa: E741
            avail = avail & (cols[None, :] != pick[:, None])
    else:
        # selection keys: NaN scores rank below every real score (-1), padding below those (-2)
        sel = tl.where(valid, tl.where(isnan, -1.0, p), -2.0)
        for j in tl.static_range(K):
            best = tl.max(sel, axis=1)
            pick = tl.min(tl.where(sel == best[:, None], cols[None, :], EP), axis=1)  # lowest index of the max
            hit = cols[None, :] == pick[:, None]
            sj = tl.sum(tl.where(hit, p, 0.0), axis=1)
            S = tl.where(kcols[None, :] == j, sj[:, None], S)
            I = tl.where(kcols[None, :] == j, pick.to(tl.int64)[:, None], I)  # noqa: E741
            sel = tl.where(hit, -3.0, sel)
    km = rmask[:, None] & (kcols < K)[None, :]
    off = rows[:, None] * K + kcols[None, :]
    tl.store(idx_ptr + off, I, mask=km)
    tl.store(s_ptr + off, S, mask=km)
    if RENORM:
        tot = tl.sum(tl.where(km, S, 0.0), axis=1)
        W = S / tl.where(tot != 0.0, tot, 1.0)[:, None]
    else:
        W = S
    tl.store(w_ptr + off, W * scale, mask=km)


@triton.jit
def _count_ge(idx_ptr, s_ptr, lo, hi, e, b, BLOCK: tl.constexpr):
    """How many assignments of [lo, hi) to expert e have score bits >= b."""
    c = tl.zeros((), dtype=tl.int64)
    for start in range(lo, hi, BLOCK):
        offs = start + tl.arange(0, BLOCK).to(tl.int64)
        m = offs < hi
        hit = (tl.load(idx_ptr + offs, mask=m, other=-1) == e) & m
        bits = tl.load(s_ptr + offs, mask=m, other=0.0).to(tl.int32, bitcast=True).to(tl.int64)
        c += tl.sum((hit & (bits >= b)).to(tl.int64), axis=0)
    return c


@triton.jit
def _route_assign_kernel(idx_ptr, s_ptr, pos_ptr, counts_ptr, seg_ptr, cap_ptr, n, cap, E, BLOCK: tl.constexpr,
                         POLICY: tl.constexpr, SEQ: tl.constexpr):  # fmt: skip
    """One program per expert (SEQ: per (sequence, expert), grid (S, E)): the kept assignments' positions
    inside the group (token order), -1 for dropped ones; counts[e] (SEQ: counts[s * E + e]) = kept
    assignments. The capacity is ``cap`` for the call, or ``cap_ptr[s]`` for the assignments
    [seg_ptr[s], seg_ptr[s + 1]) of sequence s."""
    if SEQ:
        q = tl.program_id(0).to(tl.int64)
        e = tl.program_id(1).to(tl.int64)
        lo = tl.load(seg_ptr + q)
        hi = tl.load(seg_ptr + q + 1)
        c_lim = tl.load(cap_ptr + q)
        out = counts_ptr + q * E + e
    else:
        e = tl.program_id(0).to(tl.int64)
        lo = 0
        hi = n
        c_lim = cap
        out = counts_ptr + e
    thr = tl.full((), -(2**31) - 1, tl.int64)  # keep everything at or above thr (default: all)
    quota = tl.full((), 2**62, tl.int64)  # of those exactly at thr, keep the first `quota`
    if POLICY == 2:
        total = _count_ge(idx_ptr, s_ptr, lo, hi, e, -(2**31), BLOCK)
        if total > c_lim:
            blo = tl.full((), -(2**31), tl.int64)  # count(>= blo) >= cap
            bhi = tl.full((), 2**31, tl.int64)  # count(>= bhi) < cap
            for _ in range(32):
                mid = blo + (bhi - blo) // 2
                c = _count_ge(idx_ptr, s_ptr, lo, hi, e, mid, BLOCK)
                blo = tl.where(c >= c_lim, mid, blo)
                bhi = tl.where(c >= c_lim, bhi, mid)
            thr = blo
            quota = c_lim - _count_ge(idx_ptr, s_ptr, lo, hi, e, blo + 1, BLOCK)
    kept = tl.zeros((), dtype=tl.int64)
    seen = tl.zeros((), dtype=tl.int64)  # assignments to e at exactly thr so far (or all, for position)
    for start in range(lo, hi, BLOCK):
        offs = start + tl.arange(0, BLOCK).to(tl.int64)
        m = offs < hi
        hit = (tl.load(idx_ptr + offs, mask=m, other=-1) == e) & m
        if POLICY == 2:
            bits = tl.load(s_ptr + offs, mask=m, other=0.0).to(tl.int32, bitcast=True).to(tl.int64)
            at = hit & (bits == thr)
            rank = seen + tl.cumsum(at.to(tl.int64), 0) - 1
            keep = hit & ((bits > thr) | (at & (rank < quota)))
            seen += tl.sum(at.to(tl.int64), axis=0)
        elif POLICY == 1:
            rank = seen + tl.cumsum(hit.to(tl.int64), 0) - 1
            keep = hit & (rank < c_lim)
            seen += tl.sum(hit.to(tl.int64), axis=0)
        else:
            keep = hit
        pos = kept + tl.cumsum(keep.to(tl.int64), 0) - 1
        tl.store(pos_ptr + offs, tl.where(keep, pos, -1), mask=hit)
        kept += tl.sum(keep.to(tl.int64), axis=0)
    tl.store(out, kept)


@triton.jit
def _route_rows_kernel(idx_ptr, row_ptr, starts_ptr, tok_ptr, seg_ptr, n, E, K: tl.constexpr, BLOCK: tl.constexpr,
                       SEQ: tl.constexpr):  # fmt: skip
    """row = start of the group + position; token_index[row] = token. The group of an assignment is its
    expert (starts [E]) or, SEQ (grid (S, blocks)), its (sequence, expert) pair (starts [S * E]), program
    (s, b) covering block b of the assignments [seg_ptr[s], seg_ptr[s + 1])."""
    if SEQ:
        q = tl.program_id(0).to(tl.int64)
        lo = tl.load(seg_ptr + q)
        hi = tl.load(seg_ptr + q + 1)
        offs = lo + tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = offs < hi
        base = q * E
    else:
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        base = 0
    pos = tl.load(row_ptr + offs, mask=m, other=-1)
    keep = m & (pos >= 0)
    e = tl.load(idx_ptr + offs, mask=keep, other=0)
    row = tl.load(starts_ptr + base + e, mask=keep, other=0) + pos
    tl.store(row_ptr + offs, row, mask=keep)
    tl.store(tok_ptr + row, offs // K, mask=keep)


@triton.jit
def _token_row(row_ptr, t, j, N, K: tl.constexpr):
    """Token t's row of choice j, -1 for a row outside [0, N) (-1: dropped; anything else: a bad row map, which the
    public op refuses first). A thread-independent scalar load (one transaction a warp)."""
    r = tl.load(row_ptr + t * K + j)
    return tl.where((r >= 0) & (r < N), r, -1)


@triton.jit
def _permute_kernel(x_ptr, row_ptr, w_ptr, out_ptr, H, N, K: tl.constexpr, BLOCK_H: tl.constexpr,
                    HAS_W: tl.constexpr):  # fmt: skip
    """out[row_map[t, j]] = x[t] (times weights[t, j] with HAS_W) for the kept assignments, one program per token
    and BLOCK_H columns (a row when H <= BLOCK_H). A row outside [0, N) is not written."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_H + tl.arange(0, BLOCK_H)
    m = cols < H
    v = tl.load(x_ptr + t * H + cols, mask=m, other=0.0)
    for j in tl.static_range(K):
        r = _token_row(row_ptr, t, j, N, K)
        ok = m & ((cols * 0 + r) >= 0)  # [BLOCK_H] (a scalar mask is not accepted everywhere)
        dst = out_ptr + tl.maximum(r, 0) * H + cols
        if HAS_W:
            w = tl.load(w_ptr + t * K + j)
            tl.store(dst, cast(v.to(tl.float32) * w, out_ptr.dtype.element_ty), mask=ok)
        else:
            tl.store(dst, v, mask=ok)


@triton.jit
def _permute_padded_kernel(x_ptr, tok_ptr, out_ptr, H, T, BLOCK_H: tl.constexpr):
    """The permute of a padded routing, one program per row and BLOCK_H columns: out[i] = x[token_index[i]],
    zeros where token_index[i] is -1 (a padding row; an index outside [0, T) is not read either)."""
    i = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_H + tl.arange(0, BLOCK_H)
    m = cols < H
    t = tl.load(tok_ptr + i)
    tb = cols * 0 + t  # [BLOCK_H] (a scalar mask is not accepted everywhere)
    ok = (tb >= 0) & (tb < T)
    tt = tl.where((t >= 0) & (t < T), t, 0)
    v = tl.load(x_ptr + tt * H + cols, mask=m & ok, other=0.0)
    tl.store(out_ptr + i * H + cols, v, mask=m)


@triton.jit
def _unpermute_kernel(y_ptr, row_ptr, w_ptr, out_ptr, H, N, K: tl.constexpr, BLOCK_H: tl.constexpr,
                      HAS_W: tl.constexpr):  # fmt: skip
    """out[t] = sum_j weights[t, j] * y[row_map[t, j]] over the kept assignments, in fp32, one program per token and
    BLOCK_H columns (a row outside [0, N) is not read)."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_H + tl.arange(0, BLOCK_H)
    m = cols < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in tl.static_range(K):
        r = _token_row(row_ptr, t, j, N, K)
        ok = m & ((cols * 0 + r) >= 0)
        v = tl.load(y_ptr + tl.maximum(r, 0) * H + cols, mask=ok, other=0.0).to(tl.float32)
        if HAS_W:
            v = v * tl.load(w_ptr + t * K + j)
        acc += v
    tl.store(out_ptr + t * H + cols, cast(acc, out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _unpermute_bwd_kernel(
    gy_ptr, y_ptr, row_ptr, w_ptr, gyp_ptr, gw_ptr, H, N, K: tl.constexpr, KP: tl.constexpr, BLOCK_H: tl.constexpr
):
    """grad_y_perm[row_map[t, j]] = weights[t, j] * grad_y[t]; grad_w[t, j] = <grad_y[t], y_perm[row]> (a row
    outside [0, N) is neither read nor written), one program per token; its rows and weights are read once, before
    the loop over the row's column blocks."""
    t = tl.program_id(0).to(tl.int64)
    kcols = tl.arange(0, KP)
    rows = ()
    ws = ()
    for j in tl.static_range(K):
        rows = rows + (_token_row(row_ptr, t, j, N, K),)  # noqa: RUF005 (no starred tuples in Triton)
        ws = ws + (tl.load(w_ptr + t * K + j),)  # noqa: RUF005
    dots = tl.zeros((KP,), dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H).to(tl.int64)
        m = cols < H
        g = tl.load(gy_ptr + t * H + cols, mask=m, other=0.0).to(tl.float32)
        for j in tl.static_range(K):
            ok = m & ((cols * 0 + rows[j]) >= 0)
            rr = tl.maximum(rows[j], 0)
            tl.store(gyp_ptr + rr * H + cols, cast(g * ws[j], gyp_ptr.dtype.element_ty), mask=ok)
            y = tl.load(y_ptr + rr * H + cols, mask=ok, other=0.0).to(tl.float32)
            dots = tl.where(kcols == j, dots + tl.sum(g * y, axis=0), dots)
    tl.store(gw_ptr + t * K + kcols, dots, mask=kcols < K)
