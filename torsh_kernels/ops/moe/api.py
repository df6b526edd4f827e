"""The MoE family's public ops: ``moe_route``, ``moe_permute`` and ``moe_unpermute`` (see the package docstring for
what they compute): each validates its inputs (typed errors), picks a provider and calls its custom op (``custom.py``)
directly where the dispatcher adds nothing (``eager``), or computes its common case on plain contiguous CPU tensors
through a fast path (the same kernels or torch calls on the same elements, so the same results)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ...errors import InvalidArgumentError
from .. import eager
from ..common import check_strided
from ..registry import check_provider
from .checks import ACT_DTYPES, check_bias, check_logits, check_routing_of, check_rows
from .custom import permute_op, route_op, unpermute_op
from .fast import ROUTE, gather_cpu, permute_cpu_impl, route_cpu, route_torch, unpermute_cpu_impl
from .providers import gather_rows, scatter_rows, select, topk
from .router import RouterSpec
from .routing import Routing, plan_capacity, seal, sealed, sealed_rows

__all__ = ["moe_permute", "moe_route", "moe_unpermute"]

_T = torch.Tensor
_F32 = torch.float32
_I64 = torch.int64


def moe_route(
    logits: torch.Tensor,
    spec: RouterSpec | None = None,
    *,
    score_bias: torch.Tensor | None = None,
    sequence_lengths: Sequence[int] | torch.Tensor | None = None,
    provider: str | None = None,
    **options: Any,
) -> Routing:
    """Route T tokens to K of E experts (see the package docstring, :mod:`torsh_kernels.ops.moe`).

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
        spec = RouterSpec.build(spec, options, ROUTE)
    if (
        eager.cpu_dense(logits) and logits.dim() == 2 and (T := logits.shape[0]) > 0
        and spec.k <= (E := logits.shape[1]) and sequence_lengths is None and spec.capacity_scope == "call"
        and not spec.pad_to_capacity and spec.capacity is None and (score_bias is None or eager.plain(score_bias))
    ):  # fmt: skip
        # The common cases on fp32 contiguous CPU logits (no fixed capacity, no sequences, no padding): the cpu
        # provider's route in one kernel call (with a gradient needed, as the forward of the op's registered
        # autograd), or torch's for small k without a gradient.
        if eager.picks(topk, logits.numel(), provider, "cpu"):
            return route_cpu(logits, spec, score_bias, provider, T, E)
        if (
            spec.k <= 8 and score_bias is None and not spec.grouped and spec.scaling == 1.0
            and spec.capacity_factor is None and not (logits.requires_grad and torch.is_grad_enabled())
            and eager.picks(topk, logits.numel(), provider, "torch")
        ):  # fmt: skip
            r = eager.run(route_torch, logits, T, E, spec.k, spec.score, spec.renormalize)
            if r is not None:
                return r
    return _route_checked(logits, spec, score_bias, sequence_lengths, provider)


def _route_checked(logits, spec: RouterSpec, score_bias, sequence_lengths, provider) -> Routing:
    """moe_route with every input checked (typed errors), on any device, dtype and provider."""
    what = ROUTE
    check_provider(provider)
    logits = check_logits(logits, what)
    check_strided(logits, what, "logits")
    T, E = logits.shape
    G, TG = spec.selection(E, what)
    bias = None if score_bias is None else check_bias(score_bias, logits, what)
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
        padded=plan.padded_capacity >= 0, selection_options=bias is not None or G > 0,
    )  # fmt: skip
    return r if eager.compiling() else seal(r)  # (while torch.compile traces: nothing to seal)


