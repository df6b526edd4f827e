"""The MoE family's provider implementations (torch, triton, numba, cpu) of its internal ops (the route's selection
and assignment, the row scatter and gather and the gather's backward), registered with the provider registry; the
kernels themselves are in ``triton.py``, ``numba.py``, ``cpu.py``, loaded on first use. Inputs are
validated and contiguous, on one device. The ops are in :mod:`torsh_kernels.ops.moe.api`."""

from __future__ import annotations

import itertools
import math

import torch

from ...errors import ShapeError
from ..registry import Op
from .reference import choose_ref, renormalized, scores_ref, selection_keys
from .routing import out_of_range

MAX_KERNEL_EXPERTS = 1024
# The kernels unroll the K choices of a token; beyond this many the torch path runs instead.
MAX_KERNEL_K = 32
# Codes the kernels take for the score function and the capacity policy.
_SOFTMAX, _SIGMOID = 0, 1
NO_CAP, CAP_POSITION, CAP_PROBABILITY = 0, 1, 2

# --------------------------------------------------------------------------------------------------
# Provider implementations. Inputs are validated and contiguous, on one device.

topk = Op("moe_route")
assign = Op("moe_route.assign")
scatter_rows = Op("moe_permute")
gather_rows = Op("moe_unpermute")
gather_rows_bwd = Op("moe_unpermute.backward")

_ASSIGN_BLOCK = 1024


def select(op: Op, t: torch.Tensor, provider: str, k: int, num_experts: int = 0) -> str:
    """The provider for this call; the torch path past the kernels' limits on K and E (an explicitly
    requested kernel provider then raises instead)."""
    name = op.select(t.device, t.dtype, t.numel(), provider or None)
    if name == "torch" or name == "cpu":  # no register-file limits
        return name
    limit = None
    if k > MAX_KERNEL_K:
        limit = f"up to k={MAX_KERNEL_K} choices per token, got k={k}"
    elif num_experts > MAX_KERNEL_EXPERTS:
        limit = f"up to {MAX_KERNEL_EXPERTS} experts, got E={num_experts}"
    if limit is None:
        return name
    if provider:
        raise ShapeError(f"torsh_kernels.{op.name}: the {provider} kernels handle {limit}; use provider='torch'")
    return "torch"


POLICY = {"position": CAP_POSITION, "probability": CAP_PROBABILITY}


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


# The permute kernels: a program moves up to ROW_BLOCK columns of a row (a whole row at H <= ROW_BLOCK), 32 elements
# a thread at ROW_WARPS, unless that leaves fewer than ROW_PROGRAMS programs (few tokens: down to 1024 columns, 8 a
# thread, for more programs); the unpermute backward loops over a row in BWD_BLOCK columns.
ROW_BLOCK, ROW_WARPS, ROW_PROGRAMS = 4096, 4, 1024
BWD_BLOCK, BWD_WARPS = 2048, 4


def _block_h(H: int, block: int | None = None) -> int:
    return min(block or ROW_BLOCK, _pow2(H))


