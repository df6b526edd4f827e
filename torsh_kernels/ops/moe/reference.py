"""The MoE family's torch references (differentiable; the oracles of the tests and the torch provider's core):
``moe_route_ref``, ``moe_permute_ref``, ``moe_unpermute_ref``, ``moe_aux_loss_ref``, ``moe_z_loss_ref``. The ops are in
:mod:`torsh_kernels.ops.moe.api`."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

import torch

from ...checks import check_choice
from ...errors import (
    ArgumentTypeError,
    InvalidArgumentError,
    ShapeError,
)
from .router import RouterSpec
from .routing import Routing, plan_capacity


def scores_ref(logits: torch.Tensor, score: str) -> torch.Tensor:
    x = logits.float()
    return torch.softmax(x, dim=-1) if score == "softmax" else torch.sigmoid(x)


def selection_keys(
    p: torch.Tensor, bias: torch.Tensor | None = None, n_group: int = 0, topk_group: int = 0
) -> torch.Tensor:
    """The fp64 keys [T, E] the K experts are the highest of (equal keys: the lower expert), for scores ``p``
    [T, E] (fp32; see the module docstring): ``p + bias`` added in fp32, then, below every fp32 value, the NaN
    scores (-1e300), then (-inf) the experts of the groups left out of the ``topk_group`` best of ``n_group``
    (0: no groups), which are never chosen."""
    T, E = p.shape
    key = p.detach() if bias is None else p.detach() + bias.detach()  # [T, E] fp32
    nan = torch.isnan(key)
    key = key.masked_fill(nan, -math.inf)  # (as -inf in the group scores)
    key64 = key.double().masked_fill(nan, -1e300)
    if n_group:
        G, size = n_group, E // n_group
        grp = key.view(T, G, size)
        m1, i1 = grp.max(-1, keepdim=True)  # the group's highest key, then its second (fp32 sum)
        group = (m1 + grp.scatter(-1, i1, -math.inf).amax(-1, keepdim=True) if size > 1 else m1).squeeze(-1)  # [T, G]
        # kept: fewer than topk_group groups rank above it (a higher score, or an equal one and a lower index)
        ar = torch.arange(G, device=p.device)
        a, g = group[:, None, :], group[:, :, None]  # [T, 1, G] the others h, [T, G, 1] the group g
        above = ((a > g) | ((a == g) & (ar[None, :] < ar[:, None]))).sum(-1)  # [T, G]
        key64.view(T, G, size).masked_fill_((above >= topk_group)[:, :, None], -math.inf)
    return key64


def choose_ref(
    p: torch.Tensor, k: int, bias: torch.Tensor | None = None, n_group: int = 0, topk_group: int = 0
) -> torch.Tensor:
    """The K chosen experts [T, K] of scores ``p`` [T, E]: the K highest selection keys, by a stable sort."""
    key64 = selection_keys(p, bias, n_group, topk_group)
    return torch.sort(key64, dim=1, descending=True, stable=True).indices[:, :k].contiguous()  # ties: lower expert


def row_sums(s: torch.Tensor) -> torch.Tensor:
    """The renormalisation's divisor of each token: the sum of its chosen scores, or 1 where that sum is 0 (every
    chosen sigmoid score underflowed: logits below about -88 in fp32), so that such a token's weights stay 0 on
    every provider instead of 0/0 = NaN (the Triton and Numba kernels divide by the same)."""
    tot = s.sum(1, keepdim=True)
    return torch.where(tot != 0, tot, 1.0)


def renormalized(s: torch.Tensor) -> torch.Tensor:
    """The chosen scores ``s`` [T, K] divided by :func:`row_sums`: weights that sum to 1 per token, or 0 where
    every chosen score is 0."""
    return s / row_sums(s)


def moe_route_ref(
    logits: torch.Tensor,
    spec: RouterSpec | None = None,
    *,
    score_bias: torch.Tensor | None = None,
    sequence_lengths: Sequence[int] | torch.Tensor | None = None,
    **options: Any,
) -> Routing:
    """Plain PyTorch routing (see the module docstring), with ``spec`` (or its fields as keywords) as
    :func:`moe_route` takes them; ``weights`` is differentiable by autograd (in the logits; never in
    ``score_bias``). The selection's fit to E is taken as valid (``moe_route`` checks it); the capacity options
    are checked as :func:`moe_route` checks them."""
    if options or spec is None or type(spec) is not RouterSpec:
        spec = RouterSpec.build(spec, options, "torsh_kernels.moe_route_ref")
    T, E = logits.shape
    k = spec.k
    plan = plan_capacity("torsh_kernels.moe_route_ref", T, E, spec, sequence_lengths, logits.device)
    p = scores_ref(logits, spec.score)  # [T, E] fp32
    indices = choose_ref(p, k, score_bias, spec.n_group or 0, spec.topk_group or 0)  # [T, K]
    scores = p.gather(1, indices)  # [T, K]
    weights = renormalized(scores) if spec.renormalize else scores
    if spec.scaling != 1.0:
        weights = weights * spec.scaling
    flat = indices.reshape(-1)  # [T*K] token-major
    onehot = torch.nn.functional.one_hot(flat, E)  # [T*K, E]
    keep = (
        _kept_ref(flat, onehot, scores, plan, k, spec.drop_policy)
        if plan.limited
        else torch.ones_like(flat, dtype=torch.bool)
    )
    rows, token_index, n = _rows_ref(flat, onehot, keep, plan, k, E)
    return Routing(
        indices=indices, weights=weights, scores=scores, tokens_per_expert=(onehot * keep[:, None]).sum(0),
        row_map=rows.view(T, k), token_index=token_index, dropped=~keep.view(T, k), num_experts=E, num_rows=n,
        capacity=plan.capacity, score=spec.score, sequence_lengths=plan.sequence_lengths,
        sequence_capacity=plan.sequence_capacity, padded=plan.padded_capacity >= 0,
        selection_options=score_bias is not None or bool(spec.n_group),
    )  # fmt: skip


def _kept_ref(flat, onehot, scores, plan, k: int, drop_policy: str) -> torch.Tensor:
    """[T*K] bool: the assignments their expert keeps under the capacity, per span it applies to (the call, or
    each sequence): those ranking below the capacity among their expert's, by the policy's order."""
    T = flat.numel() // k
    if plan.sequence_lengths is None:
        spans = [(0, T, plan.kernel_capacity)]  # (first token, end, capacity)
    else:
        ends = itertools.accumulate(plan.sequence_lengths)
        spans = [(e - n, e, c) for e, n, c in zip(ends, plan.sequence_lengths, plan.kernel_sequence_capacity)]
    keep = torch.ones_like(flat, dtype=torch.bool)
    s_all = torch.nan_to_num(scores.detach().reshape(-1), nan=-1.0)
    for a, b, c in spans:
        sl = slice(a * k, b * k)
        fl, oh = flat[sl], onehot[sl]
        if drop_policy == "position":
            order_a = torch.arange(fl.numel(), device=flat.device)
        else:  # highest score first; equal scores: lower token first (stable sort)
            order_a = torch.sort(s_all[sl], descending=True, stable=True).indices
        rank_sorted = (torch.cumsum(oh[order_a], 0) - 1).gather(1, fl[order_a, None]).squeeze(1)
        rank = torch.empty_like(rank_sorted)
        rank[order_a] = rank_sorted
        keep[sl] = rank < c
    return keep


def _rows_ref(flat, onehot, keep, plan, k: int, E: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(row of each assignment [T*K], -1 where dropped; token of each permuted row [N]; N): rows grouped by
    expert, token order inside each group; padded: expert e's group is rows [e * C, (e + 1) * C), kept first."""
    dev = flat.device
    kept = onehot * keep[:, None]
    counts = kept.sum(0)  # [E]
    pos = (torch.cumsum(kept, 0) - 1).gather(1, flat[:, None]).squeeze(1)
    if plan.padded_capacity >= 0:
        C = plan.padded_capacity
        rows = torch.where(keep, flat * C + pos, -1)
        n = E * C
        token_index = torch.full((n,), -1, dtype=torch.int64, device=dev)
        token_index[rows[keep]] = torch.arange(flat.numel(), device=dev)[keep] // k
        return rows, token_index, n
    starts = torch.cumsum(counts, 0) - counts
    rows = torch.where(keep, starts[flat] + pos, -1)
    if not plan.limited:  # every assignment kept: N = T * K, known without reading the counts
        n = flat.numel()
        token_index = torch.empty(n, dtype=torch.int64, device=dev)
        token_index[rows] = torch.arange(n, device=dev) // k
        return rows, token_index, n
    n = int(counts.sum())
    token_index = torch.empty(n, dtype=torch.int64, device=dev)
    token_index[rows[keep]] = torch.arange(flat.numel(), device=dev)[keep] // k
    return rows, token_index, n