def moe_permute(x: torch.Tensor, routing: Routing, *, provider: str | None = None) -> torch.Tensor:
    """Rows of ``x [T, H]`` grouped by expert: ``[N, H]``, expert e's group holding its tokens in token
    order; differentiable (the backward sums each token's rows)."""
    if (
        type(routing) is Routing and type(x) is _T and x.dtype in ACT_DTYPES and x.is_cpu and x.dim() == 2
        and x.is_contiguous() and eager.fast()  # (before the row count: data-dependent while torch.compile traces)
        and sealed_rows(routing) and not routing.padded and x.shape[0] == routing.indices.shape[0] and x.shape[1]
        and routing.num_rows and (tok := routing.token_index).is_cpu and routing.row_map.is_cpu
        and (sel := select(scatter_rows, x, provider or "", routing.row_map.shape[1])) in ("torch", "cpu")
    ):  # fmt: skip
        # The common case on the CPU (any of the three dtypes; the cpu or torch provider, the family's choice with
        # its kernel limits): the provider's gather through the inverse map, into a new tensor instead of a
        # preallocated one; the cpu provider's also when a gradient is needed (as the forward of the op's
        # registered autograd).
        grad = x.requires_grad and torch.is_grad_enabled()
        if sel == "torch":
            if not grad:
                return x.index_select(0, tok)
        elif tok.dtype is _I64 and tok.numel() == routing.num_rows:
            if grad:
                return eager.autograd_fast(permute_op, permute_cpu_impl, x, routing.row_map, tok, provider or "",
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
        type(routing) is Routing and type(y_perm) is _T and y_perm.is_cpu and y_perm.dim() == 2
        and ((cpu := eager.picks(gather_rows, y_perm.numel(), provider, "cpu"))
             or eager.picks(gather_rows, y_perm.numel(), provider, "torch"))
        and eager.cpu_dense(y_perm)  # (after fast(): N is a data-dependent size while torch.compile traces)
        and (H := y_perm.shape[1]) and sealed(routing) and eager.cpu_dense(w := routing.weights)
        and (rows := routing.row_map).is_cpu and rows.dtype is _I64 and rows.is_contiguous() and (T := rows.shape[0])
        and y_perm.shape[0] == routing.num_rows and w.shape == rows.shape
    ):  # fmt: skip
        out = _unpermute_fast(cpu, y_perm, routing, rows, w, weights, provider, T, H)
        if out is not None:
            return out
    what = "torsh_kernels.moe_unpermute"
    check_provider(provider)
    routing = check_routing_of(routing, what, "weights")
    y_perm = check_rows(y_perm, routing.num_rows, routing, what, "y_perm", "N")
    check_strided(y_perm, what, "y_perm")
    w = routing.weights if weights else None
    return eager.call_autograd(
        unpermute_op, y_perm.contiguous(), routing.row_map, routing.token_index, w, provider or "", routing.padded
    )


def _unpermute_fast(cpu: bool, y_perm, routing: Routing, rows, w, weights: bool, provider, T: int, H: int):
    """moe_unpermute's common case, fp32 on the CPU with a sealed routing: the cpu provider's kernel into a new
    tensor (when a gradient is needed, as the forward of the op's registered autograd); or, for the torch provider
    without drops, one token block and no gradient, its fp32 multiply-adds, the K gathers done as one, into new
    tensors instead of its reused buffers. None: the general path (which raises what there is to raise)."""
    grad = torch.is_grad_enabled() and (y_perm.requires_grad or (weights and w.requires_grad))
    if cpu:
        if grad:
            return eager.autograd_fast(unpermute_op, unpermute_cpu_impl, y_perm, rows, routing.token_index,
                                        w if weights else None, provider or "", routing.padded)  # fmt: skip
        return gather_cpu(y_perm, rows, w if weights else None)
    K = rows.shape[1]
    if weights and not grad and not routing.padded and y_perm.shape[0] == T * K and max(16, (1 << 21) // (4 * H)) >= T:
        v = y_perm.index_select(0, rows.reshape(-1)).view(T, K, H)
        a = torch.mul(v[:, 0], w[:, 0:1])
        for j in range(1, K):
            a.addcmul_(v[:, j], w[:, j : j + 1])
        return a
    return None
