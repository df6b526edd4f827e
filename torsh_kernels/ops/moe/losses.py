"""The MoE router losses: ``moe_aux_loss`` (the load-balancing loss, per call or per sequence group) and
``moe_z_loss`` (ST-MoE's router z-loss), with their providers (torch: the references, which autograd
differentiates and torch.compile fuses; cpu: fused forward kernels). Re-exported by :mod:`torsh_kernels.ops.moe`."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...checks import check_choice
from ...errors import DeviceMismatchError, ShapeError
from .. import eager
from ..common import check_strided, check_tensor, on_device
from ..registry import Op
from .checks import check_act_dtype, check_logits, check_routing_of
from .providers import select, topk
from .reference import AUX_COUNTS, AUX_SCALES, aux_loss_of, aux_probs, check_groups, choose_ref, moe_z_loss_ref
from .routing import Routing

__all__ = ["moe_aux_loss", "moe_z_loss"]

_cpu_kernels = eager.lazy_module("moe.cpu_losses")  # the cpu provider's kernels


def moe_aux_loss(
    logits_or_probs: torch.Tensor,
    routing: Routing,
    *,
    from_probs: bool = False,
    scale: str = "balanced-one",
    groups: int | Sequence[int] | None = None,
    count: str = "topk",
    provider: str | None = None,
) -> torch.Tensor:
    """The load-balancing loss: the mean over token groups of ``E * sum_e f_ge * P_ge`` (fp32 scalar,
    differentiable in the input; see the module docstring).

    Args:
        logits_or_probs: the [T, E] router logits (scored like the routing: softmax, or sigmoid scores
            divided by their sum per token) or, with ``from_probs=True``, probabilities the caller already
            computed. With a ``score_bias`` routing, the unbiased logits.
        routing: the :class:`Routing` of these logits. Without a ``score_bias`` or groups its ``indices``
            (before capacity drops) are counted.
        scale: "balanced-one" (``f_ge = c_ge / (K * S_g)``: 1.0 when balanced) or "hf" (``c_ge / S_g``,
            K times that: Hugging Face's Mixtral / Qwen2-MoE / OLMoE ``load_balancing_loss_func``, and
            Switch Transformers' with ``groups``).
        groups: None (all T tokens one group), an int group size S dividing T, or a list/tuple of the
            lengths of consecutive groups summing to T (the sequence lengths: DeepSeek-V3's sequence-wise
            loss, Megatron's ``seq_aux_loss``; ``routing.sequence_lengths``). The loss is the unweighted mean
            of the non-empty groups' losses.
        count: which selection ``c_ge`` counts when a ``score_bias`` or groups chose the routing's experts
            (``routing.selection_options``): "topk" (the default, Megatron-Core's and DeepSeek-V3's rule) each
            token's K highest unbiased scores (the top-K of ``logits_or_probs``, scored as above: the route's
            top-K without the bias and the groups, equal scores to the lower expert); "routed" the routing's
            ``indices``, the biased, group-limited choices (the rule before issue 41). Without selection options both
            are ``routing.indices``.
        provider: "cpu" (one kernel forward and one backward, CPU tensors) or "torch" (plain torch, which
            autograd differentiates and ``torch.compile`` fuses); None selects automatically.
    """
    what = "torsh_kernels.moe_aux_loss"
    routing = check_routing_of(routing, what, "experts")
    x = check_tensor(logits_or_probs, what, "logits_or_probs")
    check_act_dtype(x, what, "logits_or_probs")
    if tuple(x.shape) != (routing.num_tokens, routing.num_experts):
        raise ShapeError(
            f"{what}: logits_or_probs has shape {tuple(x.shape)}; the routing is for "
            f"[T={routing.num_tokens}, E={routing.num_experts}]"
        )
    if not (x.is_cpu and routing.indices.is_cpu) and x.device != routing.indices.device:
        raise DeviceMismatchError(f"{what}: logits_or_probs is on {x.device}, the routing on {routing.indices.device}")
    if not x.is_contiguous():
        check_strided(x, what, "logits_or_probs")
    if scale != "balanced-one":
        check_choice(scale, what, "scale", AUX_SCALES)
    if groups is not None:
        groups = check_groups(groups, routing.num_tokens, what)
    if count != "topk":
        check_choice(count, what, "count", AUX_COUNTS)
    name = _loss_provider(_aux_loss, x, provider)
    idx = routing.indices
    if count == "topk" and routing.selection_options:
        idx = _plain_topk(x, routing, bool(from_probs), name)
    return _aux_loss(name, x, routing, idx, bool(from_probs), scale, groups)


def _plain_topk(x: torch.Tensor, routing: Routing, from_probs: bool, loss_provider: str) -> torch.Tensor:
    """[T, K] int64: each token's K highest unbiased scores of ``x`` (logits scored as ``routing.score``, or the
    probabilities given), equal scores to the lower expert: the route's top-K without a bias or groups, on the
    route's provider for the device (the torch one with the torch loss, while compiling and for meta tensors)."""
    K = routing.k
    if from_probs:
        return choose_ref(x.detach().float(), K).to(routing.indices.device)
    xd = x.detach().contiguous()
    name = "torch" if loss_provider == "torch" else select(topk, xd, "", K, routing.num_experts)
    with on_device(xd.device):
        idx = topk(name, xd, K, routing.score, False, None, 0, 0, 1.0)[0]
    return idx.to(routing.indices.device)


