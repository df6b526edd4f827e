"""Benchmark of the MoE routing path against a torch peer written like Hugging Face's Mixtral block.

Case: T tokens (default 16384), hidden H (default 4096), E experts (8 and 64), k=2, bf16 activations
and router logits. The experts are the identity, so what is timed is the routing plumbing alone:

- ``path``: ours = ``moe_route`` + ``moe_permute`` + ``moe_unpermute``; the peer = Mixtral's
  ``MixtralSparseMoeBlock.forward`` with identity experts: softmax in fp32, ``topk``, renormalise, one-hot
  expert mask, then per expert ``torch.where`` (a host sync), a gather of its tokens, the weight
  multiply and ``index_add_`` into the output;
- ``route``: ``moe_route`` against the peer's softmax/topk/renormalise/one-hot mask (which produces no
  permutation, so it does less);
- ``permute``: against ``x.index_select(0, token_index)``;
- ``unpermute``: against ``out.index_add_(0, token_index, y_perm * w_row)`` (Mixtral's combine).

GB/s counts the bytes the fused ops must move: permute reads [T, H] and writes [N, H]; unpermute reads
[N, H] and writes [T, H]; the path adds the logits. The baseline is a same-device copy of the [N, H]
permuted tensor; "of copy" is the ratio to its bandwidth.

The full layer (``--blocks``, default mixtral and deepseek-v3): a training step, forward and backward of
``<y, dy>`` with the input requiring a gradient, of torsh's ``MoELayer`` and of Hugging Face's block
(transformers' ``MixtralSparseMoeBlock``, ``DeepseekV3MoE``: DeepSeek-V3's grouped top-k over sigmoid
scores with a score correction bias, routed scaling 2.5 and one shared expert) holding the same weights,
on the same tokens, per expert count of ``--experts`` with ``--k``. Sizes: T=256, H=64 by default (a
smoke test), T=4096, H=1024 with ``--layer-full`` (the harness adds it in its full runs); the experts'
width 3.5 x H for E <= 16 (Mixtral) and H / 2 above (fine-grained: OLMoE's ratio), see
:func:`expert_width`. Before anything is timed, the bench checks that both do the same math: the outputs,
the input's gradient and every weight's gradient within a relative 1e-4 (fp32) of HF's; else it stops.
The peer is timed as users run it: transformers 5 builds its models with ``experts_implementation="grouped_mm"``
(its experts through ``torch.nn.functional.grouped_mm``; ``PreTrainedModel.get_correct_experts_implementation``
picks it when none is asked for, on every device), so the headline comparison is against that default
(:func:`hf_default_experts` asks transformers which it is; the JSON's ``speedup_vs_hf_default``, and
``speedup_vs_best_peer``, the fastest peer). The same block with ``"eager"`` experts (a Python loop over the
experts, each indexing the stacked weights) is timed too, as a labelled secondary column; ``--no-hf-grouped-mm``
leaves the grouped_mm block out. Like for like: the same weights, tokens, dtype and shapes, in one process (the
same torch threads, recorded), the implementations interleaved step by step. Reported: the median
step in ms with its 20th-80th percentiles (interleaved repetitions), tokens/s, GFLOP/s (3x the forward's
multiply-adds x 2), and our speedup over each HF variant with its range (the ratio of the medians; low:
their p20 over our p80, high: their p80 over our p20). ``--profile-layer`` times each phase of our layer
alone (router, route, permute, experts and their GEMMs alone, unpermute; each backward alone). Our layer
runs without its aux loss (``aux_loss_coef=0``): HF's blocks compute none either.
"""

from __future__ import annotations

import argparse
import math
import os

import torch
import torch.nn.functional as F

