"""Mixture-of-experts routing ops: fused router top-k with capacity, permute and unpermute, router losses.

Shapes: ``# T tokens, E experts, K chosen per token, H hidden, N = T*K minus dropped assignments`` (padded:
``N = E * capacity``).

- ``moe_route(logits [T, E], spec, score_bias=, sequence_lengths=)`` -> :class:`Routing`. ``spec`` is a
  :class:`~torsh_kernels.ops.RouterSpec` (``k``, ``score``, ``renormalize``, ``n_group``, ``topk_group``,
  ``scaling``, ``capacity_factor``, ``capacity``, ``capacity_scope``, ``drop_policy``, ``pad_to_capacity``,
  ``check_finite``), or its fields given as keywords (``moe_route(logits, k=2)``).
  Scores are computed in fp32: ``softmax`` over the E logits, or ``sigmoid`` of each. The K experts of
  a token are its K highest scores, in descending order; equal scores go to the lower expert index
  (ties are deterministic and the same for every provider). ``weights`` are the chosen scores,
  divided by their sum when ``renormalize`` (for softmax this equals a softmax over the chosen logits),
  then multiplied by ``scaling`` (DeepSeek-V3's ``routed_scaling_factor``; 1.0 by default).
  *Selection options* (DeepSeek-V3's router; they change which experts are chosen, never the weights'
  formula): ``score_bias`` [E] fp32 is added to the scores for the selection only: the K experts are the
  K highest ``score + bias`` (added in fp32), in that order, while ``weights`` and ``scores`` come from the
  unbiased scores and no gradient reaches the bias (DeepSeek-V3's ``e_score_correction_bias``, updated
  outside the gradient). ``n_group`` / ``topk_group`` (grouped selection): the E experts form ``n_group``
  contiguous groups of ``E / n_group``; a group's score is the fp32 sum of its two highest biased scores
  (its one score when a group holds one expert); the ``topk_group`` highest-scoring groups are kept (equal
  group scores: the lower group); the K experts are the K highest biased scores inside the kept groups
  (the other experts are never chosen: ``k <= topk_group * E / n_group`` is required). A NaN score (see
  ``check_finite``) counts as -inf in the selection keys and the group scores: it ranks below every real
  score, and an expert of a kept group with a NaN score still ranks above every expert of a dropped group.
  *Capacity*: with ``capacity_factor`` set, each expert keeps at most
  ``C = ceil(T * K * capacity_factor / E)`` assignments (clamped to ``[1, T * K]``); with ``capacity`` (an
  int >= 0; not together with ``capacity_factor``) at most ``C = capacity`` (0 drops everything; more than
  T * K limits nothing). ``drop_policy="probability"`` keeps the C with the highest scores (equal scores:
  lower token first), ``"position"`` the first C in token order.
  ``capacity_scope="sequence"`` with ``sequence_lengths`` (L_s >= 0 summing to T, the tokens laid out
  sequence after sequence) applies the capacity per (sequence, expert) pair, as Switch Transformers does
  per group: sequence s keeps at most ``C_s = capacity`` or ``ceil(L_s * K * capacity_factor / E)``
  (clamped to ``[1, L_s * K]``; 0 for an empty sequence) assignments per expert, the policy ranking inside
  the pair; the rows stay grouped by expert, token order inside (sequence after sequence).
  ``routing.capacity`` is then ``sum_s C_s`` (an expert's most rows in the call), ``routing.sequence_capacity``
  the C_s. Dropped assignments keep their weight in ``weights`` (renormalisation happens before dropping) and
  are marked in ``dropped`` and by ``row_map == -1``; the unpermute ignores them, so a token whose every
  assignment was dropped comes back as zeros (the caller's residual connection carries it, as in
  Switch/GShard). Gradients reach ``logits`` through ``weights``.
  *Padding* (``pad_to_capacity=True``, which needs a capacity; Megatron's ``moe_pad_expert_input_to_capacity``):
  every expert's group of permuted rows is padded at its end with zero rows to ``routing.capacity`` rows, so
  ``N = E * capacity`` is known on the host from the shapes alone (no device read of the counts; meta
  tensors route too) and the permuted tensor is ``[E, capacity, H]`` viewed flat. ``tokens_per_expert``
  stays the kept counts (for losses and balancing); ``routing.rows_per_expert`` is the group sizes of the
  layout (``capacity`` for every expert; ``tokens_per_expert`` unpadded), for the expert GEMMs and the
  all-to-all splits; ``token_index`` is -1 at the padding rows and no ``row_map`` entry points there.
- ``moe_permute(x [T, H], routing)`` -> ``x_perm [N, H]``: rows grouped by expert in ascending expert
  order, token order kept inside each group; group sizes are ``routing.rows_per_expert``.
  Row ``routing.row_map[t, j]`` of the result is ``x[t]``; padding rows are exact zeros, and their
  gradient reaches no token.
- ``moe_unpermute(y_perm [N, H], routing)`` -> ``y [T, H]``:
  ``y[t] = sum_j weights[t, j] * y_perm[row_map[t, j]]`` over the kept assignments, accumulated in fp32
  in the order j = 0..K-1 and cast once to ``y_perm``'s dtype (``weights=False`` sums without weights).
  Padding rows are never read; their gradient is zero.
- ``moe_aux_loss(logits_or_probs, routing, scale=, groups=)``: the Switch/GShard load-balancing loss.
  The T tokens form G groups (``groups=None``: one group of all T; an int S: consecutive groups of S
  tokens, S dividing T; a list/tuple of lengths >= 0 summing to T: consecutive groups of those lengths,
  e.g. ``routing.sequence_lengths``; an empty group has no tokens to balance and is left out). In
  group g of S_g tokens, ``c_ge`` is the number of the group's assignments (``routing.indices``, K per
  token) that chose expert e, counted before capacity drops (the loss penalises the router's choices, and
  with a ``score_bias`` these are the biased selections, as DeepSeek-V3 counts them), and ``P_ge`` the mean
  over the group's tokens of e's probability, from ``logits_or_probs`` (softmax of the logits for a
  softmax routing; for sigmoid, each token's scores divided by their sum; ``from_probs=True``: the values
  as given). The loss is the mean over groups of ``E * sum_e f_ge * P_ge``, with
  ``f_ge = c_ge / (K * S_g)`` for ``scale="balanced-one"`` (the default: 1.0 when every expert gets the
  same share, whatever K) and ``f_ge = c_ge / S_g`` for ``scale="hf"`` (K times as large: Hugging Face's
  ``load_balancing_loss_func`` of Mixtral, Qwen2-MoE and OLMoE, without an attention mask, for G = 1;
  Switch Transformers' ``load_balancing_loss_func``, per group of ``[G, S, E]`` router probabilities, with
  groups=S). With ``groups`` the sequence lengths and the default scale it is DeepSeek-V3's
  sequence-wise balance loss (paper eq. 17-20, without its alpha) and Megatron-Core's ``seq_aux_loss``
  (averaged over sequences): per sequence ``E / (K * S) * c_e`` times the mean normalised score.
  A group is a run of consecutive rows of the [T, E] logits, as in Hugging Face's [batch, seq] flattening
  (in Megatron's [seq, batch] layout a sequence's rows are not consecutive: route [batch, seq] rows). No
  tokens (T = 0): 0. HF's masked form (``attention_mask``: the loss over the unmasked tokens) is not
  provided.
- ``moe_z_loss(logits)``: ``mean_t logsumexp(logits[t])**2`` (ST-MoE's router z-loss).

Providers: ``moe_route``, ``moe_permute`` and ``moe_unpermute`` (and their backward passes) have Triton,
Numba CUDA, cpu and torch implementations. The route runs three kernels: per token block, scoring and top-K
(also counting tokens whose probabilities are NaN; the bias, the group scores, the kept groups and the
scaling are computed there too, in registers); per expert (per (sequence, expert) pair in the sequence
scope), the count, the capacity threshold (a bisection over the fp32 score bits) and each kept assignment's
position in its group; per assignment, the final row (the group's start: the expert's earlier rows and,
per sequence, the earlier sequences' rows of that expert; padded, e * capacity) and its inverse (the token
of each row). The permute reads each token's row once and writes it to its K rows (padded: one pass over
the rows, each written once, from its token or as zeros); the unpermute reads the K rows of a token and
writes it once; the unpermute's backward writes the weighted gradient rows and the weight gradients in one
pass (padded: into a zeroed buffer).
The backward of the route (a few [T, E] elementwise operations) is plain torch for every provider. The two
losses are tiny next to the [T, H] traffic: the torch formula on every device (autograd differentiates it,
torch.compile fuses it) and, on CPU tensors, the cpu provider's kernels (one pass forward and one backward
over [T, E], every scale and grouping; see ``_moe_cpu.py``).

Integer outputs are int64. ``routing.num_rows`` (N) is a host integer: with a capacity and no padding it
costs one device-to-host copy of the expert counts, which the permute needs anyway to size its output;
padded, it is E * capacity and nothing is read. ``sequence_lengths`` given as a tensor is read on the host.

The kernels live in ``_moe_triton.py`` and ``_moe_numba.py`` (imported on a provider's first launch),
:class:`Routing` and the capacity rule in ``_moe_routing.py``.
"""

