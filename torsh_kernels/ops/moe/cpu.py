"""CPU kernels (Numba's CPU target) of the MoE op family (see the package docstring, ``moe/__init__.py``).

Imported on the cpu provider's first launch. Shapes: ``# T tokens, E experts, K chosen, H hidden``.

- route top-k: per token, the fp32 scores (softmax: max, exp, sum, divide; or sigmoid), K rounds of a
  strict maximum (equal scores keep the lower expert; NaN scores rank below every real one), the chosen
  scores, their renormalisation and scaling; counts the tokens with a NaN score. With a score bias or
  groups (the selection options of ``moe_route``) the rounds run on the keys ``score + bias`` inside the kept groups
  (each group's top-2 sum, the best groups by strict maxima), in a per-token scratch row.
- route assign: a counting sort of the T*K assignments by expert (stable: token order inside each
  expert); a capacity limit keeps each expert's first C in token order ("position") or its C highest
  scores ("probability", compared by their fp32 bit patterns as the GPU kernels do: equal scores keep
  the earlier token), over the whole call or over each sequence with its own C_s; then each kept
  assignment's row (padded: expert e's group starting at e * C) and the inverse map (-1 at padding rows).
- permute of a padded routing: per row, a copy of its token's row or zeros (rows as 16- or 32-bit words:
  one kernel for every dtype).
- permute, unpermute and the unpermute's backward: per token, rows of H in fp32, the K terms added in
  the order j = 0..K-1. The permute without weights is torch's ``index_select`` (a gather of whole rows
  is one pass already, on torch's threads); the weighted forms take fp32 rows (providers.py runs the torch
  implementation for 16-bit ones).
- The route scores small inputs itself and takes torch's softmax / sigmoid for large ones
  (:data:`TORCH_SCORES_FROM` scores and up: a vectorised exp on torch's threads beats a scalar one).
- The router losses' kernels are in ``cpu_losses.py`` (they share the scoring rows defined here).
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit

from ..cpu_common import arr, carray, f32, jit, p_b, p_f32, p_i64
from .routing import out_of_range as _out_of_range

# What the route and the aux loss read: logits scored by softmax or by sigmoid, or the scores themselves.
SOFTMAX, SIGMOID, PROBS = 0, 1, 2
# The aux loss's kernels also read scores torch computed from the logits (its vectorised exp): softmax
# probabilities, or sigmoid values (normalised per token in the kernel); the gradient still goes to the logits.
SOFTMAX_GIVEN, SIGMOID_GIVEN = 3, 4


@jit
def row_max(row):
    """The largest element of a row, NaN if one is NaN (as torch's max)."""
    m = np.float32(-np.inf)
    for e in range(row.size):
        v = row[e]
        if v != v:
            return v
        m = v if v > m else m
    return m


@jit
def softmax_row(row, p):
    """p = softmax(row) in fp32 (the max subtracted; a NaN or +inf makes the row NaN, as torch's)."""
    mx = row_max(row)
    tot = np.float32(0.0)
    for e in range(row.size):
        ev = np.exp(row[e] - mx)
        p[e] = ev
        tot += ev
    for e in range(row.size):
        p[e] = p[e] / tot


@jit
def sigmoid_row(row, p):
    """p = sigmoid(row) in fp32; returns the sum."""
    tot = np.float32(0.0)
    for e in range(row.size):
        v = np.float32(1.0) / (np.float32(1.0) + np.exp(-row[e]))
        p[e] = v
        tot += v
    return tot


@njit(inline="always", cache=True, nogil=True)
def _scores_row(row, score, p):
    """The row's fp32 scores into p (``score``: SOFTMAX or SIGMOID of logits, or PROBS: the row itself);
    whether one is NaN. (Inlined: a call per token costs the top-k about 5%.)"""
    E = row.size
    if score == PROBS:
        for e in range(E):
            p[e] = row[e]
    elif score == SOFTMAX:
        softmax_row(row, p)
    else:
        sigmoid_row(row, p)
    nan_row = False
    for e in range(E):
        if p[e] != p[e]:
            nan_row = True
    return nan_row


@njit(cache=True, nogil=True, inline="always")  # (inlined: a call per token cost 4% of a 64-token route)
def _weights_row(s, w, t, k, total, renorm, scaling):
    """Token ``t``'s combine weights from its chosen scores ``s[t]`` (summing to ``total``): renormalised when
    ``renorm``, times ``scaling``; where every chosen score underflowed (``total`` 0) they stay 0, the divisor
    being 1 (see reference.row_sums)."""
    if total == 0:
        total = np.float32(1.0)
    for j in range(k):
        w[t, j] = (s[t, j] / total if renorm else s[t, j]) * scaling


@jit
def _topk_plain(x, k, score, renorm, scaling, idx, w, s):
    """:func:`topk_arrays` without a bias or groups: K rounds of a strict maximum of the scores."""
    T, E = x.shape
    p = np.empty(E, np.float32)
    bad = 0
    for t in range(T):
        bad += _scores_row(x[t], score, p)
        total = np.float32(0.0)
        for j in range(k):
            best = np.float32(-3.0)
            pick = -1
            for e in range(E):
                taken = False
                for i in range(j):
                    if idx[t, i] == e:
                        taken = True
                if taken:
                    continue
                key = p[e] if p[e] == p[e] else np.float32(-1.0)
                if key > best:  # strict: equal scores keep the lower expert
                    best = key
                    pick = e
            idx[t, j] = pick
            s[t, j] = p[pick]
            total += p[pick]
        _weights_row(s, w, t, k, total, renorm, scaling)
    return bad


@jit
def _topk_select(x, k, score, renorm, bias, has_bias, G, TG, scaling, idx, w, s):
    """:func:`topk_arrays` with a bias and/or groups: per token the keys ``p + bias`` (NaN scores: -inf),
    with groups each group's top-2 sum and the TG best groups (strict maxima: the lower group on equal
    sums), then K rounds of a strict maximum of the keys over the kept groups' experts not yet chosen."""
    T, E = x.shape
    p = np.empty(E, np.float32)
    q = np.empty(E, np.float32)  # selection keys
    ok = np.empty(E, np.bool_)  # still choosable: in a kept group, not chosen yet
    ng = max(G, 1)
    gs = np.empty(ng, np.float32)  # group scores
    gk = np.empty(ng, np.bool_)  # kept groups
    size = E // ng
    ninf = np.float32(-np.inf)
    bad = 0
    for t in range(T):
        bad += _scores_row(x[t], score, p)
        for e in range(E):
            v = p[e]
            if v != v:
                q[e] = ninf
            elif has_bias:
                q[e] = v + bias[e]
            else:
                q[e] = v
        if G > 0:
            for g in range(G):
                m1 = ninf  # the group's two highest keys, m1 >= m2
                m2 = ninf
                for i in range(size):  # branch-free: m2 = max(m2, min(m1, v)), m1 = max(m1, v)
                    v = q[g * size + i]
                    lo = v if v < m1 else m1
                    m2 = lo if lo > m2 else m2
                    m1 = v if v > m1 else m1
                gs[g] = m1 + m2 if size > 1 else m1
                gk[g] = False
            for _r in range(TG):
                best = ninf
                pick = -1
                for g in range(G):
                    if not gk[g] and (pick < 0 or gs[g] > best):
                        best = gs[g]
                        pick = g
                gk[pick] = True
            for g in range(G):
                for i in range(size):
                    ok[g * size + i] = gk[g]
        else:
            for e in range(E):
                ok[e] = True
        total = np.float32(0.0)
        for j in range(k):
            best = ninf
            pick = -1
            for e in range(E):
                if ok[e] and (pick < 0 or q[e] > best):  # strict: equal keys keep the lower expert
                    best = q[e]
                    pick = e
            ok[pick] = False
            idx[t, j] = pick
            s[t, j] = p[pick]
            total += p[pick]
        _weights_row(s, w, t, k, total, renorm, scaling)
    return bad


@jit
def topk_arrays(x, k, score, renorm, bias, has_bias, G, TG, scaling, idx, w, s):
    """Scores of ``x`` [T, E] (fp32; ``score``: SOFTMAX or SIGMOID of logits, or PROBS: x holds the
    scores), the top ``k`` per token into idx, s and w [T, K] (w times ``scaling``); with ``has_bias`` and/or
    ``G`` > 0 groups (``TG`` kept) the selection options of ``moe_route``. Returns the number of tokens with a NaN
    score."""
    if has_bias or G > 0:
        return _topk_select(x, k, score, renorm, bias, has_bias, G, TG, scaling, idx, w, s)
    return _topk_plain(x, k, score, renorm, scaling, idx, w, s)


@jit
def _keep_by_score(idx, sb, lo, hi, E, cap, total, start, order, keep):
    """Probability policy on the assignments [lo, hi): each expert keeps its ``cap`` highest scores (compared
    by their fp32 bit patterns ``sb``; equal scores keep the earlier token). ``total``, ``start`` and
    ``order`` are work arrays ([E], [E + 1], [>= hi - lo])."""
    for e in range(E):
        total[e] = 0
    for i in range(lo, hi):
        total[idx[i]] += 1
    for e in range(E):
        start[e + 1] = start[e] + total[e]
    fill = start[:E].copy()
    for i in range(lo, hi):  # the span's assignments grouped by expert, token order inside
        e = idx[i]
        order[fill[e]] = i
        fill[e] += 1
    for e in range(E):
        m = total[e]
        if m <= cap:
            continue
        seg = order[start[e] : start[e] + m]
        if cap == 0:
            for a in range(m):
                keep[seg[a]] = False
            continue
        b = np.empty(m, np.int32)
        for a in range(m):
            b[a] = sb[seg[a]]
        thr = np.partition(b, m - cap)[m - cap]  # the cap-th highest score's bits
        quota = cap
        for a in range(m):
            quota -= b[a] > thr
        for a in range(m):  # token order: of the scores equal to thr, the earliest are kept
            if b[a] > thr:
                continue
            if b[a] == thr and quota > 0:
                quota -= 1
            else:
                keep[seg[a]] = False


@jit
def assign_arrays(idx, s, E, cap, policy, k, rows, counts, tok, seg, caps, pad):
    """Rows of the T*K assignments (``idx``, ``s`` flat, token-major): ``rows`` (-1 dropped), ``counts``
    [E] kept per expert, ``tok`` the token of each row; returns N, the number of rows. ``policy``: 0 no
    limit, 1 position, 2 probability: ``cap`` assignments per expert at most, or with ``seg`` (the
    sequences' first assignments, then T*K; empty: the call scope) ``caps[s]`` per expert from sequence s.
    ``pad`` >= 0: every expert's group padded to ``pad`` rows (N = E * pad; ``tok`` [E * pad], -1 at the
    padding rows)."""
    n = idx.size
    keep = np.ones(n, np.bool_)
    nspan = 1 if seg.size == 0 else seg.size - 1
    if policy == 1:
        seen = np.zeros(E, np.int64)
        for q in range(nspan):
            lo, hi, c = (0, n, cap) if seg.size == 0 else (seg[q], seg[q + 1], caps[q])
            for e in range(E):
                seen[e] = 0
            for i in range(lo, hi):
                e = idx[i]
                keep[i] = seen[e] < c
                seen[e] += 1
    elif policy == 2:
        sb = s.view(np.int32)
        total = np.zeros(E, np.int64)
        start = np.zeros(E + 1, np.int64)
        order = np.empty(n, np.int64)
        for q in range(nspan):
            lo, hi, c = (0, n, cap) if seg.size == 0 else (seg[q], seg[q + 1], caps[q])
            _keep_by_score(idx, sb, lo, hi, E, c, total, start, order, keep)
    for e in range(E):
        counts[e] = 0
    for i in range(n):
        if keep[i]:
            counts[idx[i]] += 1
    pos = np.empty(E, np.int64)
    acc = 0
    for e in range(E):
        pos[e] = acc if pad < 0 else e * pad
        acc += counts[e]
    for i in range(n):
        if keep[i]:
            r = pos[idx[i]]
            pos[idx[i]] = r + 1
            rows[i] = r
            tok[r] = i // k
        else:
            rows[i] = -1
    if pad < 0:
        return acc
    for e in range(E):  # the padding rows at the end of each group
        for r in range(e * pad + counts[e], (e + 1) * pad):
            tok[r] = -1
    return E * pad


@jit
def route_arrays(x, k, score, renorm, bias, has_bias, G, TG, scaling, E, cap, policy, idx, w, s, rows, counts, tok):
    """Both steps of the route in one call: (tokens with a NaN score, N)."""
    bad = topk_arrays(x, k, score, renorm, bias, has_bias, G, TG, scaling, idx, w, s)
    none = counts[:0]  # (the call scope: no sequences; an empty view, nothing allocated)
    n = assign_arrays(idx.reshape(-1), s.reshape(-1), E, cap, policy, k, rows.reshape(-1), counts, tok, none, none,
                      -1)  # fmt: skip
    return bad, n


@jit
def _in_range(ix, n):
    """Whether every index of ``ix`` is in [0, n) (-1, a dropped assignment, also passes when allowed)."""
    for i in range(ix.size):  # noqa: SIM110 (a generator in all() does not compile)
        if ix.flat[i] >= n or ix.flat[i] < -1:
            return False
    return True


@jit
def _mark_dropped(rows, d):
    """``d[t, j] = rows[t, j] < 0``."""
    T, k = rows.shape
    for t in range(T):
        for j in range(k):
            d[t, j] = rows[t, j] < 0


@jit
def route_ptr(xp, T, E, k, score, renorm, cap, policy, ip, wp, sp, rp, cp, tp, dp):
    """Both steps of the route on addresses (fp32 logits [T, E]; idx, w, s, rows, dropped [T, K]; counts [E];
    tok [T*K]) without the selection options, also writing ``dropped``; returns (tokens with a NaN score, N).
    (Its own entry point, calling the plain top-k itself: an argument costs the dispatcher about 60 ns a call,
    and a nested call of the options' entry point cost the T=4096, E=64 route about 5%.)"""
    rows = carray(p_i64(rp), (T, k))
    idx, s = carray(p_i64(ip), (T, k)), carray(p_f32(sp), (T, k))
    bad = _topk_plain(carray(p_f32(xp), (T, E)), k, score, renorm, np.float32(1.0), idx, carray(p_f32(wp), (T, k)), s)
    counts = carray(p_i64(cp), (E,))
    none = counts[:0]  # (the call scope: no sequences, no padding)
    n = assign_arrays(idx.reshape(-1), s.reshape(-1), E, cap, policy, k, rows.reshape(-1), counts,
                      carray(p_i64(tp), (T * k,)), none, none, -1)  # fmt: skip
    _mark_dropped(rows, carray(p_b(dp), (T, k)))
    return bad, n


@jit
def route_select_ptr(xp, T, E, k, score, renorm, bp, has_bias, G, TG, scaling, cap, policy, ip, wp, sp, rp, cp, tp,
                     dp):  # fmt: skip
    """:func:`route_ptr` with the selection options: the fp32 bias [E] at ``bp`` (read only with
    ``has_bias``), ``G`` groups (0: none) of which ``TG`` are kept, the weights' ``scaling``."""
    rows = carray(p_i64(rp), (T, k))
    bias = carray(p_f32(bp), (E if has_bias else 0,))
    bad, n = route_arrays(carray(p_f32(xp), (T, E)), k, score, renorm, bias, has_bias, G, TG, np.float32(scaling), E,
                          cap, policy, carray(p_i64(ip), (T, k)), carray(p_f32(wp), (T, k)), carray(p_f32(sp), (T, k)),
                          rows, carray(p_i64(cp), (E,)), carray(p_i64(tp), (T * k,)))  # fmt: skip
    _mark_dropped(rows, carray(p_b(dp), (T, k)))
    return bad, n


@jit
def gather_rows_ptr(yp, N, H, rp, T, K, wp, has_w, op):
    """:func:`gather_rows_arrays` on addresses: fp32 y [N, H], rows int64 and fp32 w [T, K], out [T, H]."""
    return gather_rows_arrays(carray(p_f32(yp), (N, H)), carray(p_i64(rp), (T, K)), carray(p_f32(wp), (T, K)), has_w,
                              carray(p_f32(op), (T, H)))  # fmt: skip


@jit
def scatter_weighted_arrays(x, rows, w, out):
    """``out[rows[t, j]] = x[t] * w[t, j]`` (fp32), dropped assignments skipped; False (nothing written)
    when a row is outside [0, N)."""
    if not _in_range(rows, out.shape[0]):
        return False
    T, K = rows.shape
    H = x.shape[1]
    for t in range(T):
        src = x[t]
        for j in range(K):
            r = rows[t, j]
            if r < 0:
                continue
            wj = w[t, j]
            dst = out[r]
            for h in range(H):
                dst[h] = src[h] * wj
    return True


@jit
def gather_rows_arrays(y, rows, w, has_w, out):
    """``out[t] = sum_j w[t, j] * y[rows[t, j]]`` (fp32, j in order), dropped assignments adding nothing;
    False (nothing written) when a row is outside [0, N)."""
    if not _in_range(rows, y.shape[0]):
        return False
    T, K = rows.shape
    H = y.shape[1]
    for t in range(T):
        dst = out[t]
        for h in range(H):
            dst[h] = 0.0
        for j in range(K):
            r = rows[t, j]
            if r < 0:
                continue
            src = y[r]
            if has_w:
                wj = w[t, j]
                if j == 0:
                    for h in range(H):
                        dst[h] = src[h] * wj
                else:
                    for h in range(H):
                        dst[h] = dst[h] + src[h] * wj
            else:
                for h in range(H):
                    dst[h] = dst[h] + src[h]
    return True


@jit
def gather_rows_bwd_arrays(gy, y, rows, w, gyp, gw):
    """The unpermute's backward: ``gyp[rows[t, j]] = gy[t] * w[t, j]`` and ``gw[t, j] = gy[t] . y[rows[t, j]]``
    (fp32, 0 for a dropped assignment); False (nothing written) when a row is outside [0, N)."""
    if not _in_range(rows, y.shape[0]):
        return False
    T, K = rows.shape
    H = gy.shape[1]
    for t in range(T):
        g = gy[t]
        for j in range(K):
            r = rows[t, j]
            if r < 0:
                gw[t, j] = 0.0
                continue
            wj = w[t, j]
            dst = gyp[r]
            src = y[r]
            dot = np.float32(0.0)
            for h in range(H):
                dst[h] = g[h] * wj
                dot += g[h] * src[h]
            gw[t, j] = dot
    return True


@jit
def topk_ptr(xp, T, E, k, score, renorm, bp, has_bias, G, TG, scaling, ip, wp, sp):
    return topk_arrays(carray(p_f32(xp), (T, E)), k, score, renorm, carray(p_f32(bp), (E if has_bias else 0,)),
                       has_bias, G, TG, np.float32(scaling), carray(p_i64(ip), (T, k)), carray(p_f32(wp), (T, k)),
                       carray(p_f32(sp), (T, k)))  # fmt: skip


@jit
def assign_ptr(ip, sp, n, E, cap, policy, k, rp, cp, tp, ntok, gp, nseg, qp, pad):
    """:func:`assign_arrays` on addresses: idx, s, rows [n]; counts [E]; tok [ntok]; seg [nseg]; caps [nseg - 1]
    (nseg = 0: the call scope, gp and qp not read)."""
    if nseg == 0:  # the call scope: an empty view, nothing allocated
        seg = caps = carray(p_i64(cp), (E,))[:0]
    else:
        seg = carray(p_i64(gp), (nseg,))
        caps = carray(p_i64(qp), (nseg - 1,))
    return assign_arrays(carray(p_i64(ip), (n,)), carray(p_f32(sp), (n,)), E, cap, policy, k, carray(p_i64(rp), (n,)),
                         carray(p_i64(cp), (E,)), carray(p_i64(tp), (ntok,)), seg, caps, pad)  # fmt: skip


@jit
def scatter_weighted_ptr(xp, T, H, rp, K, wp, op, N):
    return scatter_weighted_arrays(carray(p_f32(xp), (T, H)), carray(p_i64(rp), (T, K)), carray(p_f32(wp), (T, K)),
                                   carray(p_f32(op), (N, H)))  # fmt: skip


@jit
def gather_rows_bwd_ptr(gp, T, H, yp, N, rp, K, wp, gyp, gwp):
    return gather_rows_bwd_arrays(
        carray(p_f32(gp), (T, H)),
        carray(p_f32(yp), (N, H)),
        carray(p_i64(rp), (T, K)),
        carray(p_f32(wp), (T, K)),
        carray(p_f32(gyp), (N, H)),
        carray(p_f32(gwp), (T, K)),
    )


def i64(t: torch.Tensor) -> torch.Tensor:
    """An index tensor as contiguous int64 (itself when it is)."""
    return t if t.dtype is torch.int64 and t.is_contiguous() else t.contiguous().long()


# Above this many scores the route's scoring runs in torch (vectorised exp, torch's threads) and the kernel
# takes the scores; below, the kernel scores them itself (no extra pass, no call).
TORCH_SCORES_FROM = 1 << 15


def scores_for_kernel(x: torch.Tensor, score: str) -> tuple[torch.Tensor, int]:
    """(what the route kernel reads, the kernel's score mode) for fp32 contiguous logits [T, E]."""
    if x.numel() >= TORCH_SCORES_FROM:
        return (torch.softmax(x, -1) if score == "softmax" else torch.sigmoid(x)), PROBS
    return x, SOFTMAX if score == "softmax" else SIGMOID


def route_topk(logits: torch.Tensor, k: int, score: str, renorm: bool, bias: torch.Tensor | None = None, G: int = 0,
               TG: int = 0, scaling: float = 1.0):  # fmt: skip
    x, mode = scores_for_kernel(f32(logits).contiguous(), score)
    T, E = x.shape
    idx = torch.empty(T, k, dtype=torch.int64)
    w = torch.empty(T, k, dtype=torch.float32)
    s = torch.empty(T, k, dtype=torch.float32)
    b = bias.contiguous() if bias is not None else None
    bad = topk_ptr(x.data_ptr(), T, E, k, mode, bool(renorm), 0 if b is None else b.data_ptr(), b is not None, G, TG,
                   float(scaling), idx.data_ptr(), w.data_ptr(), s.data_ptr())  # fmt: skip
    return idx, w, s, bad


def route_assign(idx: torch.Tensor, s: torch.Tensor, E: int, cap: int, policy: int, seg: torch.Tensor | None = None,
                 caps: torch.Tensor | None = None, pad: int = -1):  # fmt: skip
    """(rows [T*K], counts [E], token_index [N]); ``seg`` [S + 1] (each sequence's first assignment, then T*K) and
    ``caps`` [S] (int64) for a capacity per sequence, ``pad`` >= 0 to pad every expert's group to ``pad`` rows."""
    n, k = idx.numel(), idx.shape[1]
    idx, s = i64(idx), s.contiguous()
    rows = torch.empty(n, dtype=torch.int64)
    counts = torch.empty(E, dtype=torch.int64)
    ntok = n if pad < 0 else E * pad
    tok = torch.empty(ntok, dtype=torch.int64)
    n_rows = assign_ptr(idx.data_ptr(), s.data_ptr(), n, E, cap, policy, k, rows.data_ptr(), counts.data_ptr(),
                        tok.data_ptr(), ntok, 0 if seg is None else seg.data_ptr(), 0 if seg is None else seg.numel(),
                        0 if caps is None else caps.data_ptr(), pad)  # fmt: skip
    return rows, counts, tok[:n_rows] if n_rows < ntok else tok


def weighted_ok(*tensors: torch.Tensor | None) -> bool:
    """Whether the weighted row kernels take these tensors (fp32 rows and weights)."""
    return all(t is None or t.dtype is torch.float32 for t in tensors)


def scatter_rows(x, rows, tok, w, out) -> None:
    x = x.contiguous()
    if w is None:  # a gather of whole rows: torch's index_select (one pass, its threads), which checks tok
        try:
            torch.index_select(x, 0, tok, out=out)
        except (IndexError, RuntimeError):
            raise _out_of_range("moe_permute") from None
        return
    else:
        rows, w = i64(rows), w.contiguous()
        ok = scatter_weighted_ptr(x.data_ptr(), x.shape[0], x.shape[1], rows.data_ptr(), rows.shape[1], w.data_ptr(),
                                  out.data_ptr(), out.shape[0])  # fmt: skip
    if not ok:
        raise _out_of_range("moe_permute")


@jit
def permute_padded_arrays(x, tok, out):
    """``out[i] = x[tok[i]]``, zeros where ``tok[i]`` is -1 (rows of any dtype as words); False (nothing
    written) when a token index is outside [-1, T)."""
    if not _in_range(tok, x.shape[0]):
        return False
    W = out.shape[1]
    for i in range(tok.size):
        t = tok[i]
        dst = out[i]
        if t < 0:
            for h in range(W):
                dst[h] = 0
        else:
            src = x[t]
            for h in range(W):
                dst[h] = src[h]
    return True


_WORDS = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def permute_padded(x: torch.Tensor, tok: torch.Tensor, out: torch.Tensor) -> None:
    """The permute of a padded routing: out [N, H] from x [T, H] through the token index (-1: a zero row)."""
    word = _WORDS[x.element_size()]  # (a view as integers of the element's size keeps the shape [T, H])
    if not permute_padded_arrays(arr(x.contiguous().view(word)), arr(i64(tok)), arr(out.view(word))):
        raise _out_of_range("moe_permute")


def gather_rows(y, rows, w, out) -> None:
    y, rows = y.contiguous(), i64(rows)
    wt = w.contiguous() if w is not None else None
    if not gather_rows_ptr(y.data_ptr(), y.shape[0], y.shape[1], rows.data_ptr(), rows.shape[0], rows.shape[1],
                           wt.data_ptr() if wt is not None else 0, wt is not None, out.data_ptr()):  # fmt: skip
        raise _out_of_range("moe_unpermute")


def gather_rows_bwd(gy, y, rows, w, gyp) -> torch.Tensor:
    gy, y, rows, w = gy.contiguous(), y.contiguous(), i64(rows), w.contiguous()
    T, K = rows.shape
    gw = torch.empty(T, K, dtype=torch.float32)
    if not gather_rows_bwd_ptr(gy.data_ptr(), T, gy.shape[1], y.data_ptr(), y.shape[0], rows.data_ptr(), K,
                               w.data_ptr(), gyp.data_ptr(), gw.data_ptr()):  # fmt: skip
        raise _out_of_range("moe_unpermute")
    return gw
