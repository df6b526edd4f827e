"""The MoE family's custom ops (``torch.library``, namespace ``torsh``) with their fakes and autograd: the route
(``torsh::moe_route``), the permute and the unpermute with its backward, each dispatching to a provider of
:mod:`torsh_kernels.ops.moe.providers`. The public ops that validate and call them are in
:mod:`torsh_kernels.ops.moe.api`."""

from __future__ import annotations

import torch

from .. import eager
from ..common import as_count, on_device
from .checks import check_bias_finite, raise_nan_scores
from .providers import NO_CAP, POLICY, assign, gather_rows, gather_rows_bwd, scatter_rows, select, topk
from .reference import row_sums


@torch.library.custom_op("torsh::moe_route", mutates_args=())
def route_op(logits: torch.Tensor, k: int, score: str, renormalize: bool, score_bias: torch.Tensor | None,
              n_group: int, topk_group: int, scaling: float, capacity: int, drop_policy: str,
              sequence_lengths: list[int], sequence_capacity: list[int], padded_capacity: int, check_finite: bool,
              provider: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                      torch.Tensor]:  # fmt: skip
    """-> weights, indices, scores [T, K]; tokens_per_expert [E]; row_map [T, K]; token_index [N] (the
    differentiable output first). ``n_group`` = 0: no groups. ``score_bias``'s values are checked here (at
    run time, also under torch.compile), the rest by ``moe_route``. ``capacity``: the call's (clamped to
    T*K), -1 for none; ``sequence_lengths`` and ``sequence_capacity`` (each C_s clamped to L_s*K): the
    sequence scope, empty otherwise; ``padded_capacity`` >= 0: every expert's group padded to that many
    rows, -1 for no padding."""
    T, E = logits.shape
    if score_bias is not None:
        check_bias_finite(score_bias)
    if T == 0:
        i = torch.empty(0, k, dtype=torch.int64, device=logits.device)
        f = torch.empty(0, k, dtype=torch.float32, device=logits.device)
        tok = i.new_empty(0) if padded_capacity < 0 else i.new_full((E * padded_capacity,), -1)
        return f, i, f.clone(), torch.zeros(E, dtype=torch.int64, device=logits.device), i.clone(), tok
    name = select(topk, logits, provider, k, E)
    with on_device(logits.device):
        idx, w, s, bad = topk(name, logits, k, score, renormalize, score_bias, n_group, topk_group, scaling)
        if check_finite and (b := as_count(bad)):
            raise_nan_scores(b, T)
        if sequence_lengths:
            seq = (tuple(sequence_lengths), tuple(sequence_capacity))
            rows, counts, tok = assign(name, idx, s, E, -1, POLICY[drop_policy], seq, padded_capacity)
        else:
            policy = NO_CAP if capacity < 0 else POLICY[drop_policy]
            if padded_capacity < 0:
                rows, counts, tok = assign(name, idx, s, E, capacity, policy)
            else:
                rows, counts, tok = assign(name, idx, s, E, capacity, policy, None, padded_capacity)
    return w, idx, s, counts, rows.view(T, k), tok


@route_op.register_fake
def _(logits, k, score, renormalize, score_bias, n_group, topk_group, scaling, capacity, drop_policy,
      sequence_lengths, sequence_capacity, padded_capacity, check_finite, provider):  # fmt: skip
    T, E = logits.shape
    if padded_capacity >= 0:  # padded: N = E * capacity, whatever the values
        n = E * padded_capacity
    elif capacity < 0 and not sequence_lengths:
        n = T * k
    else:
        n = torch.library.get_ctx().new_dynamic_size()
    i64, f32 = torch.int64, torch.float32
    tk = logits.new_empty(T, k, dtype=i64)
    w = logits.new_empty(T, k, dtype=f32)
    counts, tok = logits.new_empty(E, dtype=i64), logits.new_empty(n, dtype=i64)
    return w, tk, torch.empty_like(w), counts, torch.empty_like(tk), tok


def _route_setup(ctx, inputs, output):
    logits, _k, score, renormalize, _bias, _ng, _tg, scaling, *_ = inputs
    w, idx, s, *_ = output
    ctx.score, ctx.renormalize, ctx.scaling = score, renormalize, scaling
    ctx.logits_dtype = logits.dtype
    ctx.E = logits.shape[1]
    ctx.mark_non_differentiable(s)  # Routing.scores is informational; gradients flow through the weights
    ctx.save_for_backward(logits if (score == "softmax" and not renormalize) else None, idx, w, s)


def _route_backward(ctx, g_w, g_idx, g_s, g_counts, g_rows, g_tok):
    """d loss / d logits from d loss / d weights (T x E elementwise work; the same for every provider). The
    weights are ``c * u`` with ``c`` the scaling and ``u`` the (renormalised) chosen scores; the bias only
    chose the experts and gets no gradient."""
    logits, idx, w, s = ctx.saved_tensors
    T = idx.shape[0]
    c = ctx.scaling
    g = torch.zeros_like(w) if g_w is None else g_w.float()
    grad = torch.zeros(T, ctx.E, dtype=torch.float32, device=idx.device)
    if ctx.score == "softmax":
        if ctx.renormalize:  # u = softmax over the chosen logits: d/dl_j = c u_j (g_j - sum_i u_i g_i)
            wg = (w * g).sum(1, keepdim=True)
            grad.scatter_(1, idx, w * (g - (wg if c == 1.0 else wg / c)))
        else:  # w_j = c p[idx_j] with p the full softmax: d p_a / d l = p_a (onehot_a - p)
            if c != 1.0:
                g = g * c
            p = torch.softmax(logits.float(), dim=-1)
            G = torch.zeros_like(grad).scatter_(1, idx, g)
            grad = p * (G - (s * g).sum(1, keepdim=True))
    else:  # u = s / sum(s) (or s), s = sigmoid(l): d s / d l = s (1 - s)
        if ctx.renormalize:  # d/ds_j = (c g_j - sum_i w_i g_i) / sum(s) (1 for a sum of 0: see row_sums)
            gs = ((g if c == 1.0 else g * c) - (w * g).sum(1, keepdim=True)) / row_sums(s)
        else:
            gs = g if c == 1.0 else g * c
        grad.scatter_(1, idx, gs * s * (1.0 - s))
    return grad.to(ctx.logits_dtype), *([None] * 14)