from ... import cli_common
from ...ops import moe_permute, moe_route, moe_unpermute
from . import (
    Case,
    Result,
    Timing,
    add_device,
    add_providers,
    emit,
    environment,
    moe_ep,
    print_tables,
    resolve_device,
    result_doc,
    select_providers,
    time_interleaved,
)
from .moe_profile import fwd_bwd, profile_layer

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def mixtral_block(x: torch.Tensor, logits: torch.Tensor, k: int) -> torch.Tensor:
    """MixtralSparseMoeBlock.forward (transformers) with identity experts."""
    T, H = x.shape
    E = logits.shape[1]
    routing_weights = F.softmax(logits, dim=1, dtype=torch.float)
    routing_weights, selected_experts = torch.topk(routing_weights, k, dim=-1)
    routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
    routing_weights = routing_weights.to(x.dtype)
    final = torch.zeros((T, H), dtype=x.dtype, device=x.device)
    expert_mask = F.one_hot(selected_experts, num_classes=E).permute(2, 1, 0)
    for e in range(E):
        idx, top_x = torch.where(expert_mask[e])
        current_state = x[None, top_x].reshape(-1, H)
        current = current_state * routing_weights[top_x, idx, None]
        final.index_add_(0, top_x, current.to(x.dtype))
    return final


def mixtral_routing(logits: torch.Tensor, k: int) -> torch.Tensor:
    routing_weights = F.softmax(logits, dim=1, dtype=torch.float)
    routing_weights, selected_experts = torch.topk(routing_weights, k, dim=-1)
    routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
    return F.one_hot(selected_experts, num_classes=logits.shape[1]).permute(2, 1, 0)


def run_case(T: int, H: int, E: int, k: int, dtype: torch.dtype, device: torch.device, providers: list[str],
             reps: int) -> list[Result]:  # fmt: skip
    g = torch.Generator().manual_seed(E)
    x = torch.randn(T, H, generator=g).to(dtype).to(device)
    logits = torch.randn(T, E, generator=g).to(dtype).to(device)
    b = x.element_size()
    r = moe_route(logits, k=k, provider="torch")
    N = r.num_rows
    y_perm = torch.randn(N, H, generator=g).to(dtype).to(device)
    w_row = torch.empty(N, dtype=torch.float32, device=device)
    w_row[r.row_map.reshape(-1)] = r.weights.reshape(-1)
    out = torch.empty(T, H, dtype=dtype, device=device)
    case = Case(f"T={T} H={H} E={E} k={k} {str(dtype).removeprefix('torch.')}", device)
    add = case.add
    src = torch.empty(N, H, dtype=dtype, device=device).copy_(y_perm)
    dst = torch.empty_like(src)
    add("copy", "dst.copy_(src) [N, H]", "copy", lambda: dst.copy_(src), 2 * N * H * b)
    idx_bytes = T * k * 8 * 2
    perm_bytes = (T + N) * H * b + idx_bytes
    unperm_bytes = (T + N) * H * b + idx_bytes + T * k * 4
    route_bytes = T * E * b + T * k * (8 * 3 + 4 * 2) + N * 8

    # correctness first: ours against the peer on the whole path
    want = mixtral_block(x, logits, k).float()
    for p in providers:
        rr = moe_route(logits, k=k, provider=p)
        got = moe_unpermute(moe_permute(x, rr, provider=p), rr, provider=p).float()
        err = (got - want).abs().max().item()
        tol = 4 * torch.finfo(dtype).eps * (want.abs().max().item() + 1)
        if err > tol:
            raise AssertionError(f"moe path[{p}] differs from the Mixtral peer by {err} (> {tol}); not timing it")

    def path(p: str) -> torch.Tensor:
        rr = moe_route(logits, k=k, provider=p)
        return moe_unpermute(moe_permute(x, rr, provider=p), rr, provider=p)

    for p in providers:
        add("path", f"torsh[{p}] route+permute+unpermute", "ours", lambda p=p: path(p),
            route_bytes + perm_bytes + unperm_bytes)  # fmt: skip
    add("path", "Mixtral block (identity experts)", "peer", lambda: mixtral_block(x, logits, k),
        route_bytes + perm_bytes + unperm_bytes)  # fmt: skip
    for p in providers:
        add("route", f"torsh[{p}]", "ours", lambda p=p: moe_route(logits, k=k, provider=p), route_bytes)
    add("route", "softmax/topk/renorm/one_hot", "peer", lambda: mixtral_routing(logits, k), route_bytes)
    for p in providers:
        add("permute", f"torsh[{p}]", "ours", lambda p=p: moe_permute(x, r, provider=p), perm_bytes)
    add("permute", "x.index_select(token_index)", "peer", lambda: x.index_select(0, r.token_index), perm_bytes)
    for p in providers:
        add("unpermute", f"torsh[{p}]", "ours", lambda p=p: moe_unpermute(y_perm, r, provider=p), unperm_bytes)

    def index_add() -> torch.Tensor:
        out.zero_()
        return out.index_add_(0, r.token_index, (y_perm * w_row[:, None]).to(dtype))

    add("unpermute", "index_add_(y_perm * w)", "peer", index_add, unperm_bytes)
    results = case.time(reps)
    for res in results:
        res.extra.update({"tokens": T, "hidden": H, "experts": E, "k": k, "rows": N})
    return results


