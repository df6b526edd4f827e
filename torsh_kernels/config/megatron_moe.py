"""Megatron-Core's MoE settings as :class:`~torsh_kernels.parallel.MoELayer` arguments: the router, the
load-balancing losses, the capacity, the shared experts, the sizes, the activation, expert parallelism.
"""

from __future__ import annotations

from typing import Any

from ..errors import TorshKernelsError
from ..parallel import MoESpec
from ..parallel.moe_spec import MAX_EXPERTS  # the layer's own bound
from .common import BAD, F32_MAX, Walk, check_bool, check_choice, check_int, check_num, short_value, show_value
from .migration import Migration

__all__ = ["MAX_EXPERTS", "MAX_WIDTH", "MOE_HANDLED", "MOE_OFF", "map_moe", "same_value"]

MAX_WIDTH = 2**20
"""The widest hidden or expert size accepted: one [hidden, ffn] weight at 2**20 x 2**20 is 2**40 elements (4 TiB
in fp32), far beyond any model's (hidden sizes in use are at most a few ten thousand)."""
_EXPERTS_WHY = "MoE layers in use have at most a few hundred experts; see parallel.moe_spec.MAX_EXPERTS"
_CAPACITY_WHY = (
    "a factor of E or more drops no token (an expert's capacity is then at least the number of tokens), and E is "
    f"at most {MAX_EXPERTS}"
)
_WIDTH_WHY = "widths in use are at most a few ten thousand; see config.megatron_moe.MAX_WIDTH"


_MEGATRON_DEFAULTS = {  # TransformerConfig's defaults (megatron/core/transformer/transformer_config.py)
    "moe_router_topk": 2,
    "moe_router_score_function": "softmax",
    "moe_router_pre_softmax": False,
    "moe_router_load_balancing_type": "aux_loss",
    "moe_aux_loss_coeff": 0.0,
    "moe_z_loss_coeff": None,
    "moe_expert_capacity_factor": None,
    "moe_token_drop_policy": "probs",
    "add_bias_linear": True,
}
MOE_OFF = {  # MoE settings torsh has no equivalent for: the value that turns them off maps
    "moe_input_jitter_eps": (None, "input jitter (noise on the router's input)"),
    "moe_router_topk_limited_devices": (None, "device-limited routing (deprecated: moe_router_num_groups maps)"),
    "moe_apply_probs_on_input": (
        False,
        "scaling the experts' input by the router probability (torsh scales their output)",
    ),
    "moe_latent_size": (None, "latent projections around the experts"),
    "moe_expert_rank_capacity_factor": (None, "a capacity per expert rank"),
    "moe_token_dropping": (False, "the deprecated token-dropping switch (moe_expert_capacity_factor maps)"),
    "moe_n_hash_layers": (0, "hash routing"),
    "moe_router_force_load_balancing": (False, "benchmark-only random routing"),
    "moe_router_force_biased": (None, "benchmark-only random routing bias"),
    "moe_enable_routing_replay": (False, "routing replay"),
    # the experts' activation, beyond its name
    "glu_linear_offset": (0.0, "an offset in the gated unit, act(x W1) * (x W3 + offset)"),
    "activation_func_clamp_value": (None, "clamping the experts' first projection"),
}
MOE_HANDLED = frozenset(
    (
        "num_moe_experts",
        "num_experts",
        "moe_router_topk",
        "moe_router_score_function",
        "moe_router_pre_softmax",
        "moe_router_topk_scaling_factor",
        "moe_router_load_balancing_type",
        "moe_aux_loss_coeff",
        "moe_z_loss_coeff",
        "moe_expert_capacity_factor",
        "moe_token_drop_policy",
        "moe_pad_expert_input_to_capacity",
        "moe_ffn_hidden_size",
        "ffn_hidden_size",
        "hidden_size",
        "gated_linear_unit",
        "activation_func",
        "swiglu",
        "squared_relu",
        "add_bias_linear",
        "expert_model_parallel_size",
        "expert_tensor_parallel_size",
        "moe_router_dtype",
        "moe_router_enable_expert_bias",
        "moe_router_bias_update_rate",
        "moe_router_num_groups",
        "moe_router_group_topk",
        "moe_shared_expert_intermediate_size",
        "moe_shared_expert_gate",
    )
)


def same_value(v: Any, default: Any) -> bool:
    try:
        return type(v) is type(default) and bool(v == default)
    except Exception:  # a value whose == is not a bool (a tensor)
        return False


