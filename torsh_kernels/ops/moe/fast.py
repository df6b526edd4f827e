"""The MoE family's CPU fast paths: what ``api.py``'s public ops compute for their common case on plain contiguous
CPU tensors, straight from their arguments (no flattening, no custom op): the cpu provider's route in one kernel
call, the torch provider's route for small k, the cpu provider's permute and unpermute into new tensors. Each gives
the results of the path it stands in for (the same kernels or torch calls on the same elements); the public op
tests its own conditions (dtypes, layout, options, the chosen provider: ``eager.picks``) before calling here."""

from __future__ import annotations

import torch

from .. import eager
from .checks import check_bias, check_bias_finite, raise_nan_scores
from .custom import route_op
from .providers import NO_CAP, POLICY
from .reference import renormalized
from .router import RouterSpec
from .routing import Routing, expert_capacity, out_of_range, seal

__all__ = ["gather_cpu", "permute_cpu_impl", "route_cpu", "route_torch", "unpermute_cpu_impl"]

ROUTE = "torsh_kernels.moe_route"

_BOOL = torch.bool
_I64 = torch.int64
_cpu_kernels = eager.lazy_module("moe.cpu")  # the cpu provider's kernels


def route_cpu(logits: torch.Tensor, spec: RouterSpec, score_bias: torch.Tensor | None, provider: str | None, T: int,
              E: int) -> Routing:  # fmt: skip
    """The cpu provider's route on fp32 contiguous CPU logits (the call scope, no fixed capacity, no padding; the
    caller checked ``k <= E``) in one kernel call; with a gradient needed, as the forward of the op's registered
    autograd."""
    k, score = spec.k, spec.score
    G, TG = spec.selection(E, ROUTE) if spec.grouped else (0, 0)  # (no lookup without groups: k <= E is checked)
    bias = None if score_bias is None else check_bias(score_bias, logits, ROUTE)
    cf = spec.capacity_factor
    cap = -1 if cf is None else expert_capacity(T, k, E, cf)
    if logits.requires_grad and torch.is_grad_enabled():
        w, idx, s, counts, rows, tok = eager.autograd_fast(
            route_op, _route_cpu_impl, logits, k, score, spec.renormalize, bias, G, TG, spec.scaling, cap,
            spec.drop_policy, (), (), -1, spec.check_finite, provider or "",
        )  # fmt: skip
        dropped, n = rows < 0, tok.shape[0]
    else:
        w, idx, s, counts, rows, tok, dropped, n = _route_cpu(logits, T, E, k, score, spec.renormalize, bias, G, TG,
                                                              spec.scaling, cap, spec.drop_policy,
                                                              spec.check_finite)  # fmt: skip
    return seal(Routing(indices=idx, weights=w, scores=s.detach(), tokens_per_expert=counts, row_map=rows,
                        token_index=tok, dropped=dropped, num_experts=E, num_rows=n,
                        capacity=None if cap < 0 else cap, score=score,
                        selection_options=bias is not None or G > 0))  # fmt: skip


def _route_cpu(logits, T, E, k, score, renorm, bias, G, TG, c, cap, drop_policy, check_finite):
    """The cpu provider's route in one kernel call on fp32 contiguous CPU logits (and bias): (w, idx, s, counts,
    rows, tok, dropped, N)."""
    M = _cpu_kernels()
    if bias is not None:
        check_bias_finite(bias)
    idx, w, s = torch.empty(T, k, dtype=_I64), torch.empty(T, k), torch.empty(T, k)
    rows = torch.empty(T, k, dtype=_I64)
    counts, tok, dropped = torch.empty(E, dtype=_I64), torch.empty(T * k, dtype=_I64), torch.empty(T, k, dtype=_BOOL)
    x, mode = M.scores_for_kernel(logits, score)
    policy = NO_CAP if cap < 0 else POLICY[drop_policy]
    if bias is None and not G and c == 1.0:
        bad, n = M.route_ptr(x.data_ptr(), T, E, k, mode, renorm, cap, policy, idx.data_ptr(), w.data_ptr(),
                             s.data_ptr(), rows.data_ptr(), counts.data_ptr(), tok.data_ptr(),
                             dropped.data_ptr())  # fmt: skip
    else:
        bad, n = M.route_select_ptr(x.data_ptr(), T, E, k, mode, renorm, 0 if bias is None else bias.data_ptr(),
                                    bias is not None, G, TG, c, cap, policy, idx.data_ptr(), w.data_ptr(), s.data_ptr(),
                                    rows.data_ptr(), counts.data_ptr(), tok.data_ptr(), dropped.data_ptr())  # fmt: skip
    if bad and check_finite:
        raise_nan_scores(bad, T)
    return w, idx, s, counts, rows, tok if n == T * k else tok[:n], dropped, n