# ------------------------------------------------------------------------------------------------- layer
# The full layer, forward + backward, against Hugging Face's blocks on the same weights and tokens.

LAYER_BLOCKS = ("mixtral", "deepseek-v3")
SMOKE_LAYER = (256, 64)
"""(T, H) of the layer cases by default: a smoke size, seconds on a CPU."""
FULL_LAYER = (4096, 1024)
"""(T, H) with ``--layer-full``: the issue's target (E=8 and 64, k=2, fp32)."""
# Each case's relative error bound, per dtype, on the outputs and every gradient (max |a - b| / max |b|).
LAYER_TOL = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 4e-2}


def expert_width(hidden: int, experts: int) -> int:
    """The experts' inner width unless ``--expert-width`` says: coarse experts (E <= 16) are Mixtral's
    3.5 x hidden (14336 / 4096); fine-grained ones (E > 16) hidden / 2, OLMoE's ratio (1024 / 2048; between
    DeepSeek-V3's 2048 / 7168 = 0.29 and DeepSeek-V2-Lite's or Qwen1.5-MoE's 1408 / 2048 = 0.69)."""
    return max(1, int(3.5 * hidden)) if experts <= 16 else max(1, hidden // 2)


def deepseek_groups(experts: int, k: int) -> tuple[int, int]:
    """(n_group, topk_group) of the DeepSeek-V3 cases: DeepSeek-V3's 8 groups with 4 kept where E allows it
    (2 experts per group at least: the group score sums a group's top 2; the kept groups holding k experts
    at least), else 4 or 2 groups with half kept, else one group."""
    for n in (8, 4, 2):
        if experts % n == 0 and experts // n >= 2 and (n // 2) * (experts // n) >= k:
            return n, n // 2
    return 1, 1


def hf_block(kind: str, H: int, width: int, E: int, k: int, experts_impl: str, gen: torch.Generator):
    """A Hugging Face MoE block (transformers), weights drawn from ``gen``: every parameter
    N(0, 1 / fan_in), DeepSeek-V3's score correction bias N(0, 0.02) (it changes some selections)."""
    if kind == "mixtral":
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

        cfg = MixtralConfig(hidden_size=H, intermediate_size=width, num_local_experts=E, num_experts_per_tok=k,
                            router_jitter_noise=0.0)  # fmt: skip
        cls = MixtralSparseMoeBlock
    else:
        from transformers import DeepseekV3Config
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

        n_group, topk_group = deepseek_groups(E, k)
        cfg = DeepseekV3Config(hidden_size=H, moe_intermediate_size=width, n_routed_experts=E, num_experts_per_tok=k,
                               n_shared_experts=1, n_group=n_group, topk_group=topk_group, routed_scaling_factor=2.5,
                               norm_topk_prob=True)  # fmt: skip
        cls = DeepseekV3MoE
    cfg._experts_implementation = experts_impl
    block = cls(cfg)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
        for name, b in block.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=gen) * 0.02)
    return block


def hf_default_experts() -> str:
    """The experts implementation transformers gives a model when none is asked for ("grouped_mm" in
    transformers 5; "eager" where it cannot dispatch grouped_mm): read off a tiny Mixtral model it builds."""
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=1,
                        num_key_value_heads=1, num_local_experts=2, num_experts_per_tok=1)  # fmt: skip
    return MixtralForCausalLM(cfg).config._experts_implementation or "eager"


def _t(g: torch.Tensor) -> torch.Tensor:
    return g.transpose(-2, -1)


