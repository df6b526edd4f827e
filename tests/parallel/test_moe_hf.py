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
