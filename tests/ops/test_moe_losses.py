"""The router losses' conventions: ``moe_aux_loss`` with ``scale=`` and ``groups=`` (hand-computed values and
gradients; Hugging Face's own Mixtral and Switch Transformers loss functions, and Switch's z-loss, on the same
logits and selections; DeepSeek-V3's sequence-wise balance loss and Megatron-Core's ``seq_aux_loss`` written
out here), the cpu provider's kernels against the torch formula, typed errors, no tokens, meta tensors and
torch.compile."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import torsh_kernels.ops.moe as M
from tests.helpers import rand
from torsh_kernels.errors import ArgumentTypeError, InvalidArgumentError, ShapeError

mixtral = pytest.importorskip("transformers.models.mixtral.modeling_mixtral")
switch = pytest.importorskip("transformers.models.switch_transformers.modeling_switch_transformers")

PROVIDERS = ("cpu", "torch")


def _logits(gen, T, E, scale=2.0):
    return torch.randn(T, E, generator=gen) * scale


# ------------------------------------------------------------------------------------------ by hand


def test_groups_and_scales_hand_computed():
    ln3 = math.log(3.0)
    # tokens 0, 1: probabilities [.25, .75] (-> expert 1); tokens 2, 3: [.75, .25] (-> expert 0)
    logits = torch.tensor([[0.0, ln3], [0.0, ln3], [ln3, 0.0], [ln3, 0.0]])
    r1, r2 = M.moe_route(logits, k=1), M.moe_route(logits, k=2)
    assert r1.indices.view(-1).tolist() == [1, 1, 0, 0]
    for p in PROVIDERS:

        def loss(r, p=p, **kw):
            return M.moe_aux_loss(logits, r, provider=p, **kw).item()

        assert loss(r1) == pytest.approx(1.0, abs=1e-6)  # f = [.5, .5], P = [.5, .5]
        # per pair of tokens: f = [0, 1], P = [.25, .75] -> 2 * .75, and its mirror image: mean 1.5
        assert loss(r1, groups=2) == pytest.approx(1.5, abs=1e-6)
        assert loss(r1, groups=[2, 2]) == pytest.approx(1.5, abs=1e-6)
        assert loss(r1, groups=2, scale="hf") == pytest.approx(1.5, abs=1e-6)  # K = 1: the same
        # [1, 3]: token 0 alone: 1.5; tokens 1..3: f = [2/3, 1/3], P = [7/12, 5/12] -> 2 * (14 + 5) / 36
        assert loss(r1, groups=(1, 3)) == pytest.approx((1.5 + 19 / 18) / 2, abs=1e-6)
        assert loss(r1, groups=1) == pytest.approx(1.5, abs=1e-6)  # every token alone: 2 * .75
        # k = E = 2: every expert gets half of every group's assignments: 1 balanced-one, K = 2 for hf
        for groups in (None, 2, [1, 3]):
            assert loss(r2, groups=groups) == pytest.approx(1.0, abs=1e-6)
            assert loss(r2, groups=groups, scale="hf") == pytest.approx(2.0, abs=1e-6)


@pytest.mark.parametrize("provider", PROVIDERS)
def test_gradient_of_grouped_loss_from_probabilities_hand_computed(provider):
    """d loss / d p[t, e] = E * c_ge / (G * kf * S_g**2) for t in group g (kf = K, or 1 for "hf")."""
    p = torch.tensor([[0.1, 0.2, 0.7], [0.5, 0.3, 0.2], [0.3, 0.3, 0.4], [0.2, 0.5, 0.3], [0.6, 0.1, 0.3]])
    r = M.moe_route(p.log(), k=2)  # (softmax of log p: the same order)
    assert r.indices.tolist() == [[2, 1], [0, 1], [2, 0], [1, 2], [0, 2]]
    counts = [[1, 2, 1], [2, 1, 3]]  # groups [2, 3]: tokens 0, 1 and 2, 3, 4
    for scale, kf in (("balanced-one", 2), ("hf", 1)):
        x = p.clone().requires_grad_()
        loss = M.moe_aux_loss(x, r, from_probs=True, scale=scale, groups=[2, 3], provider=provider)
        psum = [[0.6, 0.5, 0.9], [1.1, 0.9, 1.0]]
        want = sum(3 * sum(c * s for c, s in zip(counts[g], psum[g])) / (kf * n * n) for g, n in ((0, 2), (1, 3))) / 2
        assert loss.item() == pytest.approx(want, rel=1e-6)
        loss.backward()
        rows = [[3 * c / (2 * kf * n * n) for c in counts[g]] for g, n in ((0, 2), (0, 2), (1, 3), (1, 3), (1, 3))]
        torch.testing.assert_close(x.grad, torch.tensor(rows))


# ------------------------------------------------------------------------------------------ Hugging Face


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize(("T", "E", "K"), [(37, 8, 2), (29, 5, 1), (16, 6, 4)])
def test_hf_scale_equals_mixtral_load_balancing_loss(gen, provider, T, E, K):
    """Mixtral's (and Qwen2-MoE's, OLMoE's: the same function) loss without an attention mask, on the same
    logits and selections: value and gradient."""
    logits = _logits(gen, T, E)
    r = M.moe_route(logits, k=K)
    hf_sel = torch.topk(torch.softmax(logits, -1), K, dim=-1).indices
    assert torch.equal(hf_sel, r.indices), "the same selections (no ties on random logits)"
    a, b = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    ours = M.moe_aux_loss(a, r, scale="hf", provider=provider)
    theirs = mixtral.load_balancing_loss_func((b,), num_experts=E, top_k=K)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
    ours.backward()
    theirs.backward()
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7)
    assert float(b.grad.abs().sum()) > 0
    # balanced-one is 1/K of it
    torch.testing.assert_close(M.moe_aux_loss(logits, r, provider=provider) * K, theirs.detach(), rtol=1e-6, atol=1e-6)


def test_hf_scale_over_layers_is_the_loss_of_their_concatenated_tokens(gen):
    """HF's function over a tuple of layers' logits accumulates counts and probabilities over all of them:
    the loss of the concatenated rows."""
    layers = [_logits(gen, 21, 6) for _ in range(3)]
    cat = torch.cat(layers)
    ours = M.moe_aux_loss(cat, M.moe_route(cat, k=2), scale="hf")
    torch.testing.assert_close(ours, mixtral.load_balancing_loss_func(tuple(layers), 6, 2), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize(("G", "S", "E", "K"), [(3, 11, 4, 1), (2, 17, 8, 2), (5, 1, 3, 1)])
def test_groups_equal_switch_transformers_load_balancing_and_z_loss(gen, provider, G, S, E, K):
    """Switch's loss of [G, S, E] router probabilities and [G, S] (top-1) or [G, S, K] expert indices: ours
    with groups=S (scale "hf"; for K = 1 also the default), values and gradients; its router_z_loss_func is
    moe_z_loss of the flattened logits."""
    logits = _logits(gen, G * S, E)
    r = M.moe_route(logits, k=K)
    a, b = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    ours = M.moe_aux_loss(a, r, scale="hf", groups=S, provider=provider)
    sel = r.indices.view(G, S) if K == 1 else r.indices.view(G, S, K)
    theirs = switch.load_balancing_loss_func(torch.softmax(b, -1).view(G, S, E), sel)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
    ours.backward()
    theirs.backward()
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7)
    assert float(b.grad.abs().sum()) > 0
    # the group lengths as a list are the same groups
    torch.testing.assert_close(M.moe_aux_loss(logits, r, scale="hf", groups=[S] * G, provider=provider),
                               theirs.detach(), rtol=1e-6, atol=1e-6)  # fmt: skip
    if K == 1:
        torch.testing.assert_close(M.moe_aux_loss(logits, r, groups=S, provider=provider), theirs.detach(),
                                   rtol=1e-6, atol=1e-6)  # fmt: skip
    a.grad = b.grad = None
    ours = M.moe_z_loss(a, provider=provider)
    theirs = switch.router_z_loss_func(b.view(G, S, E))
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
    ours.backward()
    theirs.backward()
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7)


# ------------------------------------------------------------------------------------------ sequence-wise


def _deepseek_v3_sequence_loss(logits, chosen, lengths, K):
    """DeepSeek-V3 (arXiv 2412.19437) eq. 17-20 per sequence, without alpha, averaged over the sequences:
    f_i = N_r / (K_r T) sum_t 1(expert i in token t's top-K_r), s'_it = s_it / sum_j s_jt, P_i = 1/T sum_t s'_it,
    L = sum_i f_i P_i; T is the sequence's length, N_r the routed experts, s = sigmoid(logits)."""
    s = torch.sigmoid(logits.double())
    E = s.shape[1]
    total, t0 = 0.0, 0
    for n in lengths:
        loss = 0.0
        for i in range(E):
            f = E / (K * n) * sum(int(i in chosen[t].tolist()) for t in range(t0, t0 + n))
            P = sum(s[t, i] / s[t].sum() for t in range(t0, t0 + n)) / n
            loss = loss + f * P
        total, t0 = total + loss, t0 + n
    return total / len(lengths)


@pytest.mark.parametrize("provider", PROVIDERS)
def test_sequence_lengths_give_deepseek_v3_sequence_wise_balance_loss(gen, provider):
    """groups = the sequence lengths, default scale, DeepSeek-V3's routing (sigmoid scores, a score bias for the
    selection only, grouped top-k, routed scaling): DeepSeek-V3's loss, whose f counts each token's top-K of the
    unbiased scores (eq. 18), as Megatron-Core does; count="routed" counts the routing's biased choices instead.
    The probabilities come from the unbiased logits passed."""
    lengths, E, K = [7, 1, 12, 5], 8, 3
    T = sum(lengths)
    logits = _logits(gen, T, E)
    bias = torch.randn(E, generator=gen) * 0.3
    r = M.moe_route(logits, k=K, score="sigmoid", score_bias=bias, n_group=4, topk_group=2, scaling=2.5)
    plain = M.moe_route(logits, k=K, score="sigmoid").indices
    assert not torch.equal(r.indices, plain), "the bias changes choices"
    for count, chosen in (("topk", plain), ("routed", r.indices)):
        x = logits.clone().requires_grad_()
        ours = M.moe_aux_loss(x, r, groups=lengths, count=count, provider=provider)
        want = _deepseek_v3_sequence_loss(logits, chosen, lengths, K)
        assert ours.item() == pytest.approx(float(want), rel=1e-5)
        ours.backward()
        xd = logits.double().requires_grad_()
        _deepseek_v3_sequence_loss(xd, chosen, lengths, K).backward()
        torch.testing.assert_close(x.grad, xd.grad.float(), rtol=1e-4, atol=1e-7)


def test_equal_sequences_give_megatron_seq_aux_loss(gen):
    """Megatron-Core's sequence_load_balancing_loss_func (probabilities and routing map in its [seq, batch]
    token order, as written there) on B sequences of L tokens: ours on the same tokens in [batch, seq] order
    with groups=L."""
    B, L, E, K = 3, 10, 6, 2
    logits = _logits(gen, B * L, E)  # [batch, seq] rows
    r = M.moe_route(logits, k=K, score="sigmoid")
    s = torch.sigmoid(logits)
    probs = (s / s.sum(-1, keepdim=True)).view(B, L, E).transpose(0, 1).reshape(L * B, E)
    routing_map = torch.zeros(B * L, E, dtype=torch.bool).scatter_(1, r.indices, True)
    routing_map = routing_map.view(B, L, E).transpose(0, 1).reshape(L * B, E)
    # Megatron: probs_for_aux_loss.view(seq_length, batch_size, -1), routing_map likewise, then
    cost_coeff = routing_map.view(L, B, E).sum(dim=0, dtype=torch.float).div_(L * K / E)
    megatron = (cost_coeff * probs.view(L, B, E).mean(dim=0)).sum(dim=1).mean()
    torch.testing.assert_close(M.moe_aux_loss(logits, r, groups=L), megatron, rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------- Megatron-Core, with a bias or groups
# Megatron-Core's TopKRouter (megatron/core/transformer/moe/router.py, moe_utils.py) routes with the expert bias
# and the group limit (topk_routing_with_score_function), but its load-balancing losses count the experts of
# compute_routing_scores_for_aux_loss: a plain torch.topk of the unbiased, normalised scores. Written out here.


def _megatron_scores_for_aux_loss(logits, K, score):
    """compute_routing_scores_for_aux_loss (unfused): (routing_map [T, E] bool, scores [T, E])."""
    if score == "softmax":
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
    else:
        scores = torch.sigmoid(logits.float())
        scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    _, top_indices = torch.topk(scores, k=K, dim=1)
    routing_map = torch.zeros_like(logits).int().scatter(1, top_indices, 1).bool()
    return routing_map, scores


def _megatron_switch_loss(probs, tokens_per_expert, total_num_tokens, topk, num_experts):
    """switch_load_balancing_loss_func (unfused, no padding mask) with moe_aux_loss_coeff = 1."""
    aggregated_probs_per_expert = probs.sum(dim=0)
    return torch.sum(aggregated_probs_per_expert * tokens_per_expert) * (
        num_experts / (topk * total_num_tokens * total_num_tokens)
    )


def _megatron_aux_loss(logits, K, score):
    """TopKRouter._apply_aux_loss on one rank: tokens_per_expert = routing_map.sum(0), total_num_tokens = T."""
    routing_map, scores = _megatron_scores_for_aux_loss(logits, K, score)
    return _megatron_switch_loss(scores, routing_map.sum(dim=0), logits.shape[0], K, logits.shape[1])


def _megatron_seq_aux_loss(logits_sb, K, score, L, B):
    """TopKRouter._apply_seq_aux_loss on one rank, for logits in Megatron's [seq, batch] token order: the batch
    folded into the expert dimension, the switch loss over the L positions, divided by the batch size."""
    routing_map, scores = _megatron_scores_for_aux_loss(logits_sb, K, score)
    scores, routing_map = scores.reshape(L, -1), routing_map.reshape(L, -1)
    tokens_per_expert = routing_map.sum(dim=0)  # [B * E]
    return _megatron_switch_loss(scores, tokens_per_expert, L, K, logits_sb.shape[1]) / B


# (score, bias scale (0: none), n_group, topk_group): DeepSeek-V3's sigmoid router and a softmax one
MEGATRON_OPTIONS = [
    pytest.param("sigmoid", 0.4, None, None, id="sigmoid-bias"),
    pytest.param("sigmoid", 0.0, 4, 2, id="sigmoid-groups"),
    pytest.param("sigmoid", 0.4, 4, 2, id="sigmoid-bias-groups"),
    pytest.param("softmax", 0.1, None, None, id="softmax-bias"),
    pytest.param("softmax", 0.0, 4, 1, id="softmax-groups"),
    pytest.param("softmax", 0.1, 4, 2, id="softmax-bias-groups"),
]


def _biased_routing(gen, provider, T, E, K, score, bias_scale, n_group, topk_group):
    logits = rand((T, E), torch.float32, gen) * 2.0
    bias = rand((E,), torch.float32, gen) * bias_scale if bias_scale else None
    r = M.moe_route(logits, k=K, score=score, score_bias=bias, n_group=n_group, topk_group=topk_group,
                    provider=provider)  # fmt: skip
    plain = M.moe_route(logits, k=K, score=score, provider=provider)
    assert not torch.equal(r.indices, plain.indices), "the options change some choices (else nothing is tested)"
    return logits, r


_ROUTING_TENSORS = ("indices", "weights", "scores", "tokens_per_expert", "row_map", "token_index", "dropped")


def _loss_providers(x):
    return (None, "torch", "cpu") if x.is_cpu else (None, "torch")


@pytest.mark.parametrize(("score", "bias_scale", "n_group", "topk_group"), MEGATRON_OPTIONS)
def test_aux_loss_with_bias_or_groups_is_megatron_core_aux_loss(gen, provider, score, bias_scale, n_group, topk_group):
    """load_balancing="aux_loss": the value and the gradient of Megatron-Core's loss on the same logits, routed by
    each provider with an expert bias and/or groups; count="routed" is the biased count, which Megatron's is not."""
    T, E, K = 96, 16, 4
    logits, r = _biased_routing(gen, provider, T, E, K, score, bias_scale, n_group, topk_group)
    xm = logits.detach().clone().requires_grad_()
    want = _megatron_aux_loss(xm, K, score)
    want.backward()
    for lp in _loss_providers(logits):
        x = logits.detach().clone().requires_grad_()
        got = M.moe_aux_loss(x, r, provider=lp)
        torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)
        got.backward()
        torch.testing.assert_close(x.grad, xm.grad, rtol=1e-4, atol=1e-7)
    for lp in _loss_providers(logits):
        routed = M.moe_aux_loss(logits, r, count="routed", provider=lp)
        assert abs(routed.item() - want.item()) > 1e-4 * want.item(), "the routed count is another loss"
    assert r.selection_options
    on_cpu = dataclasses.replace(r, **{f: getattr(r, f).cpu() for f in _ROUTING_TENSORS})
    torch.testing.assert_close(M.moe_aux_loss_ref(logits.cpu(), on_cpu), want.detach().cpu(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("score", "bias_scale", "n_group", "topk_group"), MEGATRON_OPTIONS)
def test_seq_aux_loss_with_bias_or_groups_is_megatron_core_seq_aux_loss(
    gen, provider, score, bias_scale, n_group, topk_group
):
    """load_balancing="seq_aux_loss": ours on B sequences of L tokens in [batch, seq] rows with groups=L against
    Megatron-Core's on the same tokens in its [seq, batch] order, value and gradient, per routing provider."""
    B, L, E, K = 4, 24, 16, 4
    logits, r = _biased_routing(gen, provider, B * L, E, K, score, bias_scale, n_group, topk_group)
    xm = logits.detach().clone().requires_grad_()
    want = _megatron_seq_aux_loss(xm.view(B, L, E).transpose(0, 1).reshape(L * B, E), K, score, L, B)
    want.backward()
    for lp in _loss_providers(logits):
        for groups in (L, [L] * B):
            x = logits.detach().clone().requires_grad_()
            got = M.moe_aux_loss(x, r, groups=groups, provider=lp)
            torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)
            got.backward()
            torch.testing.assert_close(x.grad, xm.grad, rtol=1e-4, atol=1e-7)
    for lp in _loss_providers(logits):
        routed = M.moe_aux_loss(logits, r, groups=L, count="routed", provider=lp)
        assert abs(routed.item() - want.item()) > 1e-4 * want.item(), "the routed count is another loss"


@pytest.mark.parametrize("provider", PROVIDERS)
def test_count_routed_counts_the_routing_indices_and_topk_from_probs(gen, provider):
    """count="routed": the routing's (biased) indices, by hand; from_probs=True with the default count: the top-K
    of the probabilities given; a routing without selection options counts its indices either way."""
    T, E, K = 40, 8, 2
    logits = _logits(gen, T, E)
    bias = torch.zeros(E)
    bias[5] = 1.0  # every token chooses expert 5
    r = M.moe_route(logits, k=K, score_bias=bias)
    p = torch.softmax(logits, -1)
    f_routed = torch.bincount(r.indices.reshape(-1), minlength=E).float() / (T * K)
    assert f_routed[5] == 0.5
    top = torch.topk(p, K, dim=1).indices
    f_top = torch.bincount(top.reshape(-1), minlength=E).float() / (T * K)
    for fr, kw in ((f_routed, dict(count="routed")), (f_top, {})):
        want = E * (fr * p.mean(0)).sum()
        torch.testing.assert_close(M.moe_aux_loss(logits, r, provider=provider, **kw), want)
        torch.testing.assert_close(M.moe_aux_loss(p, r, from_probs=True, provider=provider, **kw), want)
    plain = M.moe_route(logits, k=K)
    for count in M.AUX_COUNTS:
        torch.testing.assert_close(M.moe_aux_loss(logits, plain, count=count, provider=provider),
                                   E * (f_top * p.mean(0)).sum())  # fmt: skip


def test_bad_count_is_a_typed_error(gen):
    logits = _logits(gen, 8, 4)
    r = M.moe_route(logits, k=2, score_bias=torch.zeros(4))
    for bad in ("biased", "", None, 1):
        with pytest.raises(InvalidArgumentError, match="count"):
            M.moe_aux_loss(logits, r, count=bad)
        with pytest.raises(InvalidArgumentError, match="count"):
            M.moe_aux_loss_ref(logits, r, count=bad)
    with pytest.raises(ArgumentTypeError, match="selection_options"):
        M.moe_aux_loss(logits, dataclasses.replace(r, selection_options=1))


# ------------------------------------------------------------------------------------------ providers


@pytest.mark.parametrize("score", ["softmax", "sigmoid", "probs"])
@pytest.mark.parametrize("scale", M.AUX_SCALES)
@pytest.mark.parametrize(
    ("T", "E", "groups"),
    [(39, 7, None), (39, 7, 1), (39, 7, 13), (39, 7, [4, 1, 20, 14]), (39, 7, (39,)), (97, 17, None),
     (97, 17, [50, 3, 44])],
    ids=["none", "1", "13", "list", "one", "E17", "E17-list"],
)  # fmt: skip
def test_cpu_kernels_match_the_torch_formula(gen, score, scale, T, E, groups):
    """Values, gradients and (create_graph) second derivatives of the cpu provider against autograd of the
    torch formula (E=17: the kernels read torch's softmax / sigmoid scores)."""
    K = 3
    logits = _logits(gen, T, E, 3.0).requires_grad_()
    r = M.moe_route(logits.detach(), k=K, score="sigmoid" if score == "sigmoid" else "softmax")
    out = []
    for provider in PROVIDERS:
        inp = torch.softmax(logits, -1) if score == "probs" else logits
        loss = M.moe_aux_loss(inp, r, from_probs=score == "probs", scale=scale, groups=groups, provider=provider)
        (gr,) = torch.autograd.grad(loss, logits, create_graph=True)
        (hv,) = torch.autograd.grad(gr.square().sum(), logits)
        out.append((loss.detach(), gr.detach(), hv))
    (a, ga, ha), (b, gb, hb) = out
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ga, gb, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(ha, hb, rtol=1e-4, atol=1e-6)
    assert float(gb.abs().sum()) > 0


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float16, 1e-3), (torch.bfloat16, 8e-3)], ids=["fp16", "bf16"])
def test_low_precision_logits_are_scored_in_fp32(gen, provider, dtype, tol):
    logits = _logits(gen, 33, 5).to(dtype)
    r = M.moe_route(logits, k=2)
    x = logits.clone().requires_grad_()
    got = M.moe_aux_loss(x, r, scale="hf", groups=[10, 23], provider=provider)
    assert got.dtype == torch.float32
    got.backward()
    assert x.grad.dtype == dtype
    x32 = logits.float().requires_grad_()
    want = M.moe_aux_loss_ref(x32, r, scale="hf", groups=[10, 23])
    want.backward()
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    torch.testing.assert_close(x.grad.float(), x32.grad, rtol=tol, atol=tol)