def torsh_layer(kind: str, block) -> tuple[object, dict[str, list]]:
    """The torsh :class:`~torsh_kernels.parallel.MoELayer` of a Hugging Face block, through
    :meth:`MoELayer.from_hf <torsh_kernels.parallel.MoELayer.from_hf>` (its weights copied), and how its
    parameters' gradients map onto the block's (our name -> [(their name, our gradient -> theirs)])."""
    from ...parallel import MoELayer

    layer = MoELayer.from_hf(block)
    mapping: dict[str, list] = {
        "router.weight": [("gate.weight", lambda g: g)],
        "w_in": [("experts.gate_up_proj", _t)],  # [E, H, 2w]: gate and up side by side, as HF's rows
        "w_out": [("experts.down_proj", _t)],
    }
    if kind == "deepseek-v3":  # the shared MLP: shared_w_in [H, 2S] (gate columns first), shared_w_out [S, H]
        S = layer.shared_w_out.shape[0]
        mapping["shared_w_in"] = [("shared_experts.gate_proj.weight", lambda g: g[:, :S].T),
                                  ("shared_experts.up_proj.weight", lambda g: g[:, S:].T)]  # fmt: skip
        mapping["shared_w_out"] = [("shared_experts.down_proj.weight", _t)]
    return layer, mapping


def _experts_mode(layer, x: torch.Tensor) -> str:
    """Which expert compute our layer runs on ``x``'s device and dtype: "grouped" (one grouped GEMM per
    projection) or "loop" with the reason."""
    from ...parallel.moe_experts import grouped_fits, grouped_supported

    if layer.expert_compute == "loop":
        return "loop"
    ok, why = grouped_supported(x.device, x.dtype)
    if ok:
        why = grouped_fits(x.reshape(-1, x.shape[-1]), layer.w_in, layer.w_out)
    return "grouped" if not why else f"loop ({why})"


def _outputs(module, x: torch.Tensor, gy: torch.Tensor) -> dict[str, torch.Tensor]:
    """The output, the input's gradient and every parameter's gradient of one step (fp32 copies)."""
    xx = x.detach().requires_grad_()
    y = module(xx)
    y.backward(gy)
    out = {"y": y.detach().float(), "grad x": xx.grad.float()}
    for n, p in module.named_parameters():
        out[f"grad {n}"] = p.grad.detach().float()
        p.grad = None
    return out


def _same_math(name: str, got: dict, want: dict, mapping: dict[str, list], tol: float) -> dict[str, float]:
    """The relative error (max |a - b| / max |b|) of each output of ``got`` against ``want``, our parameters'
    gradients through ``mapping`` (see :func:`torsh_layer`); an AssertionError, and no timing, where one
    exceeds ``tol`` or where a gradient of either side has nothing to compare with."""
    pairs = []
    for key, a in got.items():
        if key.startswith("grad ") and key[5:] in mapping:
            pairs += [(f"grad {theirs}", fn(a)) for theirs, fn in mapping[key[5:]]]
        else:
            pairs.append((key, a))
    errs = {}
    for key, a in pairs:
        if key not in want:
            raise AssertionError(f"moe layer: {name}'s {key} has nothing to compare with in the Hugging Face block")
        b = want[key]
        err = (a - b).abs().max().item() / max(b.abs().max().item(), 1e-30)
        errs[key] = err
        if not err <= tol:
            raise AssertionError(f"moe layer: {name} differs from the Hugging Face block in {key}: relative "
                                 f"error {err:.3g} > {tol}; not timing it")  # fmt: skip
    missing = set(want) - set(errs)
    if missing:
        raise AssertionError(f"moe layer: {name} has nothing to compare with {sorted(missing)}")
    return errs


def _flops(kind: str, T: int, H: int, width: int, E: int, k: int) -> float:
    """Multiply-adds x 2 of one forward: router, the k experts' three projections per token (SwiGLU), and
    DeepSeek-V3's shared expert (one, of the same width)."""
    f = 2 * T * H * E + 2 * T * k * 3 * H * width
    return f + (2 * T * 3 * H * width if kind == "deepseek-v3" else 0)