def _get(w: Walk, a: dict, key: str) -> Any:
    """The input's value for ``key``, else Megatron-Core's default (noted)."""
    if w.take(a, key):
        return a[key]
    v = _MEGATRON_DEFAULTS[key]
    w.note(key, f"{'left out' if key in a else 'not given'}: Megatron-Core's default, {v!r}")
    return v


def map_moe(w: Walk, a: dict, m: Migration) -> None:
    """The MoE layer's settings: ``m.moe`` (where every one of them maps) and ``m.expert_parallel_size``."""
    experts = _m_experts(w, a)
    if experts is None:
        return
    _m_off(w, a)
    kw: dict[str, Any] = {"num_experts": experts}
    k, score = _m_router(w, a, kw, experts)
    _m_scaling(w, a, kw)
    _m_bias(w, a, kw, score)
    _m_groups(w, a, kw, experts, k)
    _m_shared(w, a, kw)
    _m_losses(w, a, kw)
    _m_capacity(w, a, kw)
    _m_sizes(w, a, kw)
    _m_activation(w, a, kw)
    _m_bias_linear(w, a)
    _m_router_dtype(w, a, kw)
    _m_expert_parallel(w, a, m, experts)
    if all(v is not BAD for v in kw.values()) and _m_buildable(w, a, kw):
        m.moe = kw


def _m_buildable(w: Walk, a: dict, kw: dict) -> bool:
    """Whether MoELayer's spec accepts the mapped arguments (checked at import, without building a layer: a
    missing hidden or ffn_hidden stands in as 1); a refusal is recorded under the number of experts' key."""
    options = {k: v for k, v in kw.items() if k not in ("hidden", "ffn_hidden", "num_experts", "k")}
    shape = (kw.get("hidden", 1), kw.get("ffn_hidden", 1), kw["num_experts"], kw["k"])
    try:
        MoESpec.of(shape, None, options, "MoELayer")
    except TorshKernelsError as e:
        w.bad("num_moe_experts" if "num_moe_experts" in a else "num_experts", f"the MoE settings together: {e}")
        return False
    return True


def _m_experts(w: Walk, a: dict) -> int | None:
    """The number of experts (either spelling), or None: no MoE layer, and every MoE setting is skipped."""
    experts = None
    unset = []
    for key in ("num_moe_experts", "num_experts"):
        if not w.take(a, key):
            continue
        if a[key] is None:
            unset.append(key)
            continue
        e = check_int(w, key, a[key], 1, MAX_EXPERTS, _EXPERTS_WHY)
        if e is not BAD and experts is not None and e != experts:
            w.bad(key, f"{e} contradicts the other number of experts, {experts}")
        elif e is not BAD:
            experts = e
            w.map(key, "moe['num_experts']")
    if experts is not None:
        for key in unset:
            w.skip(key, "None; the number of experts is the other spelling's")
        return experts
    why = "no MoE layer: the number of experts (num_moe_experts, or num_experts) is not set"
    for key in sorted((MOE_HANDLED | set(MOE_OFF)) & set(a)):
        if key not in w.ignored and key not in w.errors:
            w.skip(key, why)
    return None


def _m_off(w: Walk, a: dict) -> None:
    """The settings torsh has no equivalent for: skipped where off, refused otherwise."""
    for key, (off, what) in MOE_OFF.items():
        if w.take(a, key):
            v = a[key]
            if same_value(v, off) or (isinstance(off, float) and same_value(v, int(off))):
                w.skip(key, f"{v!r}: {what} is off")
            else:
                w.bad(key, f"{show_value(v)}: {what} has no torsh equivalent (only {off!r} maps)")