def moe_permute_ref(x: torch.Tensor, routing: Routing) -> torch.Tensor:
    """x[token_index]: the rows of each token at its assignments' rows (zero rows where padded)."""
    if routing.padded:
        ti = routing.token_index
        return torch.where((ti >= 0)[:, None], x[ti.clamp(min=0)] if x.shape[0] else x.new_zeros(1, x.shape[1]), 0)
    return x[routing.token_index]


def moe_unpermute_ref(y_perm: torch.Tensor, routing: Routing, *, weights: bool = True) -> torch.Tensor:
    """sum_j weights[t, j] * y_perm[row_map[t, j]] over kept assignments, in fp32, cast to y's dtype."""
    T, K = routing.row_map.shape
    rows = routing.row_map
    out = torch.zeros(T, y_perm.shape[1], dtype=torch.float32, device=y_perm.device)
    src = y_perm if y_perm.shape[0] else y_perm.new_zeros(1, y_perm.shape[1])  # (no rows: every assignment dropped)
    for j in range(K):
        ok = rows[:, j] >= 0
        v = src[rows[:, j].clamp(min=0)].float()
        if weights:
            v = v * routing.weights[:, j : j + 1]
        out = out + torch.where(ok[:, None], v, 0.0)
    return out.to(y_perm.dtype)


