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
- ``moe_aux_loss(logits_or_probs, routing, scale=, groups=, count=)``: the Switch/GShard load-balancing loss.
  The T tokens form G groups (``groups=None``: one group of all T; an int S: consecutive groups of S
  tokens, S dividing T; a list/tuple of lengths >= 0 summing to T: consecutive groups of those lengths,
  e.g. ``routing.sequence_lengths``; an empty group has no tokens to balance and is left out). In
  group g of S_g tokens, ``c_ge`` is the number of the group's assignments (``routing.indices``, K per
  token) that chose expert e, counted before capacity drops (the loss penalises the router's choices; see
  below for a routing with a ``score_bias`` or groups), and ``P_ge`` the mean over the group's tokens of
  e's probability, from ``logits_or_probs`` (softmax of the logits for a softmax routing; for sigmoid, each
  token's scores divided by their sum; ``from_probs=True``: the values
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
  tokens (T = 0): 0. *With a ``score_bias`` or groups* (``routing.selection_options``) the default
  ``count="topk"`` counts each token's K highest *unbiased* scores instead of ``routing.indices``
  (recomputed: the route's top-K without the bias and the group limit), as Megatron-Core does
  (``compute_routing_scores_for_aux_loss``: a plain top-K, for ``aux_loss``, ``seq_aux_loss`` and
  ``global_aux_loss``) and DeepSeek-V3's paper (eq. 18); ``count="routed"`` counts the biased, group-limited
  ``routing.indices`` (the rule before; 2-3% apart on DeepSeek-V3-like routings). The expert bias's own
  update (``BiasBalancer``) still counts the routed, kept assignments (``tokens_per_expert``), as
  Megatron-Core's does. HF's masked form (``attention_mask``: the loss over the unmasked tokens) is not
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
over [T, E], every scale and grouping; see ``cpu_losses.py``).

Integer outputs are int64. ``routing.num_rows`` (N) is a host integer: with a capacity and no padding it
costs one device-to-host copy of the expert counts, which the permute needs anyway to size its output;
padded, it is E * capacity and nothing is read. ``sequence_lengths`` given as a tensor is read on the host.

The family's modules:

- ``api.py``: the public ops ``moe_route``, ``moe_permute``, ``moe_unpermute`` (validation, provider choice, the
  direct path) and their CPU fast paths; ``losses.py``: ``moe_aux_loss`` and ``moe_z_loss`` with their providers;
- ``custom.py``: the ``torsh::`` custom ops (``moe_route``, ``moe_permute``, ``moe_unpermute``,
  ``moe_unpermute_backward``), their fake implementations and registered autograd;
- ``router.py``: :class:`RouterSpec`, the route's validated options; ``routing.py``: :class:`Routing` (the
  contract every consumer reads, sealed by ``moe_route``), its checks and the capacity rule; ``checks.py``: the
  input checks the public ops share;
- ``reference.py``: the torch references (``*_ref``), the oracles of the tests;
- ``providers.py``: the implementations registered per provider; the kernels, one module per provider, imported on
  its first launch: ``triton.py``, ``numba.py`` (CUDA), ``cpu.py`` and ``cpu_losses.py`` (Numba's CPU target).
"""

from __future__ import annotations

from .api import moe_permute, moe_route, moe_unpermute
from .losses import moe_aux_loss, moe_z_loss
from .reference import (
    AUX_COUNTS,
    AUX_SCALES,
    moe_aux_loss_ref,
    moe_permute_ref,
    moe_route_ref,
    moe_unpermute_ref,
    moe_z_loss_ref,
)
from .router import CAPACITY_SCOPES, DROP_POLICIES, SCORES, RouterSpec
from .routing import Routing, check_routing, check_sequence_lengths, expert_capacity

__all__ = [
    "AUX_COUNTS",
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