def _m_router(w: Walk, a: dict, kw: dict, experts: int) -> tuple[Any, Any]:
    """``k``, ``score`` and ``renormalize``; returns k and the score function (either may be BAD)."""
    k = check_int(w, "moe_router_topk", _get(w, a, "moe_router_topk"), 1, experts, "the number of experts")
    kw["k"] = k
    score = check_choice(
        w, "moe_router_score_function", _get(w, a, "moe_router_score_function"), ("softmax", "sigmoid")
    )
    kw["score"] = score
    pre = check_bool(w, "moe_router_pre_softmax", _get(w, a, "moe_router_pre_softmax"))
    if score == "softmax" and pre is not BAD:
        # pre-softmax: a softmax over all experts, then the top k, not renormalised; otherwise the top k of the
        # logits, then a softmax over those k, which is the renormalised full softmax
        kw["renormalize"] = not pre
        w.map("moe_router_pre_softmax", f"moe['renormalize'] = {not pre}")
    elif score == "sigmoid" and k is not BAD:
        kw["renormalize"] = k > 1  # Megatron divides the k sigmoid scores by their sum only when k > 1
        w.map(
            "moe_router_pre_softmax",
            "no effect with sigmoid scores (Megatron-Core takes the sigmoid before the top k either way)",
        )
        w.note(
            "moe_router_score_function",
            f"'sigmoid' with k={k}: renormalize={k > 1}, as Megatron-Core divides "
            "the k scores by their sum only when k > 1",
        )
    if k is not BAD:
        w.map("moe_router_topk", "moe['k']")
    if score is not BAD:
        w.map("moe_router_score_function", "moe['score']")
    return k, score


def _m_scaling(w: Walk, a: dict, kw: dict) -> None:
    key = "moe_router_topk_scaling_factor"
    if not w.take(a, key):
        return
    f = a[key]
    if f is None:
        w.skip(key, "None: no scaling")
    elif (f := check_num(w, key, f, 0.0, strict=True)) is not BAD:
        if f != 1.0:
            kw["scaling"] = f
        w.map(key, f"moe['scaling'] = {f}" if f != 1.0 else "1.0: no scaling (moe['scaling'] stays 1.0)")
        if f != 1.0:
            w.note(
                key,
                "the combine weights are multiplied by it after any renormalisation, as Megatron-Core's "
                "topk_routing_with_score_function does (for every score function, whatever "
                "moe_router_pre_softmax: its docstring's 'only with pre-softmax' is not what its code does)",
            )


def _m_bias_linear(w: Walk, a: dict) -> None:
    bias = check_bool(w, "add_bias_linear", _get(w, a, "add_bias_linear"))
    if bias is True:
        w.bad(
            "add_bias_linear",
            "true: Megatron's experts then have bias terms, torsh's have none (train with "
            "--disable-bias-linear, add_bias_linear=False)",
        )
    elif bias is False:
        w.map("add_bias_linear", "false: experts without bias terms, as torsh's")


def _m_router_dtype(w: Walk, a: dict, kw: dict) -> None:
    key = "moe_router_dtype"
    if not w.take(a, key):
        return
    d = a[key]
    if d is None or d in ("fp32", "fp64"):
        if d is not None:
            kw["router_fp32"] = True
        w.map(key, "router_fp32: the router's logits in fp32" if d else
              "the logits in the layer's dtype; torsh computes the scores and combine weights in fp32")  # fmt: skip
        if d != "fp32":
            w.note(key, f"{d!r}: Megatron then routes in " + ("fp64" if d else "the logits' dtype") + "; torsh in fp32")
    else:
        w.bad(key, f"must be None, 'fp32' or 'fp64', got {show_value(d)}")