AUX_SCALES = ("balanced-one", "hf")
AUX_COUNTS = ("topk", "routed")
"""``moe_aux_loss(count=)``: which selection ``c_ge`` counts. "topk" (the default): each token's K highest unbiased
scores, Megatron-Core's rule (``compute_routing_scores_for_aux_loss``: a plain top-K of the scores, without the
expert bias and the group limit) and DeepSeek-V3's (eq. 18 of its paper); "routed": ``routing.indices``, the
experts the routing chose (with a ``score_bias`` or groups, the biased, group-limited selection)."""


def check_groups(groups: object, T: int, what: str) -> int | tuple[int, ...] | None:
    """``groups=`` of the aux loss, checked against the T tokens: None, the group size S (an int dividing
    T) or the tuple of the non-empty group lengths (ints >= 0 summing to T; the empty groups, which have no
    tokens to balance, are left out of the mean)."""
    if groups is None:
        return None
    if isinstance(groups, bool) or not isinstance(groups, (int, list, tuple)):
        hint = " (a tensor of lengths: pass lengths.tolist())" if isinstance(groups, torch.Tensor) else ""
        raise ArgumentTypeError(
            f"{what}: groups must be None, an int group size or a list/tuple of group lengths, got "
            f"{type(groups).__name__}{hint}"
        )
    if isinstance(groups, int):
        if groups < 1:
            raise InvalidArgumentError(f"{what}: groups={groups}; a group size must be >= 1")
        if T % groups:
            raise ShapeError(
                f"{what}: the group size groups={groups} does not divide the T={T} tokens; pass the group "
                "lengths as a list instead"
            )
        return groups
    lengths = tuple(groups)
    for i, n in enumerate(lengths):
        if isinstance(n, bool) or not isinstance(n, int):
            raise ArgumentTypeError(f"{what}: groups[{i}] must be an int length, got {type(n).__name__} {n!r}")
        if n < 0:
            raise InvalidArgumentError(f"{what}: groups[{i}]={n}; a group length must be >= 0")
    if sum(lengths) != T:
        raise ShapeError(f"{what}: the group lengths sum to {sum(lengths)}, the routing has T={T} tokens")
    return lengths if all(lengths) else tuple(n for n in lengths if n)


def _num_groups(groups: int | tuple[int, ...] | None, T: int) -> int:
    return 1 if groups is None else T // groups if isinstance(groups, int) else len(groups)


