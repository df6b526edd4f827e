"""Megatron-Core's DeepSeek-V3-style MoE settings through ``config.from_megatron(...).moe_layer()``: what each
maps to, the layer's routing against Megatron-Core's topk_routing_with_score_function transcribed (expert bias, groups,
scaling), its bias update against get_updated_expert_bias, and the settings that cannot map."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from torsh_kernels.config import from_megatron
from torsh_kernels.errors import ConfigMappingError
from torsh_kernels.ops import moe_aux_loss
from torsh_kernels.parallel import ExpertParallelMoE, MoELayer

DEEPSEEK = {  # TransformerConfig's field names (a dict: any object with these attributes maps alike)
    "num_moe_experts": 8, "hidden_size": 16, "moe_ffn_hidden_size": 8, "add_bias_linear": False,
    "gated_linear_unit": True, "activation_func": F.silu, "moe_router_topk": 4, "moe_router_score_function": "sigmoid",
    "moe_router_enable_expert_bias": True, "moe_router_bias_update_rate": 0.01, "moe_router_num_groups": 4,
    "moe_router_group_topk": 2, "moe_router_topk_scaling_factor": 2.5, "moe_shared_expert_intermediate_size": 16,
    "moe_shared_expert_gate": True, "moe_shared_expert_overlap": True, "moe_router_load_balancing_type": "seq_aux_loss",
    "moe_aux_loss_coeff": 1e-3, "moe_grouped_gemm": True,
}  # fmt: skip


def megatron_topk_routing(logits, topk, num_groups, group_topk, scaling_factor, expert_bias):
    """Megatron-Core's topk_routing_with_score_function (moe_utils.py) for sigmoid scores with an expert bias
    and group-limited routing (group_limited_topk), as dense [T, E] probabilities."""
    T, E = logits.shape
    scores = torch.sigmoid(logits.float())
    routing = scores + expert_bias.float()
    group_scores = routing.view(T, num_groups, -1).topk(topk // group_topk, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=group_topk, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(T, num_groups, E // num_groups).reshape(T, -1)
    _, top_indices = torch.topk(routing.masked_fill(~score_mask.bool(), float("-inf")), k=topk, dim=-1)
    scores = torch.gather(scores, dim=1, index=top_indices)
    probs = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20) if topk > 1 else scores
    probs = probs * scaling_factor
    return torch.zeros_like(logits).scatter(1, top_indices, probs.type_as(logits))


def test_deepseek_settings_map():
    m = from_megatron(DEEPSEEK)
    assert m.moe == {
        "num_experts": 8, "k": 4, "score": "sigmoid", "renormalize": True, "scaling": 2.5, "expert_bias": True,
        "bias_update_rate": 0.01, "n_group": 4, "topk_group": 2, "shared_experts": 1, "shared_ffn_hidden": 16,
        "shared_gate": True, "aux_loss_coef": 1e-3, "load_balancing": "seq_aux_loss", "z_loss_coef": 0.0,
        "capacity_factor": None, "drop_policy": "probability", "hidden": 16, "ffn_hidden": 8, "activation": "swiglu",
    }  # fmt: skip
    assert set(DEEPSEEK) <= set(m.mapped) | set(m.ignored)  # every key accounted for (defaults too)
    assert "schedules the shared expert" in m.ignored["moe_shared_expert_overlap"]
    padded = from_megatron({**DEEPSEEK, "moe_expert_capacity_factor": 1.5, "moe_pad_expert_input_to_capacity": True})
    assert padded.moe["pad_to_capacity"] is True and padded.moe["capacity_factor"] == 1.5
    unpadded = from_megatron({**DEEPSEEK, "moe_pad_expert_input_to_capacity": True})  # no capacity: no effect
    assert "pad_to_capacity" not in unpadded.moe and "no effect" in unpadded.ignored["moe_pad_expert_input_to_capacity"]


def test_deepseek_layer_routes_and_balances_as_megatron():
    torch.manual_seed(9)
    layer = from_megatron({**DEEPSEEK, "moe_router_load_balancing_type": "aux_loss"}).moe_layer()
    assert layer.shared_expert_gate is not None and layer.balancer.rate == 0.01
    with torch.no_grad():
        layer.balancer.bias.copy_(torch.randn(8) * 0.3)
    x = torch.randn(3, 10, 16)  # 3 sequences of 10 tokens
    y = layer(x)
    r = layer.last_routing
    with torch.no_grad():
        logits = layer.router(x.view(-1, 16))
    dense = torch.zeros_like(logits).scatter(1, r.indices, r.weights.detach())
    ref = megatron_topk_routing(logits, 4, 4, 2, 2.5, layer.balancer.bias)
    torch.testing.assert_close(dense, ref, atol=1e-6, rtol=1e-5)
    unbiased = megatron_topk_routing(logits, 4, 4, 2, 2.5, torch.zeros(8))
    assert not torch.equal(ref > 0, unbiased > 0)  # the bias changed some selections
    torch.testing.assert_close(layer.aux_loss, 1e-3 * moe_aux_loss(logits, r))
    assert y.shape == x.shape
    load = r.tokens_per_expert.clone()
    before = layer.balancer.bias.clone()
    layer.update_expert_bias()  # Megatron-Core's get_updated_expert_bias on the counts of the forward
    mean = load.sum() / 8
    torch.testing.assert_close(layer.balancer.bias, before + torch.sign(mean - load) * 0.01)


def test_deepseek_seq_aux_loss_is_megatrons_per_sequence_loss():
    """Megatron-Core's seq_aux_loss: the Switch loss of each sequence, averaged (moe_aux_loss with the
    sequences as groups), weighted by moe_aux_loss_coeff; the sequences of a [B, S, H] input."""
    torch.manual_seed(10)
    layer = from_megatron(DEEPSEEK).moe_layer()
    assert type(layer) is MoELayer
    assert layer.load_balancing == "seq_aux_loss"
    x = torch.randn(3, 10, 16)
    layer(x)
    with torch.no_grad():
        logits = layer.router(x.view(-1, 16))
    r = layer.last_routing
    torch.testing.assert_close(layer.aux_loss.detach(), 1e-3 * moe_aux_loss(logits, r, groups=[10, 10, 10]))
    assert not torch.allclose(layer.aux_loss.detach(), 1e-3 * moe_aux_loss(logits, r))


class _OneRank:
    rank, world_size = 0, 1

    def all_to_all(self, *a, **k): ...

    def broadcast(self, *a, **k): ...

    def all_reduce(self, *a, **k): ...


def test_expert_parallel_from_megatron_and_what_cannot_map():
    ep = from_megatron({**DEEPSEEK, "expert_model_parallel_size": 1}).expert_parallel_moe(_OneRank())
    assert type(ep) is ExpertParallelMoE
    assert ep.local_experts == 8 and ep.balancer.comm is not None  # the balancer sums over the layer's group
    for bad, key, text in [
        ({"moe_router_group_topk": 1}, "moe_router_group_topk", "top 2"),  # Megatron's group score: top-4 sums
        ({"moe_router_num_groups": 3}, "moe_router_num_groups", "do not divide"),
        ({"moe_router_score_function": "softmax"}, "moe_router_enable_expert_bias", "refuses an expert bias"),
        ({"moe_router_load_balancing_type": ["aux_loss", "seq_aux_loss"], "moe_aux_loss_coeff": [1e-3, 1e-3]},
         "moe_router_load_balancing_type", "both with a coefficient"),
        ({"moe_router_topk_scaling_factor": 0.0}, "moe_router_topk_scaling_factor", "must be > 0"),
        ({"moe_shared_expert_gate": "yes"}, "moe_shared_expert_gate", "true or false"),
        ({"moe_shared_expert_future": 1}, "moe_shared_expert_future", "not a Megatron-Core MoE setting"),
    ]:  # fmt: skip
        with pytest.raises(ConfigMappingError) as e:
            from_megatron({**DEEPSEEK, **bad})
        assert key in e.value.keys and text in e.value.keys[key], (key, e.value.keys)