def run_layer_case(kind: str, T: int, H: int, E: int, k: int, width: int, dtype: torch.dtype, device: torch.device,
                   reps: int, grouped_mm: bool, profile: bool,
                   default: str = "grouped_mm") -> tuple[list[Result], dict | None]:  # fmt: skip
    """Ours against the Hugging Face block with eager and (unless ``grouped_mm`` is False) grouped_mm experts,
    ``default`` naming transformers' default of the two: the same math checked first, then forward + backward
    timed, interleaved; the profile of ours by phase when asked."""
    g = torch.Generator().manual_seed(1000 + E)
    hf = hf_block(kind, H, width, E, k, "eager", g)
    params = sum(p.numel() for p in hf.parameters())  # ours holds the same (MoELayer.from_hf)
    grad_bytes = params * torch.empty((), dtype=dtype).element_size()
    title = (f"layer {kind}: T={T} H={H} E={E} k={k} width={width} {str(dtype).removeprefix('torch.')}, "
             f"{params / 1e6:.1f}M parameters ({grad_bytes / 1e6:.0f} MB of gradients)")  # fmt: skip
    cls = type(hf).__name__
    mark = " - transformers' default"
    peers = [("eager", f"HF {cls} (eager experts){mark if default == 'eager' else ''}", hf)]
    if grouped_mm:
        hg = hf_block(kind, H, width, E, k, "grouped_mm", torch.Generator())
        hg.load_state_dict(hf.state_dict())
        peers.append(("grouped_mm", f"HF {cls} (grouped_mm experts){mark if default == 'grouped_mm' else ''}", hg))
    layer, mapping = torsh_layer(kind, hf)
    x = torch.randn(1, T, H, generator=g).to(device=device, dtype=dtype)
    gy = torch.randn(1, T, H, generator=g).to(device=device, dtype=dtype)
    for _, _, m in peers:
        m.to(device=device, dtype=dtype)
    flops = 3 * _flops(kind, T, H, width, E, k)
    extra = {"block": kind, "tokens": T, "hidden": H, "experts": E, "k": k, "expert_width": width,
             "dtype": str(dtype).removeprefix("torch."), "gflop_per_step": flops / 1e9,
             "parameters": params, "gradient_bytes": grad_bytes, "torch_threads": torch.get_num_threads()}  # fmt: skip
    if kind == "deepseek-v3":
        extra.update(zip(("n_group", "topk_group"), deepseek_groups(E, k)), shared_experts=1,
                     routed_scaling_factor=2.5)  # fmt: skip
    # the same math first: HF's grouped_mm against HF's eager, ours against HF's eager
    want = _outputs(hf, x, gy)
    tol = LAYER_TOL[dtype]
    checks = {}
    for _, name, m in peers[1:]:
        checks[name] = _same_math(name, _outputs(m, x, gy), want, {}, tol)
    layer.to(device=device, dtype=dtype)
    checks["torsh MoELayer"] = _same_math("torsh MoELayer", _outputs(layer, x, gy), want, mapping, tol)
    fns = [fwd_bwd(layer, x, gy), *(fwd_bwd(m, x, gy) for _, _, m in peers)]
    rows = [("torsh MoELayer", "ours", "layer fwd+bwd", None)]
    rows += [(name, "peer", f"layer fwd+bwd, HF {key} experts", key) for key, name, _ in peers]
    timings = time_interleaved(fns, device, warmup=1, reps=reps)
    results, keys = [], {}
    for (impl, kind_, op, key), t in zip(rows, timings):
        s = t.median_ms / 1e3
        results.append(Result(case=title, op=op, impl=impl, kind=kind_, bytes_moved=0, timing=t,
                              extra={**extra, "tokens_per_s": T / s, "gflops": flops / s / 1e9,
                                     "max_rel_error": checks.get(impl, {})}))  # fmt: skip
        if key:
            keys[key] = results[-1]
            results[-1].extra.update(experts_implementation=key, transformers_default=key == default)
    ours = results[0]
    ours.extra["expert_compute"] = _experts_mode(layer, x)
    ours.extra["hf_default_experts"] = default
    for key, peer in keys.items():
        ours.extra[f"speedup_vs_hf_{key}"] = _ratio(peer.timing, ours.timing)
    if default in keys:
        ours.extra["speedup_vs_hf_default"] = ours.extra[f"speedup_vs_hf_{default}"]
    ours.speedup_vs_best_peer = min(p.timing.median_ms for p in keys.values()) / ours.timing.median_ms
    prof = profile_layer(layer, x, gy, reps) if profile else None
    return results, prof