from __future__ import annotations

import itertools
import math
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from ..checks import check_choice
from ..errors import (
    ArgumentTypeError,
    DeviceMismatchError,
    DTypeError,
    InvalidArgumentError,
    NonFiniteError,
    ShapeError,
)
from . import _eager
from ._common import _check_strided, _check_tensor, _count, _on
from ._moe_routing import (
    _SEALED,
    Routing,
    check_routing,
    check_sequence_lengths,
    expert_capacity,
    out_of_range,
    plan_capacity,
    seal,
    sealed,
    sealed_rows,
)
from .registry import Op, check_provider
from .router import CAPACITY_SCOPES, DROP_POLICIES, SCORES, RouterSpec

__all__ = [
    "AUX_SCALES",
    "CAPACITY_SCOPES",
    "DROP_POLICIES",
    "SCORES",
    "RouterSpec",
    "Routing",
    "check_sequence_lengths",
    "expert_capacity",
    "moe_aux_loss",
    "moe_aux_loss_ref",
    "moe_permute",
    "moe_permute_ref",
    "moe_route",
    "moe_route_ref",
    "moe_unpermute",
    "moe_unpermute_ref",
    "moe_z_loss",
    "moe_z_loss_ref",
]

ACT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Above this many experts a token's scores no longer fit one kernel tile (the Triton kernel holds a
# [BLOCK_T, next_pow2(E)] tile in registers); the route then runs the torch path.
MAX_KERNEL_EXPERTS = 1024
# The kernels unroll the K choices of a token; beyond this many the torch path runs instead.
MAX_KERNEL_K = 32
# Codes the kernels take for the score function and the capacity policy.
_SOFTMAX, _SIGMOID = 0, 1
_NO_CAP, _CAP_POSITION, _CAP_PROBABILITY = 0, 1, 2


# --------------------------------------------------------------------------------------------------
# Validation


def _check_act_dtype(t: torch.Tensor, what: str, name: str) -> None:
    if t.dtype not in ACT_DTYPES:
        raise DTypeError(f"{what}: {name} has dtype {t.dtype}; expected float32, float16 or bfloat16")


def _check_logits(logits: object, what: str) -> torch.Tensor:
    logits = _check_tensor(logits, what, "logits")
    _check_act_dtype(logits, what, "logits")
    if logits.dim() != 2:
        raise ShapeError(
            f"{what}: logits must be [T, E] (tokens x experts), got shape {tuple(logits.shape)}; "
            "flatten the batch dimensions first (logits.reshape(-1, E))"
        )
    if logits.shape[1] < 1:
        raise ShapeError(f"{what}: logits has no experts (shape {tuple(logits.shape)})")
    return logits


def _check_routing(routing: object, what: str, reads: str) -> Routing:
    """A sealed Routing as it is (for the fields the caller ``reads``: see ``check_routing``); any other checked in
    full (values too, except while torch.compile traces)."""
    compiling = _is_compiling()
    if not compiling and type(routing) is Routing and _SEALED[reads](routing):
        return routing
    return check_routing(routing, what, values=not compiling, reads=reads)


_is_compiling = torch.compiler.is_compiling


def _check_rows(x: object, rows: int, routing: Routing, what: str, name: str, rows_name: str) -> torch.Tensor:
    x = _check_tensor(x, what, name)
    _check_act_dtype(x, what, name)
    if x.dim() != 2 or x.shape[0] != rows:
        raise ShapeError(f"{what}: {name} must be [{rows_name}={rows}, H] for this routing, got shape {tuple(x.shape)}")
    if x.device != routing.row_map.device:
        raise DeviceMismatchError(f"{what}: {name} is on {x.device}, the routing on {routing.row_map.device}")
    return x


# --------------------------------------------------------------------------------------------------
# Torch references (differentiable; the oracle of the tests and the torch provider's core)


def _scores_ref(logits: torch.Tensor, score: str) -> torch.Tensor:
    x = logits.float()
    return torch.softmax(x, dim=-1) if score == "softmax" else torch.sigmoid(x)