# ------------------------------------------------------------------------------------------ edges


def test_bad_scale_and_groups_are_typed_errors():
    logits = torch.randn(7, 4)
    r = M.moe_route(logits, k=2)
    for fn in (M.moe_aux_loss, M.moe_aux_loss_ref):
        for bad in ("HF", "balanced", None, 1):
            with pytest.raises(InvalidArgumentError, match="scale"):
                fn(logits, r, scale=bad)
        for bad, err, match in [
            (0, InvalidArgumentError, "group size"),
            (-7, InvalidArgumentError, "group size"),
            (3, ShapeError, "does not divide"),
            (True, ArgumentTypeError, "groups"),
            (7.0, ArgumentTypeError, "groups"),
            ("7", ArgumentTypeError, "groups"),
            (torch.tensor([3, 4]), ArgumentTypeError, "tolist"),
            ([3, -1, 5], InvalidArgumentError, r"groups\[1\]"),
            ([3, 4.0], ArgumentTypeError, r"groups\[1\]"),
            ([3, True, 3], ArgumentTypeError, r"groups\[1\]"),
            ([3, 3], ShapeError, "sum to 6"),
            ([], ShapeError, "sum to 0"),
        ]:
            with pytest.raises(err, match=match):
                fn(logits, r, groups=bad)
            with pytest.raises(err, match=match):
                fn(logits, r, groups=bad, scale="hf", **({"provider": "cpu"} if fn is M.moe_aux_loss else {}))