torch.library.register_autograd("torsh::moe_route", _route_backward, setup_context=_route_setup)


@torch.library.custom_op("torsh::moe_permute", mutates_args=())
def permute_op(x: torch.Tensor, row_map: torch.Tensor, token_index: torch.Tensor, provider: str,
                padded: bool = False) -> torch.Tensor:  # fmt: skip
    """``padded``: the routing's groups are padded (token_index -1 at the padding rows, written as zeros)."""
    out = x.new_empty(token_index.shape[0], x.shape[1])
    if out.numel():
        name = select(scatter_rows, x, provider, row_map.shape[1])
        with on_device(x.device):
            if padded:
                scatter_rows(name, x, row_map, token_index, None, out, True)
            else:
                scatter_rows(name, x, row_map, token_index, None, out)
    return out


@permute_op.register_fake
def _(x, row_map, token_index, provider, padded=False):
    return x.new_empty(token_index.shape[0], x.shape[1])


def _permute_setup(ctx, inputs, output):
    _, row_map, token_index, provider, *rest = inputs
    ctx.save_for_backward(row_map, token_index)
    ctx.provider, ctx.padded = provider, bool(rest and rest[0])


def _permute_backward(ctx, g):
    """The sum of each token's rows (the padding rows' gradient goes nowhere: no token came from them)."""
    row_map, token_index = ctx.saved_tensors
    gx = eager.call_autograd(unpermute_op, g.contiguous(), row_map, token_index, None, ctx.provider, ctx.padded)
    return gx, None, None, None, None


torch.library.register_autograd("torsh::moe_permute", _permute_backward, setup_context=_permute_setup)


@torch.library.custom_op("torsh::moe_unpermute", mutates_args=())
def unpermute_op(y_perm: torch.Tensor, row_map: torch.Tensor, token_index: torch.Tensor, weights: torch.Tensor | None,
                  provider: str, padded: bool = False) -> torch.Tensor:  # fmt: skip
    """``padded``: y_perm has padding rows (no row_map entry names them; they are not read)."""
    T = row_map.shape[0]
    out = y_perm.new_empty(T, y_perm.shape[1])
    if T and y_perm.shape[1]:
        name = select(gather_rows, y_perm, provider, row_map.shape[1])
        with on_device(y_perm.device):
            if padded:
                gather_rows(name, y_perm, row_map, weights, out, True)
            else:
                gather_rows(name, y_perm, row_map, weights, out)
    return out


@unpermute_op.register_fake
def _(y_perm, row_map, token_index, weights, provider, padded=False):
    return y_perm.new_empty(row_map.shape[0], y_perm.shape[1])


@torch.library.custom_op("torsh::moe_unpermute_backward", mutates_args=())
def _unpermute_bwd_op(grad_y: torch.Tensor, y_perm: torch.Tensor, row_map: torch.Tensor, weights: torch.Tensor,
                      provider: str, padded: bool = False) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``padded``: the gradient of y_perm's padding rows (which no assignment read) is zero."""
    gyp = torch.zeros_like(y_perm) if padded else torch.empty_like(y_perm)
    if row_map.shape[0] == 0 or y_perm.shape[1] == 0:
        return gyp.zero_(), torch.zeros(row_map.shape, dtype=torch.float32, device=y_perm.device)
    name = select(gather_rows_bwd, y_perm, provider, row_map.shape[1])
    with on_device(y_perm.device):
        gw = gather_rows_bwd(name, grad_y, y_perm, row_map, weights, gyp)
    return gyp, gw


@_unpermute_bwd_op.register_fake
def _(grad_y, y_perm, row_map, weights, provider, padded=False):
    return torch.empty_like(y_perm), weights.new_empty(row_map.shape, dtype=torch.float32)


def _unpermute_setup(ctx, inputs, output):
    y_perm, row_map, token_index, weights, provider, *rest = inputs
    ctx.save_for_backward(y_perm, row_map, token_index, weights)
    ctx.provider, ctx.padded = provider, bool(rest and rest[0])


def _unpermute_backward(ctx, g):
    y_perm, row_map, token_index, weights = ctx.saved_tensors
    g = g.contiguous()
    p, padded = ctx.provider, ctx.padded
    if weights is None:
        return eager.call_autograd(permute_op, g, row_map, token_index, p, padded), None, None, None, None, None
    if torch.is_grad_enabled():  # a double backward: the registered op (it has no autograd of its own)
        gyp, gw = _unpermute_bwd_op(g, y_perm, row_map, weights, p, padded)
    else:
        gyp, gw = eager.call(_unpermute_bwd_op, (), g, y_perm, row_map, weights, p, padded)
    return gyp, None, None, gw if ctx.needs_input_grad[3] else None, None, None


torch.library.register_autograd("torsh::moe_unpermute", _unpermute_backward, setup_context=_unpermute_setup)