def _row_block(rows: int, H: int) -> int:
    """Columns a program of the permute kernels moves, for ``rows`` programs' rows of H columns."""
    bh = _block_h(H)
    while bh > 1024 and rows * -(-H // bh) < ROW_PROGRAMS:
        bh //= 2
    return bh


def _argmax_rounds(key: torch.Tensor, k: int, fill: float) -> torch.Tensor:
    """[T, k] int64: the k highest of each row of ``key`` [T, E] (overwritten), by k rounds of argmax (which returns
    the first, lowest, index of equal maxima); a chosen key is set to ``fill``, below every other key."""
    idx = torch.empty(key.shape[0], k, dtype=torch.int64, device=key.device)
    for j in range(k):
        i = key.argmax(1, keepdim=True)
        idx[:, j : j + 1] = i
        if j + 1 < k:
            key.scatter_(1, i, fill)
    return idx


# scoring and top-k: (logits [T, E], k, score, renorm, bias [E] | None, n_group, topk_group (0: no groups),
# scaling) -> indices, weights, scores [T, K], bad-row count [1]
@topk.register("torch")
def _topk_torch(logits, k, score, renorm, bias, n_group, topk_group, scaling):
    p = scores_ref(logits, score)
    nan = torch.isnan(p)
    bad = nan.any(1).sum().view(1)
    if bias is not None or n_group:  # the selection options: the reference's keys
        if k <= 8:  # a chosen key drops to -inf, below them all
            idx = _argmax_rounds(selection_keys(p, bias, n_group, topk_group), k, -math.inf)
        else:
            idx = choose_ref(p, k, bias, n_group, topk_group)
    elif k <= 8:  # scores in [0, 1], NaN as -1: a chosen one drops to -3, below them all
        idx = _argmax_rounds(torch.where(nan, -1.0, p), k, -3.0)
    else:
        sel = torch.where(nan, -1.0, p)
        idx = torch.sort(sel, dim=1, descending=True, stable=True).indices[:, :k].contiguous()
    s = p.gather(1, idx)
    w = renormalized(s) if renorm else s.clone()
    if scaling != 1.0:
        w.mul_(scaling)
    return idx, w, s, bad


@topk.register("triton")
def _topk_triton(logits, k, score, renorm, bias, n_group, topk_group, scaling):
    import triton

    from . import triton as kt

    T, E = logits.shape
    dev = logits.device
    idx = torch.empty(T, k, dtype=torch.int64, device=dev)
    w = torch.empty(T, k, dtype=torch.float32, device=dev)
    s = torch.empty(T, k, dtype=torch.float32, device=dev)
    bad = torch.zeros(1, dtype=torch.int32, device=dev)
    EP = max(2, _pow2(E))
    # a [BT, EP] tile of scores, 32 a thread at 4 warps; the selection options (bias, groups) hold more such tiles
    # live (keys, the experts still choosable): 8 a thread at 8 warps, or E=256, k=8 spilled at 195-246 registers
    options = bias is not None or n_group > 0
    BT = max(1, min(64, (2048 if options else 4096) // EP))
    kt._route_topk_kernel[(triton.cdiv(T, BT),)](
        logits, bias if bias is not None else logits, idx, w, s, bad, T, E, logits.stride(0), n_group, topk_group,
        E // max(n_group, 1), scaling,
        K=k, KP=max(2, _pow2(k)), EP=EP, GP=max(2, _pow2(n_group)), BLOCK_T=BT,
        SCORE=_SOFTMAX if score == "softmax" else _SIGMOID, RENORM=renorm, HAS_BIAS=bias is not None,
        GROUPED=n_group > 0, num_warps=8 if options else 4,
    )  # fmt: skip
    return idx, w, s, bad


@topk.register("numba")
def _topk_numba(logits, k, score, renorm, bias, n_group, topk_group, scaling):
    from . import numba as M

    return M.route_topk(logits, k, score == "softmax", renorm, bias, n_group, topk_group, scaling)


@topk.register("cpu")
def _topk_cpu(logits, k, score, renorm, bias, n_group, topk_group, scaling):
    from . import cpu as M

    return M.route_topk(logits, k, score, renorm, bias, n_group, topk_group, scaling)


# assignment -> row: (indices [T, K], scores [T, K]) -> row_map [T*K] (-1 dropped), counts [E], token_index [N].
# ``cap``: the call's capacity (policy != NO_CAP), or ``seq`` = (L_s, C_s) per sequence; ``pad`` >= 0: every
# expert's group padded to ``pad`` rows (N = E * pad, token_index -1 at the padding rows).
@assign.register("torch")
def _assign_torch(idx, s, E, cap, policy, seq=None, pad=-1):
    """Stable sorts instead of one pass per expert: rows ordered by (expert, token)."""
    flat = idx.reshape(-1)  # [T*K] token-major
    n, k = flat.numel(), idx.shape[1]
    dev = flat.device
    ar = torch.arange(n, device=dev)
    if policy == NO_CAP:
        keep = None
    else:
        if seq is None:  # ranks inside each expert
            group, groups, limit = flat, E, cap
        else:  # ranks inside each (expert, sequence): group e * S + s (the sequences are in token order)
            S = len(seq[0])
            sid = torch.repeat_interleave(torch.arange(S, device=dev), torch.tensor(seq[0], device=dev) * k,
                                          output_size=n)  # fmt: skip
            group, groups = flat * S + sid, E * S
            limit = torch.tensor(seq[1], dtype=torch.int64, device=dev)[sid]  # [T*K] each assignment's C_s
        counts_all = torch.bincount(group, minlength=groups)
        starts_all = torch.cumsum(counts_all, 0) - counts_all
        if policy == CAP_POSITION:
            order = torch.sort(group, stable=True).indices  # by group, then token
        else:  # by group, then score descending, then token
            by_score = torch.sort(s.reshape(-1), descending=True, stable=True).indices
            order = by_score[torch.sort(group[by_score], stable=True).indices]
        rank_sorted = ar - starts_all[group[order]]  # rank of each assignment inside its group
        keep = torch.empty(n, dtype=torch.bool, device=dev)
        keep[order] = rank_sorted < (limit if seq is None else limit[order])
    key = flat if keep is None else torch.where(keep, flat, E)  # dropped ones sort last
    order = torch.sort(key, stable=True).indices  # kept rows grouped by expert, token order inside
    counts = torch.bincount(key, minlength=E + 1)[:E]
    rows = torch.empty(n, dtype=torch.int64, device=dev)
    if pad < 0:
        n_rows = n if keep is None else int(counts.sum())
        rows[order] = ar
        if keep is not None:
            rows.masked_fill_(~keep, -1)
        return rows, counts, order[:n_rows] // k
    # padded: expert e's kept rows at e * pad + their rank; N = E * pad without reading the counts
    starts = torch.cumsum(counts, 0) - counts
    ks = key[order]  # [T*K] expert of each sorted assignment (E: dropped, sorted last)
    ok = ks < E
    ke = ks.clamp(max=E - 1)
    r_sorted = torch.where(ok, ke * pad + (ar - starts[ke]), -1)
    rows[order] = r_sorted
    tok = torch.full((E * pad + 1,), -1, dtype=torch.int64, device=dev)  # (the last slot takes the dropped ones)
    tok.scatter_(0, torch.where(ok, r_sorted, E * pad), torch.where(ok, order // k, -1))
    return rows, counts, tok[: E * pad]


def _segments(seq, k: int, device: torch.device) -> torch.Tensor:
    """[S + 1] int64 on ``device``: the first assignment of each sequence, then T*K."""
    ends = list(itertools.accumulate(seq[0], initial=0))
    return torch.tensor(ends, dtype=torch.int64, device=device) * k


def _finish_rows(name, idx, pos, counts, policy, k, E, seq, pad, seg):
    """Kernels: per-group positions (``counts`` [E] per expert, or [S, E] per sequence and expert) -> rows (in
    place, ``pos``) and the inverse map; -> (rows, tokens_per_expert, token_index)."""
    n = idx.numel()
    if seq is None:
        tpe, within = counts, None
    else:
        c = counts.view(len(seq[0]), E)
        tpe = c.sum(0)
        within = torch.cumsum(c, 0) - c  # [S, E] rows of expert e kept from earlier sequences
    if pad < 0:
        n_rows = n if policy == NO_CAP else int(tpe.sum())
        starts = torch.cumsum(tpe, 0) - tpe
        tok = torch.empty(n_rows, dtype=torch.int64, device=idx.device)
    else:
        starts = torch.arange(E, dtype=torch.int64, device=idx.device) * pad
        tok = torch.full((E * pad,), -1, dtype=torch.int64, device=idx.device)
    if within is not None:
        starts = (starts.unsqueeze(0) + within).reshape(-1)  # [S * E]
    if name == "triton":
        import triton

        from . import triton as kt

        if seq is None:
            kt._route_rows_kernel[(triton.cdiv(n, 1024),)](idx, pos, starts, tok, idx, n, E, K=k, BLOCK=1024,
                                                            SEQ=False)  # fmt: skip
        else:
            grid = (len(seq[0]), triton.cdiv(max(seq[0]) * k, 1024))
            kt._route_rows_kernel[grid](idx, pos, starts, tok, seg, n, E, K=k, BLOCK=1024, SEQ=True)
    else:
        from . import numba as M

        M.route_rows(idx, pos, starts, tok, k, seg, E)
    return pos, tpe, tok


@assign.register("triton")
def _assign_triton(idx, s, E, cap, policy, seq=None, pad=-1):
    from . import triton as kt

    n = idx.numel()
    dev = idx.device
    pos = torch.empty(n, dtype=torch.int64, device=dev)
    if seq is None:
        seg = None
        counts = torch.empty(E, dtype=torch.int64, device=dev)
        kt._route_assign_kernel[(E,)](idx, s, pos, counts, idx, idx, n, cap, E, BLOCK=_ASSIGN_BLOCK, POLICY=policy,
                                      SEQ=False)  # fmt: skip
    else:  # one program per (sequence, expert)
        S = len(seq[0])
        seg = _segments(seq, idx.shape[1], dev)
        caps = torch.tensor(seq[1], dtype=torch.int64, device=dev)
        counts = torch.empty(S * E, dtype=torch.int64, device=dev)
        kt._route_assign_kernel[(S, E)](idx, s, pos, counts, seg, caps, n, 0, E, BLOCK=_ASSIGN_BLOCK, POLICY=policy,
                                        SEQ=True)  # fmt: skip
    return _finish_rows("triton", idx, pos, counts, policy, idx.shape[1], E, seq, pad, seg)


@assign.register("numba")
def _assign_numba(idx, s, E, cap, policy, seq=None, pad=-1):
    from . import numba as M

    seg = None if seq is None else _segments(seq, idx.shape[1], idx.device)
    caps = None if seq is None else torch.tensor(seq[1], dtype=torch.int64, device=idx.device)
    pos, counts = M.route_assign(idx, s, E, cap, policy, seg, caps)
    return _finish_rows("numba", idx, pos, counts, policy, idx.shape[1], E, seq, pad, seg)


@assign.register("cpu")
def _assign_cpu(idx, s, E, cap, policy, seq=None, pad=-1):
    from . import cpu as M

    if seq is None:
        return M.route_assign(idx, s, E, cap, policy, None, None, pad)
    caps = torch.tensor(seq[1], dtype=torch.int64)
    return M.route_assign(idx, s, E, cap, policy, _segments(seq, idx.shape[1], idx.device), caps, pad)


# scatter rows: out[row_map[t, j]] = x[t] (* w[t, j]); tok = the inverse map (out[i] = x[tok[i]] * ...).
# ``padded`` (the permute of a padded routing, w None): out[i] = x[tok[i]], zeros where tok[i] is -1.
@scatter_rows.register("torch")
def _scatter_rows_torch(x, rows, tok, w, out, padded=False):
    if padded:  # a gather through the inverse map, then the padding rows zeroed
        if x.shape[0] == 0:  # no tokens: every row is padding (a token index here is out of range)
            if tok.numel() and int(tok.max()) >= 0:
                raise out_of_range("moe_permute")
            out.zero_()
            return
        try:
            torch.index_select(x, 0, tok.clamp(min=0), out=out)
        except (IndexError, RuntimeError):
            if tok.numel() and not (int(tok.min()) >= -1 and int(tok.max()) < x.shape[0]):
                raise out_of_range("moe_permute") from None
            raise
        out.masked_fill_((tok < 0).unsqueeze(1), 0)
        return
    if w is None:  # a gather through the inverse map: one pass, no masks (torch checks every index first)
        try:
            torch.index_select(x, 0, tok, out=out)
        except (IndexError, RuntimeError):
            if tok.numel() and not (int(tok.min()) >= 0 and int(tok.max()) < x.shape[0]):
                raise out_of_range("moe_permute") from None
            raise
        return
    T, K = rows.shape
    ok = rows >= 0
    src = x.unsqueeze(1).expand(T, K, x.shape[1])[ok]
    if w is not None:
        src = (src.float() * w[ok][:, None]).to(out.dtype)
    out[rows[ok]] = src


@scatter_rows.register("triton")
def _scatter_rows_triton(x, rows, tok, w, out, padded=False):
    import triton

    from . import triton as kt

    T, K = rows.shape
    H = x.shape[1]
    BH = _row_block(out.shape[0] if padded else T, H)
    if padded:  # one program per row and column block: every row written once, padding rows as zeros
        kt._permute_padded_kernel[(out.shape[0], triton.cdiv(H, BH))](x, tok, out, H, T, BLOCK_H=BH,
                                                                       num_warps=ROW_WARPS)  # fmt: skip
        return
    kt._permute_kernel[(T, triton.cdiv(H, BH))](x, rows, w if w is not None else rows, out, H, out.shape[0], K=K,
                                                 BLOCK_H=BH, HAS_W=w is not None,
                                                 num_warps=ROW_WARPS)  # fmt: skip


@scatter_rows.register("numba")
def _scatter_rows_numba(x, rows, tok, w, out, padded=False):
    from . import numba as M

    if padded:
        M.permute_padded(x, tok, out)
    else:
        M.scatter_rows(x, rows, w, out)


@scatter_rows.register("cpu")
def _scatter_rows_cpu(x, rows, tok, w, out, padded=False):
    from . import cpu as M

    if padded:
        M.permute_padded(x, tok, out)
    elif w is None or M.weighted_ok(x, w, out):
        M.scatter_rows(x, rows, tok, w, out)
    else:  # 16-bit rows with weights: torch's implementation (see cpu.py)
        _scatter_rows_torch(x, rows, tok, w, out)


# gather rows: out[t] = sum_j w[t, j] * y[row_map[t, j]] (``padded``: y has padding rows, which no row_map entry
# names; the kernels read only the rows named, the torch provider needs to know that N < T*K no longer rules out
# drops)
@gather_rows.register("torch")
def _gather_rows_torch(y, rows, w, out, padded=False):
    try:  # torch checks every index before it reads (a bad one: an IndexError here, typed below)
        _gather_rows_torch_impl(y, rows, w, out, padded)
    except (IndexError, RuntimeError):
        if rows.numel() and int(rows.max()) >= y.shape[0]:
            raise out_of_range("moe_unpermute") from None
        raise


def _gather_rows_torch_impl(y, rows, w, out, padded=False):
    T, K = rows.shape
    if y.shape[0] == 0:  # no rows (a capacity of 0): every assignment dropped, every token zeros
        if rows.numel() and int(rows.max()) >= 0:
            raise out_of_range("moe_unpermute")
        out.zero_()
        return
    if K == 1 and w is None and y.shape[0] == T and not padded:  # no drops: a plain gather
        torch.index_select(y, 0, rows.view(-1), out=out)
        return
    drops = padded or y.shape[0] < T * K  # without drops every row index is valid and no mask is needed
    ww = torch.ones(rows.shape, dtype=torch.float32, device=y.device) if w is None else w
    # On the CPU, token blocks whose fp32 accumulator stays in cache (about 2 MiB), through reused
    # buffers: 10x faster than whole-tensor temporaries at T=16k, H=4096. On a GPU one block.
    H = y.shape[1]
    B = T if y.device.type != "cpu" else max(16, (1 << 21) // (4 * max(H, 1)))
    buf = torch.empty(min(B, T), H, dtype=y.dtype, device=y.device)
    acc = torch.empty(min(B, T), H, dtype=torch.float32, device=y.device)
    for t0 in range(0, T, B):
        r, wb = rows[t0 : t0 + B], ww[t0 : t0 + B]
        n = r.shape[0]
        v, a = buf[:n], acc[:n]
        for j in range(K):  # j = 0..K-1, in fp32, as the kernels do
            rj = r[:, j]
            torch.index_select(y, 0, rj.clamp(min=0) if drops else rj, out=v)
            if drops:  # dropped assignments add nothing (a 0 weight would still turn inf into NaN)
                v.masked_fill_((rj < 0)[:, None], 0)
            if j == 0:
                torch.mul(v, wb[:, 0:1], out=a)
            else:
                a.addcmul_(v, wb[:, j : j + 1])
        out[t0 : t0 + n].copy_(a)


@gather_rows.register("triton")
def _gather_rows_triton(y, rows, w, out, padded=False):
    import triton

    from . import triton as kt

    T, K = rows.shape
    H = out.shape[1]
    BH = _row_block(T, H)
    kt._unpermute_kernel[(T, triton.cdiv(H, BH))](y, rows, w if w is not None else rows, out, H, y.shape[0], K=K,
                                                   BLOCK_H=BH, HAS_W=w is not None,
                                                   num_warps=ROW_WARPS)  # fmt: skip


@gather_rows.register("numba")
def _gather_rows_numba(y, rows, w, out, padded=False):
    from . import numba as M

    M.gather_rows(y, rows, w, out)


@gather_rows.register("cpu")
def _gather_rows_cpu(y, rows, w, out, padded=False):
    from . import cpu as M

    if M.weighted_ok(y, w, out):
        M.gather_rows(y, rows, w, out)
    else:  # 16-bit rows: torch's implementation (see cpu.py)
        _gather_rows_torch(y, rows, w, out, padded)


# unpermute backward: grad_y_perm rows and grad_w [T, K] fp32
@gather_rows_bwd.register("torch")
def _gather_rows_bwd_torch(gy, y, rows, w, gyp):
    _scatter_rows_torch(gy, rows, None, w, gyp)
    ok = rows >= 0
    gw = torch.zeros(rows.shape, dtype=torch.float32, device=gy.device)
    if y.shape[0] == 0:  # no rows: every assignment dropped, no weight gradient
        return gw
    for j in range(rows.shape[1]):
        yj = y.index_select(0, rows[:, j].clamp(min=0)).float()
        gw[:, j] = torch.where(ok[:, j], (gy.float() * yj).sum(1), 0.0)
    return gw


@gather_rows_bwd.register("triton")
def _gather_rows_bwd_triton(gy, y, rows, w, gyp):
    from . import triton as kt

    T, K = rows.shape
    H = gy.shape[1]
    gw = torch.empty(T, K, dtype=torch.float32, device=gy.device)
    if T:
        kt._unpermute_bwd_kernel[(T,)](gy, y, rows, w, gyp, gw, H, y.shape[0], K=K, KP=max(2, _pow2(K)),
                                       BLOCK_H=_block_h(H, BWD_BLOCK), num_warps=BWD_WARPS)  # fmt: skip
    return gw


@gather_rows_bwd.register("numba")
def _gather_rows_bwd_numba(gy, y, rows, w, gyp):
    from . import numba as M

    M.scatter_rows(gy, rows, w, gyp)
    return M.row_dots(gy, y, rows)


@gather_rows_bwd.register("cpu")
def _gather_rows_bwd_cpu(gy, y, rows, w, gyp):
    from . import cpu as M

    if M.weighted_ok(gy, y, w, gyp):
        return M.gather_rows_bwd(gy, y, rows, w, gyp)
    return _gather_rows_bwd_torch(gy, y, rows, w, gyp)  # 16-bit rows: torch's implementation