def test_empty_groups_are_left_out_of_the_mean(gen):
    """A group of no tokens (an empty sequence of routing.sequence_lengths) has nothing to balance: the loss is
    that of the other groups."""
    logits = _logits(gen, 11, 5)
    r = M.moe_route(logits, k=2, capacity_factor=1.0, capacity_scope="sequence", sequence_lengths=[0, 4, 0, 7, 0])
    for provider in PROVIDERS:
        for scale in M.AUX_SCALES:
            a, b = logits.clone().requires_grad_(), logits.clone().requires_grad_()
            got = M.moe_aux_loss(a, r, scale=scale, groups=r.sequence_lengths, provider=provider)
            want = M.moe_aux_loss_ref(b, r, scale=scale, groups=[4, 7])
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
            got.backward()
            want.backward()
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7)
    lg = torch.empty(0, 5, requires_grad=True)
    loss = M.moe_aux_loss(lg, M.moe_route(lg.detach(), k=2), groups=[0, 0])
    assert float(loss.detach()) == 0.0


def test_no_tokens_give_zero_with_a_gradient():
    lg = torch.empty(0, 5, requires_grad=True)
    r = M.moe_route(lg.detach(), k=2)
    for provider in PROVIDERS:
        for groups in (None, 3, [], ()):
            for scale in M.AUX_SCALES:
                loss = M.moe_aux_loss(lg, r, scale=scale, groups=groups, provider=provider)
                assert float(loss.detach()) == 0.0 and loss.shape == ()
                loss.backward()
                assert lg.grad.shape == (0, 5)