def _m_losses(w: Walk, a: dict, kw: dict) -> None:
    key, ckey = "moe_router_load_balancing_type", "moe_aux_loss_coeff"
    kind, coeff = _get(w, a, key), _get(w, a, ckey)
    kinds = kind if isinstance(kind, list) else [kind]
    coeffs = coeff if isinstance(coeff, list) else [coeff]
    kw["aux_loss_coef"] = BAD
    if len(kinds) != len(coeffs):
        w.bad(key, f"{len(kinds)} load-balancing types and {len(coeffs)} coefficients ({ckey})")
        return
    active: dict[str, float] = {}  # the losses with a coefficient, each kind's coefficients summed
    for t, c in zip(kinds, coeffs):
        c = check_num(w, ckey, c)
        t = check_choice(w, key, t, ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none"))
        if c is BAD or t is BAD:
            return
        if t == "sinkhorn":
            w.bad(key, "'sinkhorn' routes by Sinkhorn balancing, which torsh does not do")
            return
        if t == "global_aux_loss" and c:
            w.bad(
                key,
                f"'global_aux_loss' with coefficient {c}: torsh's load-balancing losses are the micro-batch one "
                "('aux_loss', Switch/GShard) and the per-sequence one ('seq_aux_loss'), not one over the global batch",
            )
            return
        if t in ("aux_loss", "seq_aux_loss") and c:
            active[t] = active.get(t, 0.0) + c
        elif t == "none" and c:
            w.note(key, f"'none': no load-balancing loss, so {ckey}={c} has no effect")
    if any(c > F32_MAX for c in active.values()):
        w.bad(ckey, f"the coefficients of one loss sum to more than {F32_MAX:g}")
        return
    if len(active) > 1:
        w.bad(
            key, "'aux_loss' and 'seq_aux_loss' both with a coefficient: torsh's layer weighs one load-balancing loss"
        )
        return
    kind = next(iter(active), "aux_loss")
    kw["aux_loss_coef"] = active.get(kind, 0.0)
    if kind == "seq_aux_loss":
        kw["load_balancing"] = "seq_aux_loss"
    w.map(key, "which loss moe['aux_loss_coef'] weighs" + (" (moe['load_balancing'] = 'seq_aux_loss')" if active
                                                           and kind == "seq_aux_loss" else ""))  # fmt: skip
    w.map(ckey, "moe['aux_loss_coef']")
    if kind == "aux_loss" and active:
        w.note(
            ckey,
            "the Switch/GShard loss coeff * E * sum_e f_e * P_e over the tokens of one forward call, f_e "
            "counted before capacity drops, as Megatron's switch_load_balancing_loss_func (which counts "
            "the micro-batch's tokens of its tensor- and context-parallel group); in layer.aux_loss, to "
            "add to the training loss",
        )
    elif active:
        w.note(
            ckey,
            "'seq_aux_loss': the mean over the forward's sequences of the Switch/GShard loss of each sequence "
            "(DeepSeek-V3's sequence-wise loss, Megatron-Core's seq_aux_loss); torsh's sequences are consecutive "
            "rows: pass [batch, seq, hidden] inputs or sequence_lengths (Megatron's [seq, batch] layout "
            "interleaves them)",
        )
    z = _get(w, a, "moe_z_loss_coeff")
    kw["z_loss_coef"] = 0.0 if z is None else check_num(w, "moe_z_loss_coeff", z)
    if kw["z_loss_coef"] is not BAD:
        w.map("moe_z_loss_coeff", "moe['z_loss_coef'] (ST-MoE's mean logsumexp^2, as Megatron's z_loss_func)")


def _m_capacity(w: Walk, a: dict, kw: dict) -> None:
    key, pkey = "moe_expert_capacity_factor", "moe_token_drop_policy"
    cap = _get(w, a, key)
    if cap is not None:
        cap = check_num(w, key, cap, 0.0, strict=True, hi=MAX_EXPERTS, why=_CAPACITY_WHY)
    kw["capacity_factor"] = cap
    policy = check_choice(w, pkey, _get(w, a, pkey), ("probs", "position"))
    kw["drop_policy"] = {"probs": "probability", "position": "position"}.get(policy, policy)
    if cap is not BAD:
        w.map(key, "moe['capacity_factor']" + (" (None: dropless)" if cap is None else ""))
    if policy is not BAD:
        w.map(pkey, f"moe['drop_policy'] = {kw['drop_policy']!r}")
    if cap is not None and cap is not BAD:
        w.note(
            key,
            "C = ceil(T * k * factor / E) assignments per expert, T the tokens of one forward call "
            "(Megatron: of the micro-batch on this rank), as Megatron's get_capacity",
        )
        if policy == "probs" and kw.get("renormalize"):
            w.note(
                pkey,
                "'probs': an overfull expert keeps its highest-scoring assignments; torsh ranks them by the "
                "router score before renormalisation (the full softmax or the sigmoid), Megatron by the "
                "renormalised probability, so with k > 1 the dropped assignments can differ",
            )
        elif policy == "position":
            w.note(
                pkey,
                "'position': torsh keeps each expert's first C assignments in token order, what Megatron "
                "documents (its top-k over equal values promises no order)",
            )
    key = "moe_pad_expert_input_to_capacity"
    if w.take(a, key):
        pad = check_bool(w, key, a[key])
        if pad is True and cap is None:
            w.skip(key, "true, but without moe_expert_capacity_factor it has no effect (as in Megatron-Core)")
        elif pad is True and cap is not BAD:
            kw["pad_to_capacity"] = True
            w.map(
                key,
                "moe['pad_to_capacity'] = True: every expert's rows padded with zero rows to its capacity (the "
                "padding carries no weight: the output is the same; in ExpertParallelMoE the all-to-all splits "
                "are then static)",
            )
        elif pad is False:
            w.skip(key, "false: no padding")


def _m_bias(w: Walk, a: dict, kw: dict, score: Any) -> None:
    key, rkey = "moe_router_enable_expert_bias", "moe_router_bias_update_rate"
    on = check_bool(w, key, a[key]) if w.take(a, key) else None
    if on is True and score == "softmax":
        on = w.bad(
            key,
            "true with softmax scores: Megatron-Core refuses an expert bias with softmax (the bias is added to sigmoid "
            "scores); set moe_router_score_function='sigmoid'",
        )
    if on is True:
        kw["expert_bias"] = True
        w.map(
            key,
            "moe['expert_bias'] = True: a BiasBalancer (layer.balancer) whose bias is added to the scores for the "
            "selection only; call layer.update_expert_bias() once per optimizer step (Megatron-Core updates it "
            "in finalize_model_grads)",
        )
        w.note(
            key,
            "bias += rate * sign(mean load - load), the load summed over the training forwards since the last "
            "update and over the balancer's communicator: ExpertParallelMoE's group by default, or bias_comm= "
            "(Megatron-Core sums over the tensor-, context- and data-parallel group)",
        )
    elif on is False:
        w.skip(key, "false: no expert bias")
    if w.take(a, rkey):
        if on is True:
            rate = check_num(w, rkey, a[rkey], 0.0, hi=1.0, why="the bias shifts scores in [0, 1]")
            if rate is not BAD:
                kw["bias_update_rate"] = rate
                w.map(rkey, "moe['bias_update_rate']")
        else:
            w.skip(rkey, "read only with moe_router_enable_expert_bias")
    elif on is True:
        kw["bias_update_rate"] = 1e-3
        w.note(rkey, "not given: Megatron-Core's default, 0.001")


def _m_groups(w: Walk, a: dict, kw: dict, experts: int, k: Any) -> None:
    nkey, gkey = "moe_router_num_groups", "moe_router_group_topk"
    n = a[nkey] if w.take(a, nkey) else None
    g = a[gkey] if w.take(a, gkey) else None
    if g is None or g is False or (type(g) is int and g == 0):  # Megatron-Core groups only when it is set
        for key in (nkey, gkey):
            if key in a and key not in w.ignored:
                w.skip(key, f"{short_value(a[key])}: no group-limited routing (it needs moe_router_group_topk)")
        return
    g = check_int(w, gkey, g, 1, experts, "the number of experts")
    if n is None:
        n = w.bad(nkey, "not set, but moe_router_group_topk is")
    else:
        n = check_int(w, nkey, n, 1, experts, "the number of experts")
    if g is BAD or n is BAD or k is BAD:
        return
    if experts % n:
        w.bad(nkey, f"{n} groups do not divide the {experts} experts")
        return
    if g > n:
        w.bad(gkey, f"{g} exceeds the {n} groups (moe_router_num_groups)")
        return
    t, size = k // g, experts // n
    if t != min(2, size):
        w.bad(
            gkey,
            f"Megatron-Core scores a group by the sum of its top moe_router_topk // moe_router_group_topk = {t} "
            f"scores, torsh (DeepSeek-V3, Hugging Face) by its top {min(2, size)}: only settings where the two agree "
            "map (moe_router_topk = 2 * moe_router_group_topk, as DeepSeek-V3's 8 experts from 4 groups)",
        )
        return
    kw["n_group"], kw["topk_group"] = n, g
    w.map(nkey, "moe['n_group']")
    w.map(gkey, "moe['topk_group']: the best groups by the sum of their top-2 (biased) scores, then the top k in them")


def _m_shared(w: Walk, a: dict, kw: dict) -> None:
    skey, gkey = "moe_shared_expert_intermediate_size", "moe_shared_expert_gate"
    size = a[skey] if w.take(a, skey) else None
    gate = check_bool(w, gkey, a[gkey]) if w.take(a, gkey) else None
    if size is None:
        if skey in a and skey not in w.ignored:
            w.skip(skey, "None: no shared experts")
        if gate is not None and gate is not BAD:
            w.skip(gkey, f"{gate}: no shared expert to gate (Megatron-Core reads it only with shared experts)")
        return
    if check_int(w, skey, size, 1, MAX_WIDTH, _WIDTH_WHY) is BAD:
        return
    kw["shared_experts"], kw["shared_ffn_hidden"] = 1, size
    w.map(
        skey,
        "moe['shared_experts'] = 1 with moe['shared_ffn_hidden']: one dense MLP of that total width (Megatron's "
        "num_shared_experts * width), the experts' activation, on every token, added to the routed output",
    )
    if gate is True:
        kw["shared_gate"] = True
        w.map(gkey, "moe['shared_gate'] = True: the shared output times sigmoid(x w_gate), as SharedExpertMLP's gate")
    elif gate is False:
        w.skip(gkey, "false: no gate on the shared expert")


def _m_sizes(w: Walk, a: dict, kw: dict) -> None:
    if w.take(a, "hidden_size"):
        h = a["hidden_size"]
        if h is None or (type(h) is int and h == 0):  # TransformerConfig's default is 0: not given
            w.skip("hidden_size", f"{h!r}: not given; pass moe_layer(hidden=...)")
        elif check_int(w, "hidden_size", h, 1, MAX_WIDTH, _WIDTH_WHY) is not BAD:
            kw["hidden"] = h
            w.map("hidden_size", "moe['hidden']")
    ffn = None
    for key in ("moe_ffn_hidden_size", "ffn_hidden_size"):
        if not w.take(a, key):
            continue
        if a[key] is None:
            w.skip(key, "None: not given")
        elif check_int(w, key, a[key], 1, MAX_WIDTH, _WIDTH_WHY) is not BAD:
            if ffn is None:
                ffn = a[key]
                w.map(key, "moe['ffn_hidden']")
            else:
                w.skip(key, "the dense layers' width; the experts' is moe_ffn_hidden_size")
    if ffn is None and "hidden" in kw:
        ffn = 4 * kw["hidden"]
        w.note("ffn_hidden_size", f"not given: Megatron-Core's default, 4 * hidden_size = {ffn}")
    if ffn is not None:
        kw["ffn_hidden"] = ffn


def _m_activation(w: Walk, a: dict, kw: dict) -> None:
    """Megatron's experts compute fc2(act(fc1 x)), gated: fc2(act(x W1) * (x W3)). TransformerConfig says it
    with gated_linear_unit and activation_func, Megatron's arguments with --swiglu / --squared-relu."""
    keys = [k for k in ("gated_linear_unit", "activation_func", "swiglu", "squared_relu") if w.take(a, k)]
    gated, act, ok = False, "gelu", True
    for key in keys:
        v = a[key]
        if key == "activation_func":
            name = getattr(v, "__name__", None)
            if name in ("gelu", "silu", "relu"):
                act = name
            else:
                w.bad(key, f"{short_value(v)}: torsh's experts use silu (gated: SwiGLU), gelu or relu")
                ok = False
        elif check_bool(w, key, v) is BAD:
            ok = False
        elif key == "squared_relu" and v:
            w.bad(key, "true: torsh's experts have no squared ReLU")
            ok = False
        elif v:
            gated = True
            if key == "swiglu":
                act = "silu"
    if not ok:
        kw["activation"] = BAD
        return
    if not keys:
        w.note("activation_func", "not given: Megatron-Core's default, gelu without a gate")
    if gated and act == "silu":
        kw["activation"] = "swiglu"
    elif gated:
        kw["activation"] = w.bad("gated_linear_unit", f"a gated {act}: torsh's only gated expert is SwiGLU (silu)")
        return
    elif act == "silu":
        kw["activation"] = w.bad("activation_func", "silu without a gate: torsh's experts use silu only in SwiGLU")
        return
    else:
        kw["activation"] = act
    for key in keys:
        w.map(key, f"moe['activation'] = {kw['activation']!r}")


def _m_expert_parallel(w: Walk, a: dict, m: Migration, experts: int) -> None:
    for key in ("expert_model_parallel_size", "expert_tensor_parallel_size"):
        if not w.take(a, key):
            continue
        if a[key] is None:
            w.skip(key, "None: not set")
            continue
        n = check_int(w, key, a[key], 1, experts, "the number of experts")
        if n is BAD:
            continue
        if key == "expert_tensor_parallel_size":
            if n == 1:
                w.skip(key, "1: the experts are not split by tensor parallelism")
            else:
                w.bad(key, f"{n}: torsh's experts are not split by tensor parallelism (1 maps)")
        elif experts % n:
            w.bad(key, f"{n} does not divide the number of experts, {experts}")
        else:
            m.expert_parallel_size = n
            w.map(key, f"expert_parallel_size: ExpertParallelMoE over {n} ranks, {experts // n} experts each")