def aux_probs(x: torch.Tensor, routing: Routing, from_probs: bool) -> torch.Tensor:
    """[T, E] fp32 probabilities of the aux loss (see the module docstring)."""
    if from_probs:
        return x.float()
    if routing.score == "softmax":
        return torch.softmax(x.float(), dim=-1)
    s = torch.sigmoid(x.float())
    return s / s.sum(-1, keepdim=True)


def aux_counted_indices_ref(p: torch.Tensor, routing: Routing, count: str = "topk") -> torch.Tensor:
    """[T, K]: the experts the aux loss counts (see :data:`AUX_COUNTS`), from the aux loss's probabilities ``p``
    (their top-K ranks the experts as the scores do): ``routing.indices`` unless ``count="topk"`` and a selection
    option chose them (``routing.selection_options``)."""
    if count == "routed" or not routing.selection_options:
        return routing.indices
    return choose_ref(p, routing.k).to(routing.indices.device)


def moe_aux_loss_ref(
    logits_or_probs: torch.Tensor,
    routing: Routing,
    *,
    from_probs: bool = False,
    scale: str = "balanced-one",
    groups: int | Sequence[int] | None = None,
    count: str = "topk",
) -> torch.Tensor:
    """The mean over groups of E * sum_e f_ge * P_ge (see the module docstring), in plain torch; ``count``: which
    selection ``f`` counts (:data:`AUX_COUNTS`)."""
    what = "torsh_kernels.moe_aux_loss_ref"
    K, T = routing.k, routing.num_tokens
    kf = K if check_choice(scale, what, "scale", AUX_SCALES) == "balanced-one" else 1
    groups = check_groups(groups, T, what)
    p = aux_probs(logits_or_probs, routing, from_probs)
    idx = aux_counted_indices_ref(p, routing, check_choice(count, what, "count", AUX_COUNTS))
    return aux_loss_of(p, idx, routing.num_experts, kf, groups)


def aux_loss_of(
    p: torch.Tensor, idx: torch.Tensor, E: int, kf: int, groups: int | tuple[int, ...] | None
) -> torch.Tensor:
    """The aux loss of probabilities ``p`` [T, E] and counted experts ``idx`` [T, K] (checked ``groups``; ``kf``: K
    or 1, the scale), in plain torch."""
    T = idx.shape[0]
    if T == 0:  # no tokens: no imbalance (a mean over no tokens would be NaN and spoil the summed loss)
        return (p.sum() * 0.0).reshape(())
    if groups is None:  # (a count per expert of static shape [E]: bincount's size depends on the data)
        flat = idx.reshape(-1)
        f = torch.zeros(E, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat)).float()
        return E * (f / (T * kf) * p.mean(0)).sum()
    G = _num_groups(groups, T)
    dev = idx.device
    if isinstance(groups, int):  # G groups of S tokens
        gid = torch.arange(T, device=dev) // groups
        psum = p.view(G, groups, E).sum(1)  # [G, E]
        sizes = torch.full((G,), float(groups), device=p.device)
    else:
        lengths = torch.tensor(groups)
        gid = torch.repeat_interleave(torch.arange(G), lengths).to(dev)
        psum = p.new_zeros(G, E).index_add(0, gid.to(p.device), p)
        sizes = lengths.to(device=p.device, dtype=torch.float32)
    key = (gid[:, None] * E + idx).reshape(-1)  # [T*K]: group-major expert slot
    counts = torch.zeros(G * E, dtype=torch.int64, device=dev).scatter_add_(0, key, torch.ones_like(key))
    per_group = (counts.view(G, E).float() * psum).sum(1) / sizes.square()  # [G]
    return (E / (kf * G)) * per_group.sum()


def moe_z_loss_ref(logits: torch.Tensor) -> torch.Tensor:
    """mean over tokens of logsumexp(logits[t])**2, in fp32 (0 for no tokens)."""
    if logits.shape[0] == 0:  # (a mean over no tokens would be NaN and spoil the summed loss)
        return (logits.float().sum() * 0.0).reshape(())
    return torch.logsumexp(logits.float(), dim=-1).square().mean()
