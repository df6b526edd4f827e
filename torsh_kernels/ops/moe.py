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

from collections.abc import Sequence
from typing import Any

import torch

from ..errors import (
    DeviceMismatchError,
    DTypeError,
    InvalidArgumentError,
    ShapeError,
)
from . import eager
from ._moe_routing import (
    Routing,
    check_routing,
    check_sequence_lengths,
    expert_capacity,
    plan_capacity,
    seal,
    sealed,
    sealed_rows,
)
from .common import check_strided, check_tensor
from .moe_checks import check_logits, check_routing_of, check_rows
from .moe_losses import moe_aux_loss, moe_z_loss
from .moe_ops import POLICY, check_bias_finite, permute_op, raise_nan_scores, route_op, select, unpermute_op
from .moe_providers import (
    NO_CAP,
    gather_rows,
    scatter_rows,
    topk,
)
from .moe_reference import (
    AUX_SCALES,
    moe_aux_loss_ref,
    moe_permute_ref,
    moe_route_ref,
    moe_unpermute_ref,
    moe_z_loss_ref,
)
from .registry import check_provider
from .router import CAPACITY_SCOPES, DROP_POLICIES, SCORES, RouterSpec

__all__ = [
    "AUX_SCALES",
    "CAPACITY_SCOPES",
    "DROP_POLICIES",
    "SCORES",
    "RouterSpec",
    "Routing",
    "check_routing",
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
        and (score_bias is None or eager.plain(score_bias)) and eager.fast()
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
    if topk.select(_CPU, _F32, logits.numel(), provider or None) == "cpu":
        G, TG = spec.selection(E, _ROUTE) if spec.grouped else (0, 0)  # (k <= E: checked by the caller)
        bias = None if score_bias is None else _check_bias(score_bias, logits, _ROUTE)
        cf = spec.capacity_factor
        cap = -1 if cf is None else expert_capacity(T, k, E, cf)
        if logits.requires_grad and torch.is_grad_enabled():
            w, idx, s, counts, rows, tok = eager.autograd_fast(
                route_op, _route_cpu_impl, logits, k, score, spec.renormalize, bias, G, TG, spec.scaling, cap,
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
        and not (logits.requires_grad and torch.is_grad_enabled()) and select(topk, logits, provider or "", k, E)
        == "torch"
    ):  # fmt: skip
        return eager.run(_route_fast, logits, T, E, k, score, spec.renormalize)
    return None


def _route_checked(logits, spec: RouterSpec, score_bias, sequence_lengths, provider) -> Routing:
    """moe_route with every input checked (typed errors), on any device, dtype and provider."""
    what = _ROUTE
    check_provider(provider)
    logits = check_logits(logits, what)
    check_strided(logits, what, "logits")
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
    w, idx, s, counts, rows, tok = eager.call_autograd(
        route_op, logits.contiguous(), spec.k, spec.score, spec.renormalize, bias, G, TG, spec.scaling,
        plan.kernel_capacity, spec.drop_policy, list(plan.sequence_lengths or ()), list(plan.kernel_sequence_capacity),
        plan.padded_capacity, spec.check_finite, provider or "",
    )  # fmt: skip
    r = Routing(
        indices=idx, weights=w, scores=s.detach(), tokens_per_expert=counts, row_map=rows, token_index=tok,
        dropped=rows < 0, num_experts=E, num_rows=tok.shape[0], capacity=plan.capacity, score=spec.score,
        sequence_lengths=plan.sequence_lengths, sequence_capacity=plan.sequence_capacity,
        padded=plan.padded_capacity >= 0,
    )  # fmt: skip
    return r if eager.compiling() else seal(r)  # (while torch.compile traces: nothing to seal)


def _check_bias(score_bias: object, logits: torch.Tensor, what: str) -> torch.Tensor:
    """The score bias as the custom op takes it (contiguous); a typed error for a bad one. Its values are
    checked by the op (:func:`check_bias_finite`), at run time."""
    E = logits.shape[1]
    bias = check_tensor(score_bias, what, "score_bias")
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
_cpu_kernels = eager.lazy_module("_moe_cpu")  # the cpu provider's kernels, for the fast paths


_ARANGE: dict[int, torch.Tensor] = {}  # CPU 0..n-1 per n, for the fast path (read only, never returned)


def _route_cpu(logits, T, E, k, score, renorm, bias, G, TG, c, cap, drop_policy, check_finite):
    """The cpu provider's route in one kernel call on fp32 contiguous CPU logits (and bias): (w, idx, s, counts,
    rows, tok, dropped, N)."""
    M = _cpu_kernels()
    if bias is not None:
        check_bias_finite(bias)
    i64 = torch.int64
    idx, w, s = torch.empty(T, k, dtype=i64), torch.empty(T, k), torch.empty(T, k)
    rows = torch.empty(T, k, dtype=i64)
    counts, tok, dropped = torch.empty(E, dtype=i64), torch.empty(T * k, dtype=i64), torch.empty(T, k, dtype=_BOOL)
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
        and eager.fast()  # (before the row count, a data-dependent size while torch.compile traces)
        and sealed_rows(routing) and not routing.padded and x.shape[0] == routing.indices.shape[0] and x.shape[1]
        and routing.num_rows and (tok := routing.token_index).is_cpu and routing.row_map.is_cpu
        and (sel := select(scatter_rows, x, provider or "", routing.row_map.shape[1])) in ("torch", "cpu")
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
                return eager.autograd_fast(permute_op, _permute_cpu_impl, x, routing.row_map, tok, provider or "",
                                            False)  # fmt: skip
            try:  # (the cpu provider's permute is torch's index_select: one pass over whole rows)
                return x.index_select(0, tok)
            except (IndexError, RuntimeError):
                pass  # an index out of range: the general path raises the typed error
    what = "torsh_kernels.moe_permute"
    check_provider(provider)
    routing = check_routing_of(routing, what, "rows")
    x = check_rows(x, routing.num_tokens, routing, what, "x", "T")
    check_strided(x, what, "x")
    return eager.call_autograd(permute_op, x.contiguous(), routing.row_map, routing.token_index, provider or "",
                                routing.padded)  # fmt: skip


def moe_unpermute(
    y_perm: torch.Tensor, routing: Routing, *, weights: bool = True, provider: str | None = None
) -> torch.Tensor:
    """Combine expert outputs ``y_perm [N, H]`` back to ``[T, H]`` in token order, weighted by
    ``routing.weights`` (unless ``weights=False``); differentiable in ``y_perm`` and the weights."""
    if (
        type(routing) is Routing and type(y_perm) is _T and y_perm.dtype is _F32 and y_perm.is_cpu
        and y_perm.dim() == 2 and eager.fast()  # (before the sizes: data-dependent while torch.compile traces)
        and y_perm.is_contiguous() and y_perm.shape[1] and sealed(routing)
        and (rows := routing.row_map).is_cpu and type(w := routing.weights) is _T and w.dtype is _F32 and w.is_cpu
        and rows.shape[0] and y_perm.shape[0] == routing.num_rows
        and rows.is_contiguous() and w.is_contiguous() and rows.dtype is torch.int64 and w.shape == rows.shape
        and select(gather_rows, y_perm, provider or "", rows.shape[1]) == "cpu"
    ):  # fmt: skip
        # The common case on the CPU with the cpu provider: its kernel into a new tensor; when a gradient is
        # needed, as the forward of the op's registered autograd.
        if torch.is_grad_enabled() and (y_perm.requires_grad or (weights and w.requires_grad)):
            return eager.autograd_fast(unpermute_op, _unpermute_cpu_impl, y_perm, rows, routing.token_index,
                                        w if weights else None, provider or "", routing.padded)  # fmt: skip
        M = _cpu_kernels()
        out = torch.empty(rows.shape[0], y_perm.shape[1])
        if M.gather_rows_ptr(y_perm.data_ptr(), y_perm.shape[0], y_perm.shape[1], rows.data_ptr(), rows.shape[0],
                             rows.shape[1], w.data_ptr(), bool(weights), out.data_ptr()):  # fmt: skip
            return out
    if (
        weights and type(routing) is Routing and type(y_perm) is _T and y_perm.dtype is _F32 and y_perm.is_cpu
        and y_perm.dim() == 2 and eager.fast()  # (before the sizes: data-dependent while torch.compile traces)
        and y_perm.is_contiguous() and (H := y_perm.shape[1]) and sealed(routing) and not routing.padded
        and (rows := routing.row_map).is_cpu and type(w := routing.weights) is _T and w.dtype is _F32 and w.is_cpu
        and (T := rows.shape[0]) and y_perm.shape[0] == routing.num_rows == T * (K := rows.shape[1])
        and max(16, (1 << 21) // (4 * H)) >= T
        and not (torch.is_grad_enabled() and (y_perm.requires_grad or w.requires_grad))
        and select(gather_rows, y_perm, provider or "", K) == "torch"
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
    routing = check_routing_of(routing, what, "weights")
    y_perm = check_rows(y_perm, routing.num_rows, routing, what, "y_perm", "N")
    check_strided(y_perm, what, "y_perm")
    w = routing.weights if weights else None
    return eager.call_autograd(
        unpermute_op, y_perm.contiguous(), routing.row_map, routing.token_index, w, provider or "", routing.padded
    )