def _route_cpu_impl(logits, k, score, renormalize, score_bias, n_group, topk_group, scaling, capacity, drop_policy,
                    sequence_lengths, sequence_capacity, padded_capacity, check_finite, provider):  # fmt: skip
    """:func:`_route_cpu` with the custom op's signature and outputs (the forward of its autograd; the call
    scope without padding, the fast path's case)."""
    T, E = logits.shape
    return _route_cpu(logits, T, E, k, score, renormalize, score_bias, n_group, topk_group, scaling, capacity,
                      drop_policy, check_finite)[:6]  # fmt: skip


_ARANGE: dict[int, torch.Tensor] = {}  # CPU 0..n-1 per n, for the fast path (read only, never returned)


def _arange(n: int) -> torch.Tensor:
    a = _ARANGE.get(n)
    if a is None:
        if len(_ARANGE) > 64:
            _ARANGE.clear()
        a = _ARANGE[n] = torch.arange(n)
    return a


def route_torch(logits: torch.Tensor, T: int, E: int, k: int, score: str, renorm: bool) -> Routing | None:
    """moe_route's torch provider for fp32 CPU logits, k <= 8, no capacity limit, when no score is NaN
    (else None: the general path counts and reports them, or routes them with check_finite=False). The
    same operations with the NaN masking left out (it replaces nothing when nothing is NaN), the first
    argmax taken on the scores themselves, the last round's scatter skipped (its result is never read) and
    the row map written by scatter_ (rows[order] = 0..n-1). Run under no-grad (``eager.run``)."""
    x = logits
    p = torch.softmax(x, dim=-1) if score == "softmax" else torch.sigmoid(x)
    total = p.sum().item()
    if total != total:  # NaN somewhere (scores are in [0, 1] or NaN: no overflow)
        return None
    i = p.argmax(1, keepdim=True)
    if k == 1:
        idx = i
    else:
        cols = [i]
        sel = p.scatter(1, i, -3.0)
        for j in range(1, k):
            i = sel.argmax(1, keepdim=True)
            cols.append(i)
            if j + 1 < k:
                sel.scatter_(1, i, -3.0)
        idx = torch.cat(cols, 1)
    s = p.gather(1, idx)
    w = renormalized(s) if renorm else s.clone()
    flat = idx.view(-1)
    n = T * k
    order = torch.sort(flat, stable=True).indices
    counts = torch.bincount(flat, minlength=E)
    rows = torch.empty(n, dtype=_I64).scatter_(0, order, _arange(n)).view(T, k)
    tok = torch.floor_divide(order, k)  # (order // k without the Python-level operator wrapper)
    return seal(Routing(indices=idx, weights=w, scores=s, tokens_per_expert=counts, row_map=rows, token_index=tok,
                        dropped=rows < 0, num_experts=E, num_rows=n, capacity=None, score=score))  # fmt: skip


def permute_cpu_impl(x, row_map, token_index, provider, padded=False):
    """The cpu provider's permute on plain contiguous CPU rows (the custom op's signature and output)."""
    out = x.new_empty(token_index.shape[0], x.shape[1])
    _cpu_kernels().scatter_rows(x, row_map, token_index, None, out)
    return out


def gather_cpu(y_perm: torch.Tensor, rows: torch.Tensor, w: torch.Tensor | None) -> torch.Tensor | None:
    """The cpu provider's unpermute kernel into a new [T, H] tensor, from fp32 contiguous CPU rows ``y_perm`` [N, H],
    int64 contiguous ``rows`` [T, K] and fp32 contiguous weights [T, K] (None: unweighted); None (nothing written)
    when a row index is outside [0, N)."""
    T, K = rows.shape
    out = torch.empty(T, y_perm.shape[1])
    if _cpu_kernels().gather_rows_ptr(y_perm.data_ptr(), y_perm.shape[0], y_perm.shape[1], rows.data_ptr(), T, K,
                                      0 if w is None else w.data_ptr(), w is not None, out.data_ptr()):  # fmt: skip
        return out
    return None


def unpermute_cpu_impl(y_perm, row_map, token_index, weights, provider, padded=False):
    """:func:`gather_cpu` with the custom op's signature (the forward of its autograd)."""
    out = gather_cpu(y_perm, row_map, weights)
    if out is None:
        raise out_of_range("moe_unpermute")
    return out