def moe_z_loss(logits: torch.Tensor, *, provider: str | None = None) -> torch.Tensor:
    """The router z-loss ``mean_t logsumexp(logits[t])**2`` (fp32 scalar, differentiable). ``provider`` as
    for :func:`moe_aux_loss`."""
    logits = check_logits(logits, "torsh_kernels.moe_z_loss")
    check_strided(logits, "torsh_kernels.moe_z_loss", "logits")
    return _z_loss(_loss_provider(_z_loss, logits, provider), logits)


# The losses' providers: torch (the references: autograd differentiates them, torch.compile fuses them)
# and, on the CPU, one kernel forward and one backward (an autograd Function; a backward that must itself be
# differentiable, create_graph=True, runs the same gradient formula in torch ops). Under torch.compile, a
# mode, or for a tensor subclass the torch formulas run.
_aux_loss = Op("moe_aux_loss")
_z_loss = Op("moe_z_loss")
_aux_loss.register("torch")(
    lambda x, routing, idx, from_probs, scale, groups: aux_loss_of(
        aux_probs(x, routing, from_probs), idx, routing.num_experts, routing.k if scale == "balanced-one" else 1, groups
    )
)
_z_loss.register("torch")(moe_z_loss_ref)


def _loss_kernel_ok(x: torch.Tensor) -> bool:
    return eager.plain(x) and x.shape[0] > 0 and eager.fast()


def _loss_provider(op, x: torch.Tensor, provider: str | None) -> str:
    if eager.compiling() or x.is_meta:  # the torch formula (dynamo traces it; meta: shapes only); no selection
        op.check_traced(x.device, provider)  # state read while tracing
        return "torch"
    name = op.select(x.device, x.dtype, x.numel(), provider or None)
    return "torch" if name == "cpu" and not _loss_kernel_ok(x) else name


@_aux_loss.register("cpu")
def _aux_loss_cpu(x, routing, idx, from_probs, scale, groups):
    M = _cpu_kernels()
    mode = M.PROBS if from_probs else M.SOFTMAX if routing.score == "softmax" else M.SIGMOID
    kf = routing.k if scale == "balanced-one" else 1
    return M.aux_loss(x.float().contiguous(), mode, idx, kf, groups)


@_z_loss.register("cpu")
def _z_loss_cpu(x):
    M = _cpu_kernels()
    return M.z_loss(x.float().contiguous())
