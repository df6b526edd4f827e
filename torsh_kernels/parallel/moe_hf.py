"""Hugging Face MoE blocks as :class:`~torsh_kernels.parallel.MoELayer`: ``MoELayer.from_hf(block)``.

Read by attribute (duck-typed; ``transformers`` is not imported), for the blocks of transformers 5, whose
experts are stacked: ``experts.gate_up_proj [E, 2I, H]`` (the gate rows first) and ``experts.down_proj
[E, H, I]``, each expert computing ``down_proj[e] @ (act(gate) * up)`` with ``gate, up = gate_up_proj[e] @ x``.
The layer's ``w_in [E, H, 2I]`` is ``gate_up_proj`` transposed (gate columns first, as torsh's SwiGLU reads
them) and ``w_out [E, I, H]`` ``down_proj`` transposed; the weights are copied.

==========================  =====================================================================================
block (its router)          routing in the layer
==========================  =====================================================================================
``MixtralSparseMoeBlock``   softmax, top-k, renormalised (always); ``router_jitter_noise`` must be 0
``Qwen2MoeSparseMoeBlock``  softmax, top-k, renormalised when ``norm_topk_prob``; the shared expert
                            (``shared_expert``, width ``shared_expert_intermediate_size``) with its sigmoid
                            gate (``shared_expert_gate``): ``shared_experts=1, shared_gate=True``
``OlmoeSparseMoeBlock``     softmax, top-k, renormalised when ``norm_topk_prob``
``DeepseekV3MoE``           sigmoid scores; ``e_score_correction_bias`` added for the selection only
                            (``expert_bias=True``, copied into ``layer.balancer.bias``); the best ``topk_group``
                            of ``n_group`` groups by the sum of their top-2 biased scores; renormalised when
                            ``norm_topk_prob``; times ``routed_scaling_factor`` (``scaling``); the shared experts
                            (``shared_experts``, one MLP of width ``moe_intermediate_size * n_shared_experts``)
``SwitchTransformers        softmax, top-1, not renormalised (the weight is the chosen probability); each
SparseMLP``                 expert keeps its first ``expert_capacity`` tokens per sequence (``capacity``,
                            ``capacity_scope="sequence"``, ``drop_policy="position"``: the rows of a [B, S, H]
                            input are the sequences; a dropped token's output is 0, as HF's); its experts
                            ``wo(act(wi(x)))``, ReLU or exact GELU; ``router_jitter_noise`` must be 0
==========================  =====================================================================================

DeepSeek-V3's router computes its logits in fp32 whatever the model's dtype: the layer does too (``router_fp32``).
Switch's router runs in ``router_dtype`` (fp32; Hugging Face keeps it in fp32), and the layer takes its dtype. The
other blocks' experts are stacked; their activation must be SiLU (torsh's gated expert is SwiGLU); the shared
experts' MLPs must have no bias terms. The blocks compute no loss themselves (Hugging Face adds the load-balancing
loss at the model level, from every layer's router logits), so the layer's ``aux_loss_coef`` and ``z_loss_coef``
default to 0 here; pass them (and any other constructor argument: ``dtype``, ``device``, ``capacity_factor``, ...)
as ``overrides``. Differences in rounding remain: DeepSeek-V3's router adds 1e-20 to the renormalising sum (torsh
does not), and its top-k order is unsorted (the output sums over the k experts, so it does not matter).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..errors import ArgumentTypeError, InvalidArgumentError

__all__ = ["HF_BLOCKS", "layer_from_hf"]

HF_BLOCKS = (
    "MixtralSparseMoeBlock",
    "Qwen2MoeSparseMoeBlock",
    "OlmoeSparseMoeBlock",
    "DeepseekV3MoE",
    "SwitchTransformersSparseMLP",
)
"""The Hugging Face blocks ``from_hf`` maps (by class name; the attributes are read as they are)."""

_WHAT = "MoELayer.from_hf"


def _attr(obj: Any, name: str, where: str) -> Any:
    try:
        return getattr(obj, name)
    except AttributeError:
        raise ArgumentTypeError(
            f"{_WHAT}: {where} has no attribute {name!r}; is this a transformers 5 block?"
        ) from None


def _is_silu(act: Any) -> bool:
    """Whether ``act`` computes SiLU (checked on a few values: Hugging Face's activation classes vary)."""
    if not callable(act):
        return False
    t = torch.linspace(-6.0, 6.0, 25)
    try:
        with torch.no_grad():
            return bool(torch.allclose(act(t), F.silu(t), rtol=1e-6, atol=1e-7))
    except Exception:
        return False


def _mlp_weights(mlp: nn.Module, where: str) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A Hugging Face gated MLP (gate_proj, up_proj, down_proj, act_fn) as torsh's shared expert:
    ``shared_w_in [H, 2S]`` (gate columns first), ``shared_w_out [S, H]`` and the width S."""
    lins = {n: _attr(mlp, n, where) for n in ("gate_proj", "up_proj", "down_proj")}
    for n, lin in lins.items():
        if getattr(lin, "bias", None) is not None:
            raise InvalidArgumentError(f"{_WHAT}: {where}.{n} has a bias; torsh's shared expert has none")
    if not _is_silu(_attr(mlp, "act_fn", where)):
        raise InvalidArgumentError(
            f"{_WHAT}: {where}.act_fn is {_attr(mlp, 'act_fn', where)!r}, not SiLU; torsh's gated expert is SwiGLU"
        )
    g, u, d = (lins[n].weight for n in ("gate_proj", "up_proj", "down_proj"))
    return torch.cat([g.t(), u.t()], dim=1), d.t(), g.shape[0]


def layer_from_hf(cls: type, block: nn.Module, overrides: dict[str, Any]) -> Any:
    """See the module docstring; ``cls`` is :class:`~torsh_kernels.parallel.MoELayer` (or a subclass)."""
    name = type(block).__name__
    if name not in HF_BLOCKS:
        raise ArgumentTypeError(
            f"{_WHAT}: block is a {name}; the blocks that map are {', '.join(HF_BLOCKS)} (transformers 5)"
        )
    if name == "SwitchTransformersSparseMLP":
        return _switch_layer(cls, block, overrides)
    gate, experts = _attr(block, "gate", name), _attr(block, "experts", name)
    router_w = _attr(gate, "weight", f"{name}.gate")
    gate_up, down = _attr(experts, "gate_up_proj", f"{name}.experts"), _attr(experts, "down_proj", f"{name}.experts")
    E, H = router_w.shape
    I2 = gate_up.shape[1]
    if gate_up.dim() != 3 or tuple(gate_up.shape) != (E, I2, H) or I2 % 2 or tuple(down.shape) != (E, H, I2 // 2):
        raise InvalidArgumentError(
            f"{_WHAT}: {name}'s experts are gate_up_proj {tuple(gate_up.shape)} and down_proj {tuple(down.shape)}; "
            f"expected [E={E}, 2I, H={H}] and [E, H, I] (transformers 5's stacked experts)"
        )
    if getattr(experts, "has_bias", False) or getattr(experts, "gate_up_proj_bias", None) is not None:
        raise InvalidArgumentError(f"{_WHAT}: {name}'s experts have bias terms; torsh's experts have none")
    if not _is_silu(_attr(experts, "act_fn", f"{name}.experts")):
        raise InvalidArgumentError(
            f"{_WHAT}: {name}'s experts use {experts.act_fn!r}, not SiLU; torsh's gated expert is SwiGLU (silu)"
        )
    k = int(_attr(gate, "top_k", f"{name}.gate"))
    kw: dict[str, Any] = dict(activation="swiglu", aux_loss_coef=0.0, z_loss_coef=0.0, dtype=gate_up.dtype,
                              device=gate_up.device)  # fmt: skip
    shared: tuple[torch.Tensor, torch.Tensor] | None = None
    gate_w = None
    if name == "MixtralSparseMoeBlock":
        jitter = float(getattr(block, "jitter_noise", 0.0) or 0.0)
        if jitter:
            raise InvalidArgumentError(
                f"{_WHAT}: the block multiplies its input by random jitter in training (router_jitter_noise="
                f"{jitter}), which torsh's layer does not; set the config's router_jitter_noise to 0"
            )
        kw.update(score="softmax", renormalize=True)
    elif name in ("Qwen2MoeSparseMoeBlock", "OlmoeSparseMoeBlock"):
        kw.update(score="softmax", renormalize=bool(_attr(gate, "norm_topk_prob", f"{name}.gate")))
        if name == "Qwen2MoeSparseMoeBlock":
            w_in, w_out, S = _mlp_weights(_attr(block, "shared_expert", name), f"{name}.shared_expert")
            gl = _attr(block, "shared_expert_gate", name)
            if getattr(gl, "bias", None) is not None or tuple(gl.weight.shape) != (1, H):
                raise InvalidArgumentError(f"{_WHAT}: {name}.shared_expert_gate must be Linear({H}, 1, bias=False)")
            shared, gate_w = (w_in, w_out), gl.weight
            kw.update(shared_experts=1, shared_ffn_hidden=S, shared_gate=True)
    else:  # DeepseekV3MoE
        n_group, topk_group = int(_attr(gate, "num_group", f"{name}.gate")), int(_attr(gate, "topk_group", name))
        kw.update(score="sigmoid", renormalize=bool(_attr(gate, "norm_topk_prob", f"{name}.gate")), expert_bias=True,
                  router_fp32=True,  # its gate: F.linear(x.float(), weight.float())
                  n_group=n_group, topk_group=topk_group,
                  scaling=float(_attr(gate, "routed_scaling_factor", f"{name}.gate")))  # fmt: skip
        w_in, w_out, S = _mlp_weights(_attr(block, "shared_experts", name), f"{name}.shared_experts")
        shared = (w_in, w_out)
        inner = I2 // 2  # the shared MLP is n_shared_experts experts side by side
        kw.update(shared_experts=S // inner if S % inner == 0 and inner <= S else 1, shared_ffn_hidden=S)
    kw.update(overrides)
    layer = cls(H, I2 // 2, E, k, **kw)
    with torch.no_grad():
        layer.router.weight.copy_(router_w)
        layer.w_in.copy_(gate_up.transpose(1, 2))
        layer.w_out.copy_(down.transpose(1, 2))
        if shared is not None and layer.shared_w_in is not None:
            layer.shared_w_in.copy_(shared[0])
            layer.shared_w_out.copy_(shared[1])
        if gate_w is not None and layer.shared_expert_gate is not None:
            layer.shared_expert_gate.weight.copy_(gate_w)
        if name == "DeepseekV3MoE" and layer.balancer is not None:
            layer.balancer.bias.copy_(_attr(gate, "e_score_correction_bias", f"{name}.gate"))
    return layer


def _act_name(act: Any) -> str | None:
    """Which of torsh's plain expert activations ``act`` computes ("relu", "gelu": exact), checked on values."""
    t = torch.linspace(-6.0, 6.0, 25)
    for name, fn in (("relu", F.relu), ("gelu", F.gelu)):
        try:
            with torch.no_grad():
                if torch.allclose(act(t), fn(t), rtol=1e-6, atol=1e-7):
                    return name
        except Exception:
            return None
    return None


def _switch_layer(cls: type, block: nn.Module, overrides: dict[str, Any]) -> Any:
    """Switch Transformers' sparse MLP: a top-1 softmax router whose weight is the selected probability (not
    renormalised), each expert keeping its first ``expert_capacity`` tokens *per sequence* (the batch rows of a
    [B, S, H] input; the others dropped: their output is 0), experts ``wo(act(wi(x)))`` with ReLU or GELU."""
    name = type(block).__name__
    router, experts = _attr(block, "router", name), _attr(block, "experts", name)
    clf = _attr(router, "classifier", f"{name}.router")
    if getattr(clf, "bias", None) is not None:
        raise InvalidArgumentError(
            f"{_WHAT}: {name}.router.classifier has a bias (router_bias); torsh's router has none"
        )
    jitter = float(getattr(router, "jitter_noise", 0.0) or 0.0)
    if jitter:
        raise InvalidArgumentError(
            f"{_WHAT}: the router multiplies its input by random jitter in training (router_jitter_noise={jitter}), "
            "which torsh's layer does not; set the router's jitter_noise (the config's router_jitter_noise) to 0"
        )
    E, H = clf.weight.shape
    mlps = [_attr(experts, f"expert_{e}", f"{name}.experts") for e in range(E)]
    wi = [_attr(m, "wi", f"{name}.experts.expert_{e}") for e, m in enumerate(mlps)]
    wo = [_attr(m, "wo", f"{name}.experts.expert_{e}") for e, m in enumerate(mlps)]
    F_ = wi[0].weight.shape[0]
    for e in range(E):
        if getattr(wi[e], "bias", None) is not None or getattr(wo[e], "bias", None) is not None:
            raise InvalidArgumentError(f"{_WHAT}: {name}.experts.expert_{e} has bias terms; torsh's experts have none")
        if tuple(wi[e].weight.shape) != (F_, H) or tuple(wo[e].weight.shape) != (H, F_):
            raise InvalidArgumentError(
                f"{_WHAT}: {name}.experts.expert_{e} has wi {tuple(wi[e].weight.shape)} and wo "
                f"{tuple(wo[e].weight.shape)}; expected [{F_}, {H}] and [{H}, {F_}] as expert_0's"
            )
    act = _act_name(_attr(mlps[0], "act", f"{name}.experts.expert_0"))
    if act is None:
        raise InvalidArgumentError(
            f"{_WHAT}: {name}'s experts use {mlps[0].act!r}; torsh's plain experts compute ReLU or exact GELU"
        )
    cap = int(_attr(router, "expert_capacity", f"{name}.router"))
    w = clf.weight
    kw: dict[str, Any] = dict(score="softmax", renormalize=False, capacity=cap, capacity_scope="sequence",
                              drop_policy="position", activation=act, aux_loss_coef=0.0, z_loss_coef=0.0,
                              dtype=w.dtype, device=w.device)  # fmt: skip
    kw.update(overrides)
    layer = cls(H, F_, E, 1, **kw)
    with torch.no_grad():
        layer.router.weight.copy_(w)
        layer.w_in.copy_(torch.stack([m.weight.T for m in wi]))
        layer.w_out.copy_(torch.stack([m.weight.T for m in wo]))
    return layer