def _ratio(slow: Timing, fast: Timing) -> dict[str, float]:
    """slow / fast: the ratio of the medians, and its range from their 20th and 80th percentiles (the
    lowest: slow's p20 over fast's p80; the highest: slow's p80 over fast's p20)."""
    return {"median": slow.median_ms / fast.median_ms, "low": slow.p20_ms / fast.p80_ms,
            "high": slow.p80_ms / fast.p20_ms}  # fmt: skip


def _counts(text: str) -> list[int]:
    try:
        out = [int(e) for e in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected expert counts like 8,64, got {text!r}") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expert counts must be >= 1, got {text!r}")
    return out


def _blocks(text: str) -> list[str]:
    if text.strip() in ("none", ""):  # ("": how a recorded baseline replays none)
        return []
    return cli_common.choice_list(LAYER_BLOCKS, "block")(text)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_device(p)
    add_providers(p)
    p.add_argument("--tokens", type=cli_common.int_at_least(1), default=16384, help="T (default 16384)")
    p.add_argument("--hidden", type=cli_common.int_at_least(1), default=4096, help="H (default 4096)")
    p.add_argument("--experts", default=[8, 64], type=_counts, help="comma-separated expert counts (default 8,64)")
    p.add_argument("--k", type=cli_common.int_at_least(1), default=2, help="experts per token (default 2)")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES), help="activation and logit dtype")
    p.add_argument("--reps", type=cli_common.int_at_least(1), default=None,
                   help="timed repetitions per measurement (default 20 GPU, 5 CPU)")  # fmt: skip
    g = p.add_argument_group("the full layer against Hugging Face's blocks (forward + backward)")
    g.add_argument("--blocks", default=list(LAYER_BLOCKS), type=_blocks,
                   help=f"Hugging Face blocks to compare the layer with, from {', '.join(LAYER_BLOCKS)}, or none "
                   "(default: both)")  # fmt: skip
    g.add_argument("--layer-full", action="store_true",
                   help=f"the target size T={FULL_LAYER[0]}, H={FULL_LAYER[1]} (default: a smoke size, "
                   f"T={SMOKE_LAYER[0]}, H={SMOKE_LAYER[1]})")  # fmt: skip
    g.add_argument("--layer-tokens", type=cli_common.int_at_least(1), default=None, help="the layer's T (overrides)")
    g.add_argument("--layer-hidden", type=cli_common.int_at_least(1), default=None, help="the layer's H (overrides)")
    g.add_argument("--expert-width", type=cli_common.int_at_least(1), default=None,
                   help="the experts' inner width (default: 3.5 x H for E <= 16, H / 2 above)")  # fmt: skip
    g.add_argument("--layer-dtype", default="fp32", choices=sorted(DTYPES), help="the layer's dtype (default fp32)")
    g.add_argument("--layer-reps", type=cli_common.int_at_least(1), default=None,
                   help="timed steps per implementation (default 10 GPU, 3 CPU)")  # fmt: skip
    g.add_argument("--no-hf-grouped-mm", dest="hf_grouped_mm", action="store_false",
                   help="leave out Hugging Face's experts_implementation='grouped_mm' (transformers' default: the "
                   "headline comparison; the eager experts are then the only peer)")  # fmt: skip
    g.add_argument("--profile-layer", action="store_true",
                   help="also time each phase of the torsh layer's forward and backward on its own")  # fmt: skip
    p.add_argument("--note", default=None, help="a note kept in the JSON (e.g. the machine and its load)")
    moe_ep.add_arguments(p)
    cli_common.add_json(p)