def test_meta_tensors_give_meta_results():
    meta = torch.empty(12, 5, device="meta")
    r = M.moe_route(meta, k=2)
    for groups in (None, 4, [5, 7]):
        for scale in M.AUX_SCALES:
            out = M.moe_aux_loss(meta, r, scale=scale, groups=groups)
            assert out.is_meta and out.shape == ()
            assert M.moe_aux_loss(meta, r, scale=scale, groups=groups, provider="cpu").is_meta


def test_compiled_grouped_loss_gives_the_eager_result(gen):
    logits = _logits(gen, 24, 6)
    r = M.moe_route(logits, k=2)

    def fn(x):
        return M.moe_aux_loss(x, r, scale="hf", groups=[5, 19]) + M.moe_aux_loss(x, r, groups=8)

    a, b = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    got = torch.compile(fn, fullgraph=True, backend="aot_eager")(a)
    want = fn(b)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    got.backward()
    want.backward()
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7)


def test_compiled_loss_of_a_biased_grouped_routing_gives_the_eager_result(gen):
    """The default count recomputes the plain top-K inside the compiled graph (the torch provider's top-K)."""
    logits = _logits(gen, 24, 8)
    r = M.moe_route(logits, k=2, score="sigmoid", score_bias=torch.randn(8, generator=gen) * 0.3, n_group=4,
                    topk_group=2)  # fmt: skip

    def fn(x):
        return M.moe_aux_loss(x, r, groups=[5, 19]) + M.moe_aux_loss(x, r)

    a, b = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    got = torch.compile(fn, fullgraph=True, backend="aot_eager")(a)
    want = fn(b)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(
        want, _megatron_aux_loss(logits, 2, "sigmoid") + M.moe_aux_loss_ref(logits, r, groups=[5, 19])
    )
    got.backward()
    want.backward()
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7)
