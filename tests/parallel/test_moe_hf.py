"""MoELayer.from_hf against Hugging Face's own blocks (transformers 5, small configs built here, fp32): Mixtral,
Qwen2-MoE, OLMoE and DeepSeek-V3 give the same output and the same gradients of the input, the router, the
experts and the shared expert (and its gate) on the same tokens; the blocks it refuses."""

from __future__ import annotations

import pytest
import torch

from torsh_kernels.errors import ArgumentTypeError, InvalidArgumentError
from torsh_kernels.parallel import MoELayer

transformers = pytest.importorskip("transformers")

H, FF, E = 16, 8, 8  # (16 and 8 fp32 values: rows of 64 and 32 bytes, so the grouped GEMM runs)


def _init(block: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Random weights (the blocks' parameters are created empty) and, where there is one, a random non-zero
    expert bias large enough to change the selection."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        for name, b in block.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.2)
    return block


def _mixtral():
    from transformers.models.mixtral.modeling_mixtral import MixtralConfig, MixtralSparseMoeBlock

    cfg = MixtralConfig(hidden_size=H, intermediate_size=FF, num_local_experts=E, num_experts_per_tok=2,
                        router_jitter_noise=0.0)  # fmt: skip
    return MixtralSparseMoeBlock(cfg)


def _qwen2(norm: bool):
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeConfig, Qwen2MoeSparseMoeBlock

    cfg = Qwen2MoeConfig(hidden_size=H, moe_intermediate_size=FF, shared_expert_intermediate_size=12, num_experts=E,
                         num_experts_per_tok=3, norm_topk_prob=norm)  # fmt: skip
    return Qwen2MoeSparseMoeBlock(cfg)


def _olmoe():
    from transformers.models.olmoe.modeling_olmoe import OlmoeConfig, OlmoeSparseMoeBlock

    return OlmoeSparseMoeBlock(OlmoeConfig(hidden_size=H, intermediate_size=FF, num_experts=E, num_experts_per_tok=2))


def _deepseek_v3():
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Config, DeepseekV3MoE

    cfg = DeepseekV3Config(hidden_size=H, moe_intermediate_size=FF, n_routed_experts=E, num_experts_per_tok=3,
                           n_group=4, topk_group=2, routed_scaling_factor=2.5, n_shared_experts=2,
                           norm_topk_prob=True)  # fmt: skip
    return DeepseekV3MoE(cfg)


def _grads(block: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The block's gradients in the layer's layout."""
    out = {"router": block.gate.weight.grad, "w_in": block.experts.gate_up_proj.grad.transpose(1, 2),
           "w_out": block.experts.down_proj.grad.transpose(1, 2)}  # fmt: skip
    mlp = getattr(block, "shared_expert", None) or getattr(block, "shared_experts", None)
    if mlp is not None:
        out["shared_w_in"] = torch.cat([mlp.gate_proj.weight.grad.t(), mlp.up_proj.weight.grad.t()], dim=1)
        out["shared_w_out"] = mlp.down_proj.weight.grad.t()
    if getattr(block, "shared_expert_gate", None) is not None:
        out["shared_gate"] = block.shared_expert_gate.weight.grad
    return out


def _layer_grads(layer: MoELayer) -> dict[str, torch.Tensor]:
    out = {"router": layer.router.weight.grad, "w_in": layer.w_in.grad, "w_out": layer.w_out.grad}
    if layer.shared_experts:
        out["shared_w_in"], out["shared_w_out"] = layer.shared_w_in.grad, layer.shared_w_out.grad
    if layer.shared_expert_gate is not None:
        out["shared_gate"] = layer.shared_expert_gate.weight.grad
    return out


def _compare(block: torch.nn.Module, layer: MoELayer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(2, 9, H, generator=g)
    gy = torch.randn(2, 9, H, generator=g)
    xb, xl = x.clone().requires_grad_(), x.clone().requires_grad_()
    yb = block(xb)
    yb = yb[0] if isinstance(yb, tuple) else yb  # (some blocks return (hidden, router_logits))
    yl = layer(xl)
    torch.testing.assert_close(yl, yb, atol=1e-5, rtol=1e-5)
    (yb * gy).sum().backward()
    (yl * gy).sum().backward()
    torch.testing.assert_close(xl.grad, xb.grad, atol=1e-5, rtol=1e-5)
    theirs, ours = _grads(block), _layer_grads(layer)
    assert set(theirs) == set(ours)
    for name, t in theirs.items():
        assert t.abs().sum() > 0, name
        torch.testing.assert_close(ours[name], t, atol=1e-5, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize(
    ("make", "shared"),
    [
        pytest.param(_mixtral, False, id="mixtral"),
        pytest.param(lambda: _qwen2(False), True, id="qwen2-moe-shared-gated"),
        pytest.param(lambda: _qwen2(True), True, id="qwen2-moe-renormalised"),
        pytest.param(_olmoe, False, id="olmoe"),
    ],
)
def test_from_hf_matches_the_block(make, shared):
    block = _init(make(), seed=3)
    layer = MoELayer.from_hf(block)
    assert (layer.num_experts, layer.hidden, layer.ffn_hidden) == (E, H, FF)
    assert bool(layer.shared_experts) == shared and (layer.shared_expert_gate is not None) == shared
    assert layer.aux_loss_coef == 0.0 and layer.z_loss_coef == 0.0  # the block computes no loss
    _compare(block, layer, seed=3)
    if shared:
        assert layer.shared_ffn_hidden == 12


def test_from_hf_matches_deepseek_v3():
    """Sigmoid scores, a non-zero random e_score_correction_bias (selection only), 2 of 4 groups, routed
    scaling 2.5, renormalised, 2 shared experts (one MLP twice as wide)."""
    block = _init(_deepseek_v3(), seed=5)
    layer = MoELayer.from_hf(block)
    assert (layer.score, layer.n_group, layer.topk_group, layer.scaling, layer.k) == ("sigmoid", 4, 2, 2.5, 3)
    assert (layer.shared_experts, layer.shared_ffn_hidden, layer.shared_expert_gate) == (2, 2 * FF, None)
    assert torch.equal(layer.balancer.bias, block.gate.e_score_correction_bias)
    _compare(block, layer, seed=5)
    with torch.no_grad():  # the bias mattered: without it some tokens choose other experts
        x = torch.randn(40, H, generator=torch.Generator().manual_seed(6))
        layer(x)
        biased = layer.last_routing.indices.sort(1).values
        layer.balancer.bias.zero_()
        layer(x)
    assert not torch.equal(biased, layer.last_routing.indices.sort(1).values)


def test_from_hf_deepseek_v3_in_bf16_routes_in_fp32_as_the_block():
    """DeepSeek-V3's gate computes its logits in fp32 whatever the model's dtype; a bf16 layer that routed on bf16
    logits sent a few tokens in ten thousand to other experts (6 of 8192 here, with large output errors on them).
    The layer routes on fp32 logits too (router_fp32): every token chooses the block's experts."""
    block = _init(_deepseek_v3(), seed=5).to(torch.bfloat16)
    layer = MoELayer.from_hf(block)
    assert layer.router_fp32 and layer.router.weight.dtype == torch.bfloat16
    x = torch.randn(8192, H, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    with torch.no_grad():
        _, weights, indices = block.gate(x)
        layer(x)
    r = layer.last_routing
    assert torch.equal(r.indices.sort(1).values, indices.sort(1).values)
    ours = r.weights.gather(1, r.indices.sort(1).indices)
    theirs = weights.gather(1, indices.sort(1).indices)
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-5)  # fp32 weights from fp32 scores on both sides


def test_from_hf_refuses_what_it_cannot_map():
    with pytest.raises(ArgumentTypeError, match="MixtralSparseMoeBlock"):
        MoELayer.from_hf(torch.nn.Linear(4, 4))
    from transformers.models.mixtral.modeling_mixtral import MixtralConfig, MixtralSparseMoeBlock

    jitter = MixtralSparseMoeBlock(MixtralConfig(hidden_size=H, intermediate_size=FF, num_local_experts=4,
                                                 router_jitter_noise=0.1))  # fmt: skip
    with pytest.raises(InvalidArgumentError, match=r"router_jitter_noise=0\.1"):
        MoELayer.from_hf(jitter)
    gelu = MixtralSparseMoeBlock(MixtralConfig(hidden_size=H, intermediate_size=FF, num_local_experts=4,
                                               router_jitter_noise=0.0, hidden_act="gelu"))  # fmt: skip
    with pytest.raises(InvalidArgumentError, match="not SiLU"):
        MoELayer.from_hf(_init(gelu, 1))
    layer = MoELayer.from_hf(_init(_mixtral(), 1), aux_loss_coef=0.02, expert_compute="loop")  # overrides
    assert layer.aux_loss_coef == 0.02 and layer.expert_compute == "loop"


def _switch(act: str = "relu", capacity: int = 3, **cfg):
    from transformers.models.switch_transformers.modeling_switch_transformers import (
        SwitchTransformersConfig,
        SwitchTransformersSparseMLP,
    )

    cfg = SwitchTransformersConfig(d_model=H, d_ff=FF, num_experts=4, expert_capacity=capacity, dense_act_fn=act,
                                   router_jitter_noise=0.0, dropout_rate=0.0, **cfg)  # fmt: skip
    return SwitchTransformersSparseMLP(cfg)


def _switch_grads(block) -> dict[str, torch.Tensor]:
    ex = [block.experts[f"expert_{e}"] for e in range(len(block.experts))]
    return {"router": block.router.classifier.weight.grad,
            "w_in": torch.stack([m.wi.weight.grad.t() for m in ex]),
            "w_out": torch.stack([m.wo.weight.grad.t() for m in ex])}  # fmt: skip


@pytest.mark.parametrize("act", ["relu", "gelu"])
def test_from_hf_matches_switch_with_capacity_per_sequence(act):
    """Switch Transformers' sparse MLP: top-1 softmax, each expert keeping its first expert_capacity tokens of
    each sequence (the rows of [B, S, H]); the dropped tokens' output is 0. The router is skewed so that every
    sequence overflows some expert: the outputs and every gradient agree, tokens are dropped, and the same
    tokens routed as one call (capacity per call) would drop other tokens."""
    B, S, C = 3, 11, 3
    block = _init(_switch(act, C), seed=7)
    with torch.no_grad():
        block.router.classifier.weight[0] += 0.5  # expert 0 preferred: it overflows in each sequence
    layer = MoELayer.from_hf(block)
    assert (layer.k, layer.capacity, layer.capacity_scope, layer.drop_policy, layer.renormalize, layer.activation) == (
        1, C, "sequence", "position", False, act)  # fmt: skip
    g = torch.Generator().manual_seed(8)
    x, gy = torch.randn(B, S, H, generator=g), torch.randn(B, S, H, generator=g)
    xb, xl = x.clone().requires_grad_(), x.clone().requires_grad_()
    yb, yl = block(xb), layer(xl)
    torch.testing.assert_close(yl, yb, atol=1e-5, rtol=1e-5)
    r = layer.last_routing
    assert r.sequence_capacity == (C,) * B and 0 < r.num_dropped < B * S
    dropped = r.dropped[:, 0].view(B, S)
    assert torch.equal(yb.detach()[dropped], torch.zeros(int(dropped.sum()), H))  # HF's dropped tokens: 0
    (yb * gy).sum().backward()
    (yl * gy).sum().backward()
    torch.testing.assert_close(xl.grad, xb.grad, atol=1e-5, rtol=1e-5)
    theirs, ours = _switch_grads(block), _layer_grads(layer)
    for name, t in theirs.items():
        assert t.abs().sum() > 0, name
        torch.testing.assert_close(ours[name], t, atol=1e-5, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    with torch.no_grad():  # per call, the capacity would drop other tokens: the scope matters here
        call = MoELayer.from_hf(block, capacity=C * B, capacity_scope="call")
        call(x)
    assert not torch.equal(call.last_routing.dropped, r.dropped)


def test_from_hf_refuses_switch_settings_it_cannot_map():
    with pytest.raises(InvalidArgumentError, match=r"router_jitter_noise=0\.1"):
        MoELayer.from_hf(_switch_with(jitter=0.1))
    with pytest.raises(InvalidArgumentError, match="router_bias"):
        MoELayer.from_hf(_switch(router_bias=True))
    with pytest.raises(InvalidArgumentError, match="ReLU or exact GELU"):
        MoELayer.from_hf(_switch("gelu_new"))


def _switch_with(jitter: float):
    block = _switch()
    block.router.jitter_noise = jitter
    return block


def test_bench_compares_the_layer_with_the_block_as_transformers_builds_it():
    """`torsh bench moe`'s layer cases (issue 41, item 15): the headline peer is the experts implementation that
    transformers gives a model it builds (grouped_mm in transformers 5, on the CPU too), timed beside the
    non-default eager one with the same weights, tokens, dtype and threads; speedup_vs_best_peer is the fastest
    peer's ratio, speedup_vs_hf_default the default's."""
    from transformers import MixtralConfig, MixtralForCausalLM

    from torsh_kernels.apps.bench import moe as bench_moe

    cfg = MixtralConfig(vocab_size=8, hidden_size=16, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2,
                        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)  # fmt: skip
    built = MixtralForCausalLM(cfg).config._experts_implementation
    assert built == bench_moe.hf_default_experts() == "grouped_mm"
    results, _ = bench_moe.run_layer_case("mixtral", 32, 16, 4, 2, 56, torch.float32, torch.device("cpu"), 2, True,
                                          False, built)  # fmt: skip
    ours = results[0]
    peers = {r.extra["experts_implementation"]: r for r in results if r.kind == "peer"}
    assert set(peers) == {"eager", "grouped_mm"} and peers["grouped_mm"].extra["transformers_default"]
    assert "default" in peers["grouped_mm"].impl and "default" not in peers["eager"].impl
    assert ours.extra["hf_default_experts"] == "grouped_mm"
    assert ours.extra["speedup_vs_hf_default"] == ours.extra["speedup_vs_hf_grouped_mm"]
    for key, peer in peers.items():
        want = peer.timing.median_ms / ours.timing.median_ms
        assert ours.extra[f"speedup_vs_hf_{key}"]["median"] == pytest.approx(want)
    fastest = min(p.timing.median_ms for p in peers.values())
    assert ours.speedup_vs_best_peer == pytest.approx(fastest / ours.timing.median_ms)
    assert {r.extra["torch_threads"] for r in results} == {torch.get_num_threads()}