def _selection_keys(
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


def _choose_ref(
    p: torch.Tensor, k: int, bias: torch.Tensor | None = None, n_group: int = 0, topk_group: int = 0
) -> torch.Tensor:
    """The K chosen experts [T, K] of scores ``p`` [T, E]: the K highest selection keys, by a stable sort."""
    key64 = _selection_keys(p, bias, n_group, topk_group)
    return torch.sort(key64, dim=1, descending=True, stable=True).indices[:, :k].contiguous()  # ties: lower expert


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
    p = _scores_ref(logits, spec.score)  # [T, E] fp32
    indices = _choose_ref(p, k, score_bias, spec.n_group or 0, spec.topk_group or 0)  # [T, K]
    scores = p.gather(1, indices)  # [T, K]
    weights = scores / scores.sum(1, keepdim=True) if spec.renormalize else scores
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


def _check_groups(groups: object, T: int, what: str) -> int | tuple[int, ...] | None:
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


def _aux_probs(x: torch.Tensor, routing: Routing, from_probs: bool) -> torch.Tensor:
    """[T, E] fp32 probabilities of the aux loss (see the module docstring)."""
    if from_probs:
        return x.float()
    if routing.score == "softmax":
        return torch.softmax(x.float(), dim=-1)
    s = torch.sigmoid(x.float())
    return s / s.sum(-1, keepdim=True)


def moe_aux_loss_ref(
    logits_or_probs: torch.Tensor,
    routing: Routing,
    *,
    from_probs: bool = False,
    scale: str = "balanced-one",
    groups: int | Sequence[int] | None = None,
) -> torch.Tensor:
    """The mean over groups of E * sum_e f_ge * P_ge (see the module docstring), in plain torch."""
    what = "torsh_kernels.moe_aux_loss_ref"
    E, T, K = routing.num_experts, routing.num_tokens, routing.k
    kf = K if check_choice(scale, what, "scale", AUX_SCALES) == "balanced-one" else 1
    groups = _check_groups(groups, T, what)
    p = _aux_probs(logits_or_probs, routing, from_probs)
    if T == 0:  # no tokens: no imbalance (a mean over no tokens would be NaN and spoil the summed loss)
        return (p.sum() * 0.0).reshape(())
    if groups is None:  # (a count per expert of static shape [E]: bincount's size depends on the data)
        idx = routing.indices.reshape(-1)
        f = torch.zeros(E, dtype=torch.int64, device=idx.device).scatter_add_(0, idx, torch.ones_like(idx)).float()
        return E * (f / (T * kf) * p.mean(0)).sum()
    G = _num_groups(groups, T)
    dev = routing.indices.device
    if isinstance(groups, int):  # G groups of S tokens
        gid = torch.arange(T, device=dev) // groups
        psum = p.view(G, groups, E).sum(1)  # [G, E]
        sizes = torch.full((G,), float(groups), device=p.device)
    else:
        lengths = torch.tensor(groups)
        gid = torch.repeat_interleave(torch.arange(G), lengths).to(dev)
        psum = p.new_zeros(G, E).index_add(0, gid.to(p.device), p)
        sizes = lengths.to(device=p.device, dtype=torch.float32)
    key = (gid[:, None] * E + routing.indices).reshape(-1)  # [T*K]: group-major expert slot
    counts = torch.zeros(G * E, dtype=torch.int64, device=dev).scatter_add_(0, key, torch.ones_like(key))
    per_group = (counts.view(G, E).float() * psum).sum(1) / sizes.square()  # [G]
    return (E / (kf * G)) * per_group.sum()


def moe_z_loss_ref(logits: torch.Tensor) -> torch.Tensor:
    """mean over tokens of logsumexp(logits[t])**2, in fp32 (0 for no tokens)."""
    if logits.shape[0] == 0:  # (a mean over no tokens would be NaN and spoil the summed loss)
        return (logits.float().sum() * 0.0).reshape(())
    return torch.logsumexp(logits.float(), dim=-1).square().mean()


# --------------------------------------------------------------------------------------------------
# Provider implementations. Inputs are validated and contiguous, on one device.

_topk = Op("moe_route")
_assign = Op("moe_route.assign")
_scatter_rows = Op("moe_permute")
_gather_rows = Op("moe_unpermute")
_gather_rows_bwd = Op("moe_unpermute.backward")

_ASSIGN_BLOCK = 1024


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


# scoring and top-k: (logits [T, E], k, score, renorm, bias [E] | None, n_group, topk_group (0: no groups),
# scaling) -> indices, weights, scores [T, K], bad-row count [1]
@_topk.register("torch")
def _topk_torch(logits, k, score, renorm, bias, n_group, topk_group, scaling):
    p = _scores_ref(logits, score)
    nan = torch.isnan(p)
    bad = nan.any(1).sum().view(1)
    if bias is not None or n_group:  # the selection options: the reference's keys
        if k <= 8:  # k rounds of argmax (the first of equal maxima); a chosen key drops to -inf, below them all
            key = _selection_keys(p, bias, n_group, topk_group)
            idx = torch.empty(p.shape[0], k, dtype=torch.int64, device=p.device)
            for j in range(k):
                i = key.argmax(1, keepdim=True)
                idx[:, j : j + 1] = i
                if j + 1 < k:
                    key.scatter_(1, i, -math.inf)
        else:
            idx = _choose_ref(p, k, bias, n_group, topk_group)
    elif k <= 8:  # k rounds of argmax, which returns the first (lowest) index of equal maxima
        sel = torch.where(nan, -1.0, p)
        idx = torch.empty(p.shape[0], k, dtype=torch.int64, device=p.device)
        for j in range(k):
            i = sel.argmax(1, keepdim=True)
            idx[:, j : j + 1] = i
            if j + 1 < k:
                sel.scatter_(1, i, -3.0)
    else:
        sel = torch.where(nan, -1.0, p)
        idx = torch.sort(sel, dim=1, descending=True, stable=True).indices[:, :k].contiguous()
    s = p.gather(1, idx)
    w = s / s.sum(1, keepdim=True) if renorm else s.clone()
    if scaling != 1.0:
        w.mul_(scaling)
    return idx, w, s, bad


@_topk.register("triton")
def _topk_triton(logits, k, score, renorm, bias, n_group, topk_group, scaling):
    import triton

    from . import _moe_triton as kt

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


@_topk.register("numba")
def _topk_numba(logits, k, score, renorm, bias, n_group, topk_group, scaling):
    from . import _moe_numba as M

    return M.route_topk(logits, k, score == "softmax", renorm, bias, n_group, topk_group, scaling)


@_topk.register("cpu")
def _topk_cpu(logits, k, score, renorm, bias, n_group, topk_group, scaling):
    from . import _moe_cpu as M

    return M.route_topk(logits, k, score, renorm, bias, n_group, topk_group, scaling)


# assignment -> row: (indices [T, K], scores [T, K]) -> row_map [T*K] (-1 dropped), counts [E], token_index [N].
# ``cap``: the call's capacity (policy != _NO_CAP), or ``seq`` = (L_s, C_s) per sequence; ``pad`` >= 0: every
# expert's group padded to ``pad`` rows (N = E * pad, token_index -1 at the padding rows).
@_assign.register("torch")
def _assign_torch(idx, s, E, cap, policy, seq=None, pad=-1):
    """Stable sorts instead of one pass per expert: rows ordered by (expert, token)."""
    flat = idx.reshape(-1)  # [T*K] token-major
    n, k = flat.numel(), idx.shape[1]
    dev = flat.device
    ar = torch.arange(n, device=dev)
    if policy == _NO_CAP:
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
        if policy == _CAP_POSITION:
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
        n_rows = n if policy == _NO_CAP else int(tpe.sum())
        starts = torch.cumsum(tpe, 0) - tpe
        tok = torch.empty(n_rows, dtype=torch.int64, device=idx.device)
    else:
        starts = torch.arange(E, dtype=torch.int64, device=idx.device) * pad
        tok = torch.full((E * pad,), -1, dtype=torch.int64, device=idx.device)
    if within is not None:
        starts = (starts.unsqueeze(0) + within).reshape(-1)  # [S * E]
    if name == "triton":
        import triton

        from . import _moe_triton as kt

        if seq is None:
            kt._route_rows_kernel[(triton.cdiv(n, 1024),)](idx, pos, starts, tok, idx, n, E, K=k, BLOCK=1024,
                                                            SEQ=False)  # fmt: skip
        else:
            grid = (len(seq[0]), triton.cdiv(max(seq[0]) * k, 1024))
            kt._route_rows_kernel[grid](idx, pos, starts, tok, seg, n, E, K=k, BLOCK=1024, SEQ=True)
    else:
        from . import _moe_numba as M

        M.route_rows(idx, pos, starts, tok, k, seg, E)
    return pos, tpe, tok


@_assign.register("triton")
def _assign_triton(idx, s, E, cap, policy, seq=None, pad=-1):
    from . import _moe_triton as kt

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


@_assign.register("numba")
def _assign_numba(idx, s, E, cap, policy, seq=None, pad=-1):
    from . import _moe_numba as M

    seg = None if seq is None else _segments(seq, idx.shape[1], idx.device)
    caps = None if seq is None else torch.tensor(seq[1], dtype=torch.int64, device=idx.device)
    pos, counts = M.route_assign(idx, s, E, cap, policy, seg, caps)
    return _finish_rows("numba", idx, pos, counts, policy, idx.shape[1], E, seq, pad, seg)


@_assign.register("cpu")
def _assign_cpu(idx, s, E, cap, policy, seq=None, pad=-1):
    from . import _moe_cpu as M

    if seq is None:
        return M.route_assign(idx, s, E, cap, policy, None, None, pad)
    caps = torch.tensor(seq[1], dtype=torch.int64)
    return M.route_assign(idx, s, E, cap, policy, _segments(seq, idx.shape[1], idx.device), caps, pad)


# scatter rows: out[row_map[t, j]] = x[t] (* w[t, j]); tok = the inverse map (out[i] = x[tok[i]] * ...).
# ``padded`` (the permute of a padded routing, w None): out[i] = x[tok[i]], zeros where tok[i] is -1.
@_scatter_rows.register("torch")
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


@_scatter_rows.register("triton")
def _scatter_rows_triton(x, rows, tok, w, out, padded=False):
    import triton

    from . import _moe_triton as kt

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


@_scatter_rows.register("numba")
def _scatter_rows_numba(x, rows, tok, w, out, padded=False):
    from . import _moe_numba as M

    if padded:
        M.permute_padded(x, tok, out)
    else:
        M.scatter_rows(x, rows, w, out)


@_scatter_rows.register("cpu")
def _scatter_rows_cpu(x, rows, tok, w, out, padded=False):
    from . import _moe_cpu as M

    if padded:
        M.permute_padded(x, tok, out)
    elif w is None or M.weighted_ok(x, w, out):
        M.scatter_rows(x, rows, tok, w, out)
    else:  # 16-bit rows with weights: torch's implementation (see _moe_cpu)
        _scatter_rows_torch(x, rows, tok, w, out)


# gather rows: out[t] = sum_j w[t, j] * y[row_map[t, j]] (``padded``: y has padding rows, which no row_map entry
# names; the kernels read only the rows named, the torch provider needs to know that N < T*K no longer rules out
# drops)
@_gather_rows.register("torch")
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


@_gather_rows.register("triton")
def _gather_rows_triton(y, rows, w, out, padded=False):
    import triton

    from . import _moe_triton as kt

    T, K = rows.shape
    H = out.shape[1]
    BH = _row_block(T, H)
    kt._unpermute_kernel[(T, triton.cdiv(H, BH))](y, rows, w if w is not None else rows, out, H, y.shape[0], K=K,
                                                   BLOCK_H=BH, HAS_W=w is not None,
                                                   num_warps=ROW_WARPS)  # fmt: skip


@_gather_rows.register("numba")
def _gather_rows_numba(y, rows, w, out, padded=False):
    from . import _moe_numba as M

    M.gather_rows(y, rows, w, out)


@_gather_rows.register("cpu")
def _gather_rows_cpu(y, rows, w, out, padded=False):
    from . import _moe_cpu as M

    if M.weighted_ok(y, w, out):
        M.gather_rows(y, rows, w, out)
    else:  # 16-bit rows: torch's implementation (see _moe_cpu)
        _gather_rows_torch(y, rows, w, out, padded)


# unpermute backward: grad_y_perm rows and grad_w [T, K] fp32
@_gather_rows_bwd.register("torch")
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


@_gather_rows_bwd.register("triton")
def _gather_rows_bwd_triton(gy, y, rows, w, gyp):
    from . import _moe_triton as kt

    T, K = rows.shape
    H = gy.shape[1]
    gw = torch.empty(T, K, dtype=torch.float32, device=gy.device)
    if T:
        kt._unpermute_bwd_kernel[(T,)](gy, y, rows, w, gyp, gw, H, y.shape[0], K=K, KP=max(2, _pow2(K)),
                                       BLOCK_H=_block_h(H, BWD_BLOCK), num_warps=BWD_WARPS)  # fmt: skip
    return gw


@_gather_rows_bwd.register("numba")
def _gather_rows_bwd_numba(gy, y, rows, w, gyp):
    from . import _moe_numba as M

    M.scatter_rows(gy, rows, w, gyp)
    return M.row_dots(gy, y, rows)


@_gather_rows_bwd.register("cpu")
def _gather_rows_bwd_cpu(gy, y, rows, w, gyp):
    from . import _moe_cpu as M

    if M.weighted_ok(gy, y, w, gyp):
        return M.gather_rows_bwd(gy, y, rows, w, gyp)
    return _gather_rows_bwd_torch(gy, y, rows, w, gyp)  # 16-bit rows: torch's implementation


# --------------------------------------------------------------------------------------------------
# Custom ops (torch.library) with autograd


def _select(op: Op, t: torch.Tensor, provider: str, k: int, num_experts: int = 0) -> str:
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


_POLICY = {"position": _CAP_POSITION, "probability": _CAP_PROBABILITY}


def _raise_nan_scores(bad: int, T: int) -> None:
    raise NonFiniteError(
        f"torsh_kernels.moe_route: {bad} of {T} tokens have NaN router scores (NaN or +inf logits, or a "
        "softmax row of all -inf); fix the router's input, or pass check_finite=False to route them "
        "anyway (their NaN scores then rank below every real score)"
    )


def _raise_bad_bias(bias: torch.Tensor) -> None:
    n = int((~torch.isfinite(bias)).sum())
    raise NonFiniteError(
        f"torsh_kernels.moe_route: score_bias holds {n} non-finite value(s) (NaN or Inf) of {bias.numel()}; it must "
        "be finite (a bias that diverged: reset it, or lower the balancer's update rate)"
    )


# score_bias tensors whose values were found finite: id -> (a weak reference, the version counter then). A
# bias is read again only after it changed in place (its version counter moved): once per balancer update,
# not once per route (a host sync on a GPU). Writes that bypass the counter (.data, NumPy) are not seen.
_BIAS_FINITE: dict[int, tuple[weakref.ref, int]] = {}


def _check_bias_finite(bias: torch.Tensor) -> None:
    """A NonFiniteError unless every value of ``bias`` is finite (checked once per version of the tensor)."""
    seen = _BIAS_FINITE.get(id(bias))
    if seen is not None and seen[0]() is bias and seen[1] == bias._version:
        return
    if not bool(torch.isfinite(bias).all()):
        _raise_bad_bias(bias)
    if len(_BIAS_FINITE) >= 256:
        _BIAS_FINITE.clear()
    _BIAS_FINITE[id(bias)] = (weakref.ref(bias), bias._version)


@torch.library.custom_op("torsh::moe_route", mutates_args=())
def _route_op(logits: torch.Tensor, k: int, score: str, renormalize: bool, score_bias: torch.Tensor | None,
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
        _check_bias_finite(score_bias)
    if T == 0:
        i = torch.empty(0, k, dtype=torch.int64, device=logits.device)
        f = torch.empty(0, k, dtype=torch.float32, device=logits.device)
        tok = i.new_empty(0) if padded_capacity < 0 else i.new_full((E * padded_capacity,), -1)
        return f, i, f.clone(), torch.zeros(E, dtype=torch.int64, device=logits.device), i.clone(), tok
    name = _select(_topk, logits, provider, k, E)
    with _on(logits.device):
        idx, w, s, bad = _topk(name, logits, k, score, renormalize, score_bias, n_group, topk_group, scaling)
        if check_finite and (b := _count(bad)):
            _raise_nan_scores(b, T)
        if sequence_lengths:
            seq = (tuple(sequence_lengths), tuple(sequence_capacity))
            rows, counts, tok = _assign(name, idx, s, E, -1, _POLICY[drop_policy], seq, padded_capacity)
        else:
            policy = _NO_CAP if capacity < 0 else _POLICY[drop_policy]
            if padded_capacity < 0:
                rows, counts, tok = _assign(name, idx, s, E, capacity, policy)
            else:
                rows, counts, tok = _assign(name, idx, s, E, capacity, policy, None, padded_capacity)
    return w, idx, s, counts, rows.view(T, k), tok


@_route_op.register_fake
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
        if ctx.renormalize:  # d/ds_j = (c g_j - sum_i w_i g_i) / sum(s)
            gs = ((g if c == 1.0 else g * c) - (w * g).sum(1, keepdim=True)) / s.sum(1, keepdim=True)
        else:
            gs = g if c == 1.0 else g * c
        grad.scatter_(1, idx, gs * s * (1.0 - s))
    return grad.to(ctx.logits_dtype), *([None] * 14)


torch.library.register_autograd("torsh::moe_route", _route_backward, setup_context=_route_setup)


@torch.library.custom_op("torsh::moe_permute", mutates_args=())
def _permute_op(x: torch.Tensor, row_map: torch.Tensor, token_index: torch.Tensor, provider: str,
                padded: bool = False) -> torch.Tensor:  # fmt: skip
    """``padded``: the routing's groups are padded (token_index -1 at the padding rows, written as zeros)."""
    out = x.new_empty(token_index.shape[0], x.shape[1])
    if out.numel():
        name = _select(_scatter_rows, x, provider, row_map.shape[1])
        with _on(x.device):
            if padded:
                _scatter_rows(name, x, row_map, token_index, None, out, True)
            else:
                _scatter_rows(name, x, row_map, token_index, None, out)
    return out


@_permute_op.register_fake
def _(x, row_map, token_index, provider, padded=False):
    return x.new_empty(token_index.shape[0], x.shape[1])


def _permute_setup(ctx, inputs, output):
    _, row_map, token_index, provider, *rest = inputs
    ctx.save_for_backward(row_map, token_index)
    ctx.provider, ctx.padded = provider, bool(rest and rest[0])


def _permute_backward(ctx, g):
    """The sum of each token's rows (the padding rows' gradient goes nowhere: no token came from them)."""
    row_map, token_index = ctx.saved_tensors
    gx = _eager.call_autograd(_unpermute_op, g.contiguous(), row_map, token_index, None, ctx.provider, ctx.padded)
    return gx, None, None, None, None


torch.library.register_autograd("torsh::moe_permute", _permute_backward, setup_context=_permute_setup)


@torch.library.custom_op("torsh::moe_unpermute", mutates_args=())
def _unpermute_op(y_perm: torch.Tensor, row_map: torch.Tensor, token_index: torch.Tensor, weights: torch.Tensor | None,
                  provider: str, padded: bool = False) -> torch.Tensor:  # fmt: skip
    """``padded``: y_perm has padding rows (no row_map entry names them; they are not read)."""
    T = row_map.shape[0]
    out = y_perm.new_empty(T, y_perm.shape[1])
    if T and y_perm.shape[1]:
        name = _select(_gather_rows, y_perm, provider, row_map.shape[1])
        with _on(y_perm.device):
            if padded:
                _gather_rows(name, y_perm, row_map, weights, out, True)
            else:
                _gather_rows(name, y_perm, row_map, weights, out)
    return out


@_unpermute_op.register_fake
def _(y_perm, row_map, token_index, weights, provider, padded=False):
    return y_perm.new_empty(row_map.shape[0], y_perm.shape[1])


@torch.library.custom_op("torsh::moe_unpermute_backward", mutates_args=())
def _unpermute_bwd_op(grad_y: torch.Tensor, y_perm: torch.Tensor, row_map: torch.Tensor, weights: torch.Tensor,
                      provider: str, padded: bool = False) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``padded``: the gradient of y_perm's padding rows (which no assignment read) is zero."""
    gyp = torch.zeros_like(y_perm) if padded else torch.empty_like(y_perm)
    if row_map.shape[0] == 0 or y_perm.shape[1] == 0:
        return gyp.zero_(), torch.zeros(row_map.shape, dtype=torch.float32, device=y_perm.device)
    name = _select(_gather_rows_bwd, y_perm, provider, row_map.shape[1])
    with _on(y_perm.device):
        gw = _gather_rows_bwd(name, grad_y, y_perm, row_map, weights, gyp)
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
        return _eager.call_autograd(_permute_op, g, row_map, token_index, p, padded), None, None, None, None, None
    if torch.is_grad_enabled():  # a double backward: the registered op (it has no autograd of its own)
        gyp, gw = _unpermute_bwd_op(g, y_perm, row_map, weights, p, padded)
    else:
        gyp, gw = _eager.call(_unpermute_bwd_op, (), g, y_perm, row_map, weights, p, padded)
    return gyp, None, None, gw if ctx.needs_input_grad[3] else None, None, None


torch.library.register_autograd("torsh::moe_unpermute", _unpermute_backward, setup_context=_unpermute_setup)


# --------------------------------------------------------------------------------------------------
# Public API


def moe_route(
    logits: torch.Tensor,
    spec: RouterSpec | None = None,
    *,
    score_bias: torch.Tensor | None = None,
    sequence_lengths: Sequence[int] | torch.Tensor | None = None,
    provider: str | None = None,
    **options: Any,
) -> Routing:
    """Route T tokens to K of E experts (see the module docstring).

    Args:
        logits: [T, E] router logits (fp32, fp16 or bf16); scores are computed in fp32.
        spec: a :class:`~torsh_kernels.ops.RouterSpec`: ``k`` and the routing options (the score function,
            renormalisation, grouped selection, scaling, capacity and drop policy, padding, the NaN check).
        **options: the spec's fields as keywords (``moe_route(logits, k=2, score="sigmoid")``), which build
            it (once per distinct set) or refine ``spec``.
        score_bias: None, or an fp32 [E] tensor on the logits' device, finite, added to the scores for the
            selection only (DeepSeek-V3's ``e_score_correction_bias``); ``weights`` and ``scores`` stay
            unbiased and no gradient reaches it. Its values are checked once per version of the tensor
            (an in-place update moves the version; a write through ``.data`` is not seen).
        sequence_lengths: with ``capacity_scope="sequence"``: the tokens of each sequence (ints >= 0 summing to T,
            the tokens laid out sequence after sequence), a list or tuple of ints or a 1-D integer tensor (read on
            the host).
        provider: "triton", "numba", "cpu" or "torch"; None selects automatically.
    """
    if options or spec is None or type(spec) is not RouterSpec:
        spec = RouterSpec.build(spec, options, _ROUTE)
    if (
        type(logits) is _T and logits.dtype is _F32 and logits.is_cpu and logits.dim() == 2
        and logits.is_contiguous() and (T := logits.shape[0]) > 0 and spec.k <= (E := logits.shape[1])
        and sequence_lengths is None and spec.capacity_scope == "call" and not spec.pad_to_capacity
        and spec.capacity is None
        and (score_bias is None or _eager.plain(score_bias)) and _eager.fast()
    ):  # fmt: skip
        r = _route_fast_paths(logits, spec, score_bias, provider, T, E)
        if r is not None:
            return r
    return _route_checked(logits, spec, score_bias, sequence_lengths, provider)


_ROUTE = "torsh_kernels.moe_route"


def _route_fast_paths(logits, spec: RouterSpec, score_bias, provider, T: int, E: int) -> Routing | None:
    """The common cases on fp32 contiguous CPU logits (no fixed capacity, no sequences, no padding): the cpu
    provider's route in one kernel call (with a gradient needed, as the forward of the op's registered
    autograd), or torch's for small k without a gradient; None when neither applies."""
    k, score = spec.k, spec.score
    if _topk.select(_CPU, _F32, logits.numel(), provider or None) == "cpu":
        G, TG = spec.selection(E, _ROUTE)
        bias = None if score_bias is None else _check_bias(score_bias, logits, _ROUTE)
        cf = spec.capacity_factor
        cap = -1 if cf is None else expert_capacity(T, k, E, cf)
        if logits.requires_grad and torch.is_grad_enabled():
            w, idx, s, counts, rows, tok = _eager.autograd_fast(
                _route_op, _route_cpu_impl, logits, k, score, spec.renormalize, bias, G, TG, spec.scaling, cap,
                spec.drop_policy, (), (), -1, spec.check_finite, provider or "",
            )  # fmt: skip
            dropped, n = rows < 0, tok.shape[0]
        else:
            w, idx, s, counts, rows, tok, dropped, n = _route_cpu(logits, T, E, k, score, spec.renormalize, bias, G,
                                                                  TG, spec.scaling, cap, spec.drop_policy,
                                                                  spec.check_finite)  # fmt: skip
        return seal(Routing(indices=idx, weights=w, scores=s.detach(), tokens_per_expert=counts, row_map=rows,
                            token_index=tok, dropped=dropped, num_experts=E, num_rows=n,
                            capacity=None if cap < 0 else cap, score=score))  # fmt: skip
    if (
        k <= 8 and score_bias is None and not spec.grouped and spec.scaling == 1.0 and spec.capacity_factor is None
        and not (logits.requires_grad and torch.is_grad_enabled()) and _select(_topk, logits, provider or "", k, E)
        == "torch"
    ):  # fmt: skip
        return _eager.run(_route_fast, logits, T, E, k, score, spec.renormalize)
    return None


def _route_checked(logits, spec: RouterSpec, score_bias, sequence_lengths, provider) -> Routing:
    """moe_route with every input checked (typed errors), on any device, dtype and provider."""
    what = _ROUTE
    check_provider(provider)
    logits = _check_logits(logits, what)
    _check_strided(logits, what, "logits")
    T, E = logits.shape
    G, TG = spec.selection(E, what)
    bias = None if score_bias is None else _check_bias(score_bias, logits, what)
    plan = plan_capacity(what, T, E, spec, sequence_lengths, logits.device)
    if plan.limited and plan.padded_capacity < 0 and logits.is_meta:
        limit = f"capacity={spec.capacity}" if spec.capacity is not None else f"capacity_factor={spec.capacity_factor}"
        raise InvalidArgumentError(
            f"{what}: logits are meta tensors and {limit}: the number of kept rows depends on the router's values, "
            "which meta tensors do not have; route without a capacity, pad to it (pad_to_capacity=True: E * capacity "
            "rows), or trace the model with torch.compile (a data-dependent size there)"
        )
    w, idx, s, counts, rows, tok = _eager.call_autograd(
        _route_op, logits.contiguous(), spec.k, spec.score, spec.renormalize, bias, G, TG, spec.scaling,
        plan.kernel_capacity, spec.drop_policy, list(plan.sequence_lengths or ()), list(plan.kernel_sequence_capacity),
        plan.padded_capacity, spec.check_finite, provider or "",
    )  # fmt: skip
    r = Routing(
        indices=idx, weights=w, scores=s.detach(), tokens_per_expert=counts, row_map=rows, token_index=tok,
        dropped=rows < 0, num_experts=E, num_rows=tok.shape[0], capacity=plan.capacity, score=spec.score,
        sequence_lengths=plan.sequence_lengths, sequence_capacity=plan.sequence_capacity,
        padded=plan.padded_capacity >= 0,
    )  # fmt: skip
    return r if _eager.compiling() else seal(r)  # (while torch.compile traces: nothing to seal)


def _check_bias(score_bias: object, logits: torch.Tensor, what: str) -> torch.Tensor:
    """The score bias as the custom op takes it (contiguous); a typed error for a bad one. Its values are
    checked by the op (:func:`_check_bias_finite`), at run time."""
    E = logits.shape[1]
    bias = _check_tensor(score_bias, what, "score_bias")
    if bias.dtype != torch.float32:
        raise DTypeError(
            f"{what}: score_bias has dtype {bias.dtype}; expected float32 (one fp32 value per expert, added to the "
            "fp32 scores): pass bias.float()"
        )
    if tuple(bias.shape) != (E,):
        raise ShapeError(f"{what}: score_bias must be [E={E}] (one value per expert), got shape {tuple(bias.shape)}")
    if bias.device != logits.device:
        raise DeviceMismatchError(f"{what}: score_bias is on {bias.device}, the logits on {logits.device}")
    return bias if bias.is_contiguous() else bias.contiguous()


_T = torch.Tensor
_F32 = torch.float32
_BOOL = torch.bool
_CPU = torch.device("cpu")
_cpu_kernels = _eager.lazy_module("_moe_cpu")  # the cpu provider's kernels, for the fast paths


_ARANGE: dict[int, torch.Tensor] = {}  # CPU 0..n-1 per n, for the fast path (read only, never returned)


def _route_cpu(logits, T, E, k, score, renorm, bias, G, TG, c, cap, drop_policy, check_finite):
    """The cpu provider's route in one kernel call on fp32 contiguous CPU logits (and bias): (w, idx, s, counts,
    rows, tok, dropped, N)."""
    M = _cpu_kernels()
    if bias is not None:
        _check_bias_finite(bias)
    i64 = torch.int64
    idx, w, s = torch.empty(T, k, dtype=i64), torch.empty(T, k), torch.empty(T, k)
    rows = torch.empty(T, k, dtype=i64)
    counts, tok, dropped = torch.empty(E, dtype=i64), torch.empty(T * k, dtype=i64), torch.empty(T, k, dtype=_BOOL)
    x, mode = M.scores_for_kernel(logits, score)
    policy = _NO_CAP if cap < 0 else _POLICY[drop_policy]
    if bias is None and not G and c == 1.0:
        bad, n = M.route_ptr(x.data_ptr(), T, E, k, mode, renorm, cap, policy, idx.data_ptr(), w.data_ptr(),
                             s.data_ptr(), rows.data_ptr(), counts.data_ptr(), tok.data_ptr(),
                             dropped.data_ptr())  # fmt: skip
    else:
        bad, n = M.route_select_ptr(x.data_ptr(), T, E, k, mode, renorm, 0 if bias is None else bias.data_ptr(),
                                    bias is not None, G, TG, c, cap, policy, idx.data_ptr(), w.data_ptr(), s.data_ptr(),
                                    rows.data_ptr(), counts.data_ptr(), tok.data_ptr(), dropped.data_ptr())  # fmt: skip
    if bad and check_finite:
        _raise_nan_scores(bad, T)
    return w, idx, s, counts, rows, tok if n == T * k else tok[:n], dropped, n


def _route_cpu_impl(logits, k, score, renormalize, score_bias, n_group, topk_group, scaling, capacity, drop_policy,
                    sequence_lengths, sequence_capacity, padded_capacity, check_finite, provider):  # fmt: skip
    """:func:`_route_cpu` with the custom op's signature and outputs (the forward of its autograd; the call
    scope without padding, the fast path's case)."""
    T, E = logits.shape
    return _route_cpu(logits, T, E, k, score, renormalize, score_bias, n_group, topk_group, scaling, capacity,
                      drop_policy, check_finite)[:6]  # fmt: skip


def _permute_cpu_impl(x, row_map, token_index, provider, padded=False):
    """The cpu provider's permute on plain contiguous CPU rows (the custom op's signature and output)."""
    M = _cpu_kernels()
    out = x.new_empty(token_index.shape[0], x.shape[1])
    M.scatter_rows(x, row_map, token_index, None, out)
    return out


def _unpermute_cpu_impl(y_perm, row_map, token_index, weights, provider, padded=False):
    """The cpu provider's unpermute on fp32 contiguous CPU rows and weights (the custom op's signature)."""
    M = _cpu_kernels()
    T, K = row_map.shape
    out = torch.empty(T, y_perm.shape[1])
    if not M.gather_rows_ptr(y_perm.data_ptr(), y_perm.shape[0], y_perm.shape[1], row_map.data_ptr(), T, K,
                             weights.data_ptr() if weights is not None else 0, weights is not None,
                             out.data_ptr()):  # fmt: skip
        raise M._out_of_range("moe_unpermute")
    return out


def _arange(n: int) -> torch.Tensor:
    a = _ARANGE.get(n)
    if a is None:
        if len(_ARANGE) > 64:
            _ARANGE.clear()
        a = _ARANGE[n] = torch.arange(n)
    return a


def _route_fast(logits: torch.Tensor, T: int, E: int, k: int, score: str, renorm: bool) -> Routing | None:
    """moe_route's torch provider for fp32 CPU logits, k <= 8, no capacity limit, when no score is NaN
    (else None: the general path counts and reports them, or routes them with check_finite=False). The
    same operations with the NaN masking left out (it replaces nothing when nothing is NaN), the first
    argmax taken on the scores themselves, the last round's scatter skipped (its result is never read) and
    the row map written by scatter_ (rows[order] = 0..n-1). Run under no-grad (``_eager.run``)."""
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
    w = s / s.sum(1, keepdim=True) if renorm else s.clone()
    flat = idx.view(-1)
    n = T * k
    order = torch.sort(flat, stable=True).indices
    counts = torch.bincount(flat, minlength=E)
    rows = torch.empty(n, dtype=torch.int64).scatter_(0, order, _arange(n)).view(T, k)
    tok = torch.floor_divide(order, k)  # (order // k without the Python-level operator wrapper)
    return seal(Routing(indices=idx, weights=w, scores=s, tokens_per_expert=counts, row_map=rows, token_index=tok,
                        dropped=rows < 0, num_experts=E, num_rows=n, capacity=None, score=score))  # fmt: skip


def moe_permute(x: torch.Tensor, routing: Routing, *, provider: str | None = None) -> torch.Tensor:
    """Rows of ``x [T, H]`` grouped by expert: ``[N, H]``, expert e's group holding its tokens in token
    order; differentiable (the backward sums each token's rows)."""
    if (
        type(routing) is Routing and type(x) is _T and x.is_cpu and x.dim() == 2 and x.is_contiguous()
        and (x.dtype is _F32 or x.dtype is torch.float16 or x.dtype is torch.bfloat16)
        and _eager.fast()  # (before the row count, a data-dependent size while torch.compile traces)
        and sealed_rows(routing) and not routing.padded and x.shape[0] == routing.indices.shape[0] and x.shape[1]
        and routing.num_rows and (tok := routing.token_index).is_cpu and routing.row_map.is_cpu
        and (sel := _select(_scatter_rows, x, provider or "", routing.row_map.shape[1])) in ("torch", "cpu")
    ):  # fmt: skip
        # The common case on the CPU: the provider's gather through the inverse map, into a new tensor
        # instead of a preallocated one; the cpu provider's also when a gradient is needed (as the forward
        # of the op's registered autograd).
        grad = x.requires_grad and torch.is_grad_enabled()
        if sel == "torch":
            if not grad:
                return x.index_select(0, tok)
        elif tok.dtype is torch.int64 and tok.numel() == routing.num_rows:
            if grad:
                return _eager.autograd_fast(_permute_op, _permute_cpu_impl, x, routing.row_map, tok, provider or "",
                                            False)  # fmt: skip
            try:  # (the cpu provider's permute is torch's index_select: one pass over whole rows)
                return x.index_select(0, tok)
            except (IndexError, RuntimeError):
                pass  # an index out of range: the general path raises the typed error
    what = "torsh_kernels.moe_permute"
    check_provider(provider)
    routing = _check_routing(routing, what, "rows")
    x = _check_rows(x, routing.num_tokens, routing, what, "x", "T")
    _check_strided(x, what, "x")
    return _eager.call_autograd(_permute_op, x.contiguous(), routing.row_map, routing.token_index, provider or "",
                                routing.padded)  # fmt: skip


def moe_unpermute(
    y_perm: torch.Tensor, routing: Routing, *, weights: bool = True, provider: str | None = None
) -> torch.Tensor:
    """Combine expert outputs ``y_perm [N, H]`` back to ``[T, H]`` in token order, weighted by
    ``routing.weights`` (unless ``weights=False``); differentiable in ``y_perm`` and the weights."""
    if (
        type(routing) is Routing and type(y_perm) is _T and y_perm.dtype is _F32 and y_perm.is_cpu
        and y_perm.dim() == 2 and _eager.fast()  # (before the sizes: data-dependent while torch.compile traces)
        and y_perm.is_contiguous() and y_perm.shape[1] and sealed(routing)
        and (rows := routing.row_map).is_cpu and type(w := routing.weights) is _T and w.dtype is _F32 and w.is_cpu
        and rows.shape[0] and y_perm.shape[0] == routing.num_rows
        and rows.is_contiguous() and w.is_contiguous() and rows.dtype is torch.int64 and w.shape == rows.shape
        and _select(_gather_rows, y_perm, provider or "", rows.shape[1]) == "cpu"
    ):  # fmt: skip
        # The common case on the CPU with the cpu provider: its kernel into a new tensor; when a gradient is
        # needed, as the forward of the op's registered autograd.
        if torch.is_grad_enabled() and (y_perm.requires_grad or (weights and w.requires_grad)):
            return _eager.autograd_fast(_unpermute_op, _unpermute_cpu_impl, y_perm, rows, routing.token_index,
                                        w if weights else None, provider or "", routing.padded)  # fmt: skip
        M = _cpu_kernels()
        out = torch.empty(rows.shape[0], y_perm.shape[1])
        if M.gather_rows_ptr(y_perm.data_ptr(), y_perm.shape[0], y_perm.shape[1], rows.data_ptr(), rows.shape[0],
                             rows.shape[1], w.data_ptr(), bool(weights), out.data_ptr()):  # fmt: skip
            return out
    if (
        weights and type(routing) is Routing and type(y_perm) is _T and y_perm.dtype is _F32 and y_perm.is_cpu
        and y_perm.dim() == 2 and _eager.fast()  # (before the sizes: data-dependent while torch.compile traces)
        and y_perm.is_contiguous() and (H := y_perm.shape[1]) and sealed(routing) and not routing.padded
        and (rows := routing.row_map).is_cpu and type(w := routing.weights) is _T and w.dtype is _F32 and w.is_cpu
        and (T := rows.shape[0]) and y_perm.shape[0] == routing.num_rows == T * (K := rows.shape[1])
        and max(16, (1 << 21) // (4 * H)) >= T
        and not (torch.is_grad_enabled() and (y_perm.requires_grad or w.requires_grad))
        and _select(_gather_rows, y_perm, provider or "", K) == "torch"
    ):  # fmt: skip
        # The common case, fp32 on the CPU without drops, one token block, no gradient: the torch
        # provider's fp32 multiply-adds, the K gathers done as one, into new tensors instead of its
        # reused buffers.
        v = y_perm.index_select(0, rows.reshape(-1)).view(T, K, H)
        a = torch.mul(v[:, 0], w[:, 0:1])
        for j in range(1, K):
            a.addcmul_(v[:, j], w[:, j : j + 1])
        return a
    what = "torsh_kernels.moe_unpermute"
    check_provider(provider)
    routing = _check_routing(routing, what, "weights")
    y_perm = _check_rows(y_perm, routing.num_rows, routing, what, "y_perm", "N")
    _check_strided(y_perm, what, "y_perm")
    w = routing.weights if weights else None
    return _eager.call_autograd(
        _unpermute_op, y_perm.contiguous(), routing.row_map, routing.token_index, w, provider or "", routing.padded
    )


def moe_aux_loss(
    logits_or_probs: torch.Tensor,
    routing: Routing,
    *,
    from_probs: bool = False,
    scale: str = "balanced-one",
    groups: int | Sequence[int] | None = None,
    provider: str | None = None,
) -> torch.Tensor:
    """The load-balancing loss: the mean over token groups of ``E * sum_e f_ge * P_ge`` (fp32 scalar,
    differentiable in the input; see the module docstring).

    Args:
        logits_or_probs: the [T, E] router logits (scored like the routing: softmax, or sigmoid scores
            divided by their sum per token) or, with ``from_probs=True``, probabilities the caller already
            computed. With a ``score_bias`` routing, the unbiased logits.
        routing: the :class:`Routing` of these logits; its ``indices`` (before capacity drops) are counted.
        scale: "balanced-one" (``f_ge = c_ge / (K * S_g)``: 1.0 when balanced) or "hf" (``c_ge / S_g``,
            K times that: Hugging Face's Mixtral / Qwen2-MoE / OLMoE ``load_balancing_loss_func``, and
            Switch Transformers' with ``groups``).
        groups: None (all T tokens one group), an int group size S dividing T, or a list/tuple of the
            lengths of consecutive groups summing to T (the sequence lengths: DeepSeek-V3's sequence-wise
            loss, Megatron's ``seq_aux_loss``; ``routing.sequence_lengths``). The loss is the unweighted mean
            of the non-empty groups' losses.
        provider: "cpu" (one kernel forward and one backward, CPU tensors) or "torch" (plain torch, which
            autograd differentiates and ``torch.compile`` fuses); None selects automatically.
    """
    what = "torsh_kernels.moe_aux_loss"
    routing = _check_routing(routing, what, "experts")
    x = _check_tensor(logits_or_probs, what, "logits_or_probs")
    _check_act_dtype(x, what, "logits_or_probs")
    if tuple(x.shape) != (routing.num_tokens, routing.num_experts):
        raise ShapeError(
            f"{what}: logits_or_probs has shape {tuple(x.shape)}; the routing is for "
            f"[T={routing.num_tokens}, E={routing.num_experts}]"
        )
    if not (x.is_cpu and routing.indices.is_cpu) and x.device != routing.indices.device:
        raise DeviceMismatchError(f"{what}: logits_or_probs is on {x.device}, the routing on {routing.indices.device}")
    if not x.is_contiguous():
        _check_strided(x, what, "logits_or_probs")
    if scale != "balanced-one":
        check_choice(scale, what, "scale", AUX_SCALES)
    if groups is not None:
        groups = _check_groups(groups, routing.num_tokens, what)
    return _aux_loss(_loss_provider(_aux_loss, x, provider), x, routing, bool(from_probs), scale, groups)


def moe_z_loss(logits: torch.Tensor, *, provider: str | None = None) -> torch.Tensor:
    """The router z-loss ``mean_t logsumexp(logits[t])**2`` (fp32 scalar, differentiable). ``provider`` as
    for :func:`moe_aux_loss`."""
    logits = _check_logits(logits, "torsh_kernels.moe_z_loss")
    _check_strided(logits, "torsh_kernels.moe_z_loss", "logits")
    return _z_loss(_loss_provider(_z_loss, logits, provider), logits)


# The losses' providers: torch (the references: autograd differentiates them, torch.compile fuses them)
# and, on the CPU, one kernel forward and one backward (an autograd Function; a backward that must itself be
# differentiable, create_graph=True, runs the same gradient formula in torch ops). Under torch.compile, a
# mode, or for a tensor subclass the torch formulas run.
_aux_loss = Op("moe_aux_loss")
_z_loss = Op("moe_z_loss")
_aux_loss.register("torch")(
    lambda x, routing, from_probs, scale, groups: moe_aux_loss_ref(
        x, routing, from_probs=from_probs, scale=scale, groups=groups
    )
)
_z_loss.register("torch")(moe_z_loss_ref)


def _loss_kernel_ok(x: torch.Tensor) -> bool:
    return type(x) in _eager._PLAIN and x.shape[0] > 0 and _eager.fast()


def _loss_provider(op, x: torch.Tensor, provider: str | None) -> str:
    if _eager.compiling() or x.is_meta:  # the torch formula (dynamo traces it; meta: shapes only); no selection
        op.check_traced(x.device, provider)  # state read while tracing
        return "torch"
    name = op.select(x.device, x.dtype, x.numel(), provider or None)
    return "torch" if name == "cpu" and not _loss_kernel_ok(x) else name


@_aux_loss.register("cpu")
def _aux_loss_cpu(x, routing, from_probs, scale, groups):
    M = _cpu_kernels()
    mode = M.PROBS if from_probs else M.SOFTMAX if routing.score == "softmax" else M.SIGMOID
    kf = routing.k if scale == "balanced-one" else 1
    return M.aux_loss(x.float().contiguous(), mode, routing.indices, kf, groups)


@_z_loss.register("cpu")
def _z_loss_cpu(x):
    M = _cpu_kernels()
    return M.z_loss(x.float().contiguous())