def _print_layer(results: list[Result], profiles: dict[str, dict[str, float]]) -> None:
    console = cli_common.console()
    for case in dict.fromkeys(r.case for r in results):
        rows = [r for r in results if r.case == case]
        default = rows[0].extra.get("hf_default_experts", "grouped_mm")
        other = "eager" if default == "grouped_mm" else "grouped_mm"
        cols = ["implementation", "median", "p20-p80", "tokens/s", "GFLOP/s", f"vs HF {default} (default)",
                f"vs HF {other} (not the default)"]  # fmt: skip
        table = cli_common.table(case, cols, text=("implementation",))
        for r in rows:
            t = r.timing
            vs = []
            for key in (default, other):
                q = r.extra.get(f"speedup_vs_hf_{key}")
                vs.append(f"{q['median']:.2f}x [{q['low']:.2f}-{q['high']:.2f}]" if q else "")
            table.add_row(r.impl, f"{t.median_ms:.1f} ms", f"{t.p20_ms:.1f}-{t.p80_ms:.1f}",
                          f"{r.extra['tokens_per_s']:.0f}", f"{r.extra['gflops']:.1f}", *vs,
                          style="bold" if r.kind == "ours" else None)  # fmt: skip
        console.print(table)
        console.print(f"  (transformers builds its models with experts_implementation={default!r}: the headline; "
                      f"{rows[0].extra.get('torch_threads')} torch thread(s), every implementation in this process, "
                      "interleaved)")  # fmt: skip
        note = next((r.extra["note"] for r in rows if r.extra.get("note")), None)
        if note:
            console.print(f"  ({note})")
        prof = profiles.get(case)
        if prof:
            step = prof["whole step (fwd+bwd)"]
            pt = cli_common.table(
                f"torsh MoELayer by phase: {case}", ["phase", "median", "of the step"], text=("phase",)
            )
            for name, ms in prof.items():
                pt.add_row(name, f"{ms:.2f} ms", f"{100 * ms / step:.0f}%")
            console.print(pt)


def run(args: argparse.Namespace) -> int:
    if args.ep:
        return moe_ep.run(args)
    device = resolve_device(args.device)
    if args.k > min(args.experts):
        raise cli_common.UsageError(f"--k {args.k} is more than the {min(args.experts)} expert(s) of --experts")
    providers = select_providers("torsh bench moe", args.providers, device)
    reps = args.reps or (20 if device.type == "cuda" else 5)
    env = environment(device)
    results: list[Result] = []
    for E in args.experts:
        results += run_case(args.tokens, args.hidden, E, args.k, DTYPES[args.dtype], device, providers, reps)
    print_tables(results, "torsh bench moe", env)
    config = {"providers": providers, "reps": reps, "tokens": args.tokens, "hidden": args.hidden,
              "experts": ",".join(map(str, args.experts)), "k": args.k, "dtype": args.dtype}  # fmt: skip
    if args.note is not None:
        config["note"] = args.note
    if args.blocks:
        try:
            import transformers
        except ImportError:
            raise cli_common.UsageError("--blocks: the layer cases compare with Hugging Face's blocks, which need "
                                  "transformers (the dev extra); --blocks none leaves them out") from None  # fmt: skip
        T, H = FULL_LAYER if args.layer_full else SMOKE_LAYER
        T, H = args.layer_tokens or T, args.layer_hidden or H
        dtype = DTYPES[args.layer_dtype]
        layer_reps = args.layer_reps or (10 if device.type == "cuda" else 3)
        layer: list[Result] = []
        profiles: dict[str, dict[str, float]] = {}
        load = os.getloadavg() if hasattr(os, "getloadavg") else None  # (a shared machine: say how loaded)
        default = hf_default_experts()
        for E in args.experts:
            width = args.expert_width or expert_width(H, E)
            for kind in args.blocks:
                rs, prof = run_layer_case(kind, T, H, E, args.k, width, dtype, device, layer_reps, args.hf_grouped_mm,
                                          args.profile_layer, default)  # fmt: skip
                layer += rs
                if prof:
                    profiles[rs[0].case] = prof
                    rs[0].extra["profile_ms"] = prof
                _print_layer(rs, profiles)  # (each case as it ends: at the target size a case takes minutes)
        load = (load, os.getloadavg() if hasattr(os, "getloadavg") else None)
        results += layer
        config["layer"] = {"blocks": ",".join(args.blocks), "tokens": T, "hidden": H, "dtype": args.layer_dtype,
                           "load_average_before_after": load, "reps": layer_reps,
                           "expert_width": args.expert_width or "3.5 x H for E <= 16, H / 2 above",
                           "hf_grouped_mm": args.hf_grouped_mm, "hf_default_experts": default,
                           "torch_threads": torch.get_num_threads(),
                           "transformers": transformers.__version__}  # fmt: skip
    emit(args, result_doc("moe", env, results, config))
    return 0
