"""DeepSeek-V3 selection options of moe_route (score_bias, n_group / topk_group, scaling): every provider and
dtype against moe_route_ref, gradients against autograd of the reference, Hugging Face's own DeepseekV3TopkRouter,
ties, forced experts and typed errors."""

from __future__ import annotations

import pytest
import torch

import torsh_kernels.ops.moe as M
from tests.helpers import DEVICE, rand
from tests.ops.test_moe import _check_invariants, _route
from torsh_kernels.errors import (
    ArgumentTypeError,
    DeviceMismatchError,
    DTypeError,
    InvalidArgumentError,
    NonFiniteError,
    ShapeError,
)
from torsh_kernels.ops.moe import reference as moe_reference

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DT_IDS = ["fp32", "fp16", "bf16"]

# (T, E, K, score, renormalize, bias scale (0: no bias), n_group, topk_group, scaling, capacity_factor)
CASES = [
    pytest.param(37, 12, 3, "sigmoid", True, 0.3, 4, 2, 2.5, None, id="E12-g4-tg2-k3-sigmoid-s2.5"),
    pytest.param(29, 6, 2, "softmax", True, 0.3, 3, 1, 1.0, None, id="E6-g3-tg1-k2-softmax"),
    pytest.param(23, 7, 2, "softmax", False, 0.2, None, None, 2.5, None, id="bias-only-raw-s2.5"),
    pytest.param(19, 12, 3, "sigmoid", False, 0.0, 6, 3, 1.0, None, id="groups-only-raw"),
    pytest.param(17, 5, 2, "softmax", True, 0.3, 5, 2, 1.5, None, id="groups-of-one"),
    pytest.param(31, 8, 2, "sigmoid", True, 0.3, 4, 2, 2.5, 0.75, id="with-capacity"),
    pytest.param(19, 256, 8, "sigmoid", True, 0.3, 8, 4, 2.5, None, id="E256-g8-tg4-k8"),  # DeepSeek-V3's: 3 programs
]


def _options(E, bias_scale, n_group, topk_group, scaling, gen):
    bias = rand((E,), torch.float32, gen) * bias_scale if bias_scale else None
    return dict(score_bias=bias, n_group=n_group, topk_group=topk_group, scaling=scaling)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize(("T", "E", "K", "score", "renorm", "bs", "ng", "tg", "scaling", "cf"), CASES)
def test_selection_options_match_reference(provider, gen, dtype, T, E, K, score, renorm, bs, ng, tg, scaling, cf):
    logits = rand((T, E), dtype, gen) * 2
    kw = dict(k=K, score=score, renormalize=renorm, capacity_factor=cf, **_options(E, bs, ng, tg, scaling, gen))
    r = _route(logits, provider, **kw)
    ref = M.moe_route_ref(logits, **kw)
    assert torch.equal(r.indices, ref.indices)
    torch.testing.assert_close(r.scores, ref.scores.detach(), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(r.weights.detach(), ref.weights.detach(), atol=1e-6, rtol=1e-6)
    for f in ("tokens_per_expert", "row_map", "token_index", "dropped"):
        assert torch.equal(getattr(r, f), getattr(ref, f)), f
    assert r.num_rows == ref.num_rows and r.capacity == ref.capacity
    _check_invariants(r, T, E, K)
    # the options matter here: without them the reference chooses other experts for some tokens
    plain = M.moe_route_ref(logits, k=K, score=score, renormalize=renorm)
    assert not torch.equal(ref.indices, plain.indices)
    # weights: the chosen unbiased scores (renormalised), times the scaling
    p = moe_reference.scores_ref(logits, score).gather(1, ref.indices)
    want = (p / p.sum(1, keepdim=True) if renorm else p) * scaling
    torch.testing.assert_close(r.weights.detach(), want, atol=1e-6, rtol=1e-6)
    if ng:  # a token's experts come from at most topk_group groups
        assert int((torch.nn.functional.one_hot(r.indices // (E // ng), ng).sum(1) > 0).sum(1).max()) <= tg


def test_reference_groups_by_hand():
    """The reference's grouped selection on one token, worked out by hand: group scores are top-2 sums of the
    biased scores, the best groups are kept and the K experts come from them even where a dropped group holds
    a higher single score."""
    p = torch.tensor([[0.9, 0.0, 0.5, 0.45, 0.4, 0.4, 0.1, 0.2]])  # as sigmoid scores: logit(p)
    logits = torch.log(p / (1 - p)).clamp(-30, 30)
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.3])
    # biased: [.9, 0, .5, .45, .4, .4, .1, .5]; groups of 2: sums .9, .95, .8, .6 -> keep groups 1 and 0
    r = M.moe_route_ref(logits, k=3, score="sigmoid", score_bias=bias, n_group=4, topk_group=2)
    assert r.indices.tolist() == [[0, 2, 3]]
    # topk_group=1: only group 1 (experts 2, 3), although expert 0 scores .9
    r = M.moe_route_ref(logits, k=2, score="sigmoid", score_bias=bias, n_group=4, topk_group=1)
    assert r.indices.tolist() == [[2, 3]]
    torch.testing.assert_close(r.weights, torch.tensor([[0.5 / 0.95, 0.45 / 0.95]]))


def _pipeline(route, permute, unpermute, logits0, x0, w_expert, bias):
    logits = logits0.clone().requires_grad_()
    x = x0.clone().requires_grad_()
    r = route(logits, bias)
    yp = torch.tanh(permute(x, r).float() @ w_expert).to(x.dtype)
    y = unpermute(yp, r)
    aux = M.moe_aux_loss(logits, r)  # the unbiased probabilities, the biased choices
    loss = (y.float() * torch.linspace(-1, 1, y.shape[1], device=DEVICE)).sum() + y.float().square().sum() + aux
    loss.backward()
    return y.detach(), logits.grad, x.grad


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
@pytest.mark.parametrize("renorm", [True, False], ids=["renorm", "raw"])
def test_gradients_match_reference_autograd(provider, gen, score, renorm):
    T, E, K, H = 21, 12, 3, 7
    logits0, x0 = rand((T, E), torch.float32, gen), rand((T, H), torch.float32, gen)
    w = rand((H, H), torch.float32, gen) * 0.3
    bias = (rand((E,), torch.float32, gen) * 0.3).requires_grad_()  # a parameter: it still gets no gradient
    kw = dict(k=K, score=score, renormalize=renorm, n_group=4, topk_group=2, scaling=2.5)
    ref = _pipeline(lambda lg, b: M.moe_route_ref(lg, score_bias=b, **kw), M.moe_permute_ref, M.moe_unpermute_ref,
                    logits0, x0, w, bias)  # fmt: skip
    got = _pipeline(
        lambda lg, b: M.moe_route(lg, score_bias=b, provider=provider, **kw),
        lambda x, r: M.moe_permute(x, r, provider=provider),
        lambda y, r: M.moe_unpermute(y, r, provider=provider),
        logits0, x0, w, bias,
    )  # fmt: skip
    for name, a, b in zip(("y", "d logits", "d x"), got, ref):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5, msg=name)
    assert float(ref[1].abs().sum()) > 0
    assert bias.grad is None, "no gradient flows to the bias"


def test_scaling_scales_the_gradient(gen):
    """d loss / d logits is linear in the scaling (the weights are scaling * u)."""
    lg0 = rand((13, 8), torch.float32, gen)
    g = rand((13, 2), torch.float32, gen)
    grads = []
    for scaling in (1.0, 2.5):
        for provider in ("cpu", "torch"):
            lg = lg0.clone().requires_grad_()
            r = M.moe_route(lg, k=2, score="sigmoid", scaling=scaling, provider=provider)
            (r.weights * g).sum().backward()
            grads.append(lg.grad)
    torch.testing.assert_close(grads[0], grads[1])
    torch.testing.assert_close(grads[2], grads[3])
    torch.testing.assert_close(grads[2], 2.5 * grads[0])


# ------------------------------------------------------------------------------------ Hugging Face


def _hf_router(E, K, n_group, topk_group, scaling, H, gen):
    tr = pytest.importorskip("transformers.models.deepseek_v3.modeling_deepseek_v3")
    from transformers.models.deepseek_v3.configuration_deepseek_v3 import DeepseekV3Config

    cfg = DeepseekV3Config(hidden_size=H, n_routed_experts=E, num_experts_per_tok=K, n_group=n_group,
                           topk_group=topk_group, routed_scaling_factor=scaling, norm_topk_prob=True)  # fmt: skip
    router = tr.DeepseekV3TopkRouter(cfg)
    with torch.no_grad():
        router.weight.copy_(rand((E, H), torch.float32, gen, device="cpu") / H**0.5)
        router.e_score_correction_bias.copy_(rand((E,), torch.float32, gen, device="cpu") * 0.5)
    return router.to(DEVICE)


@pytest.mark.parametrize(("E", "K", "ng", "tg"), [(32, 4, 8, 4), (12, 3, 4, 2), (16, 6, 4, 2)], ids=str)
def test_matches_hugging_face_deepseek_v3_router(provider, gen, E, K, ng, tg):
    """Hugging Face's DeepseekV3TopkRouter (sigmoid, e_score_correction_bias, grouped top-k, renormalised,
    routed_scaling_factor) on the same weights and hidden states: the same expert set per token (HF's topk is
    unsorted) and the same weights; the plain route (no bias, no groups) disagrees on most tokens."""
    T, H, scaling = 65, 24, 2.5
    router = _hf_router(E, K, ng, tg, scaling, H, gen)
    h = rand((T, H), torch.float32, gen)
    g = rand((T, K), torch.float32, gen)
    w_hf = router.weight
    w_ours = router.weight.detach().clone().requires_grad_()
    _, weights_hf, idx_hf = router(h)
    bias = router.e_score_correction_bias
    logits = torch.nn.functional.linear(h, w_ours)
    r = M.moe_route(logits, k=K, score="sigmoid", score_bias=bias, n_group=ng, topk_group=tg, scaling=scaling,
                    provider=provider)  # fmt: skip
    order_hf = idx_hf.sort(1)
    order = r.indices.sort(1)
    assert torch.equal(order.values, order_hf.values), "the same experts per token"
    w_sorted = r.weights.gather(1, order.indices)
    hf_sorted = weights_hf.gather(1, order_hf.indices)
    torch.testing.assert_close(w_sorted, hf_sorted, atol=1e-6, rtol=1e-5)
    # gradients into the router weight through the combine weights
    (w_sorted * g).sum().backward()
    (hf_sorted * g).sum().backward()
    torch.testing.assert_close(w_ours.grad, w_hf.grad, atol=1e-5, rtol=1e-4)
    # without the bias and the groups the plain route picks other sets: the comparison above can fail
    plain = M.moe_route(logits.detach(), k=K, score="sigmoid", scaling=scaling, provider=provider)
    agree = (plain.indices.sort(1).values == order_hf.values).all(1).float().mean().item()
    assert agree < 0.5, f"the plain route agrees with HF's on {agree:.0%} of tokens"


# ------------------------------------------------------------------------------------ ties, forcing, NaN


def test_equal_biased_scores_go_to_the_lower_index(provider):
    """Keys (score + bias) that tie exactly, from equal and from different scores, in and across groups: the
    lower expert, and on equal group scores the lower group, on every provider."""
    ninf = float("-inf")
    # softmax: scores .25 (x4) and 0 (x4), all exact; bias evens the keys out to .25
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0, ninf, ninf, ninf, ninf]] * 3, device=DEVICE)
    logits[1] = logits[1].flip(0)  # scores 0 (x4) then .25 (x4)
    logits[2] = torch.tensor([0.0, ninf, 0.0, ninf, 0.0, ninf, 0.0, ninf], device=DEVICE)
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.25, 0.25, 0.25, 0.25], device=DEVICE)
    r = _route(logits, provider, k=3, score_bias=bias)
    # row 0: keys .25, .25, .25, .25, .25, .25, .25, .25; row 1: .0 x4, .5 x4; row 2: .25, 0, .25, 0, .5, .25, .5, .25
    assert r.indices.tolist() == [[0, 1, 2], [4, 5, 6], [4, 6, 0]]
    torch.testing.assert_close(r.scores, torch.tensor([[0.25] * 3, [0.25] * 3, [0.25] * 3], device=DEVICE))
    # groups of two: row 0 all groups tie (.5) -> groups 0, 1; row 1: groups 2, 3 (1.0) -> experts 4, 5, 6
    r = _route(logits, provider, k=3, score_bias=bias, n_group=4, topk_group=2)
    # row 2: group sums .25, .25, .75, .75 -> groups 2, 3 -> keys .5 .25 .5 .25 -> 4, 6, 5
    assert r.indices.tolist() == [[0, 1, 2], [4, 5, 6], [4, 6, 5]]
    # sigmoid(0) = .5 everywhere; equal biases tie
    s0 = torch.zeros(2, 6, device=DEVICE)
    b = torch.tensor([0.125, 0.25, 0.25, 0.125, 0.25, 0.0], device=DEVICE)
    r = _route(s0, provider, k=3, score="sigmoid", score_bias=b)
    assert r.indices.tolist() == [[1, 2, 4], [1, 2, 4]]
    r = _route(s0, provider, k=2, score="sigmoid", score_bias=b, n_group=3, topk_group=1)  # sums 1.375 1.375 1.25
    assert r.indices.tolist() == [[1, 0], [1, 0]]
    torch.testing.assert_close(r.weights, torch.full((2, 2), 0.5, device=DEVICE))


def test_a_large_bias_forces_an_expert(provider, gen):
    """A bias of 10 on expert 5 puts it first for every token (its group kept); the weights still come from the
    unbiased scores."""
    T, E = 25, 8
    logits = rand((T, E), torch.float32, gen)
    logits[:, 5] = -4.0  # an expert nobody would choose
    bias = torch.zeros(E, device=DEVICE)
    bias[5] = 10.0
    for groups in ({}, dict(n_group=4, topk_group=1)):
        r = _route(logits, provider, k=2, score="sigmoid", score_bias=bias, scaling=2.0, **groups)
        assert bool((r.indices[:, 0] == 5).all())
        if groups:  # the kept group is 2 (experts 4, 5): the second choice is expert 4
            assert bool((r.indices[:, 1] == 4).all())
        assert r.tokens_per_expert[5].item() == T
        s = torch.sigmoid(logits).gather(1, r.indices)
        torch.testing.assert_close(r.scores, s)
        torch.testing.assert_close(r.weights, 2.0 * s / s.sum(1, keepdim=True))


def test_zero_bias_and_one_group_change_nothing(provider, gen):
    """The option path with options that select like no options gives the plain route, bit for bit."""
    logits = rand((27, 9), torch.float32, gen)
    plain = _route(logits, provider, k=3, score="sigmoid")
    for kw in (dict(score_bias=torch.zeros(9, device=DEVICE)), dict(n_group=1, topk_group=1),
               dict(n_group=3, topk_group=3, score_bias=torch.zeros(9, device=DEVICE))):  # fmt: skip
        r = _route(logits, provider, k=3, score="sigmoid", **kw)
        for f in ("indices", "weights", "scores", "row_map", "token_index", "tokens_per_expert"):
            assert torch.equal(getattr(r, f), getattr(plain, f)), (kw, f)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # NaN arithmetic in the emulators
def test_nan_scores_with_the_options(provider, gen):
    """NaN scores raise as without the options; routed anyway (check_finite=False) they rank below every real
    key inside the kept groups, as the reference says, on every provider."""
    logits = rand((6, 8), torch.float32, gen)
    logits[1, 2] = float("nan")  # sigmoid: one NaN score
    logits[3, :] = float("nan")  # every score NaN
    kw = dict(k=3, score="sigmoid", score_bias=rand((8,), torch.float32, gen) * 0.2, n_group=4, topk_group=2)
    with pytest.raises(NonFiniteError, match="2 of 6 tokens"):
        M.moe_route(logits, provider=provider, **kw)
    r = M.moe_route(logits, provider=provider, check_finite=False, **kw)
    ref = M.moe_route_ref(logits, **kw)
    assert torch.equal(r.indices, ref.indices)
    assert r.indices[3].tolist() == [0, 1, 2]  # all keys -inf: groups 0, 1, then the lowest experts
    _check_invariants(r, 6, 8, 3)


# ------------------------------------------------------------------------------------ the bias's values


def test_the_bias_is_read_again_after_an_in_place_update(provider):
    """Values are checked once per version of the bias tensor: an in-place update (a balancer's step) is seen,
    both in the selection and in the finite check."""
    logits = torch.zeros(3, 4, device=DEVICE)
    bias = torch.tensor([0.0, 0.1, 0.2, 0.3], device=DEVICE)
    assert M.moe_route(logits, k=1, score_bias=bias, provider=provider).indices[:, 0].tolist() == [3, 3, 3]
    with torch.no_grad():
        bias[0] = 1.0
    assert M.moe_route(logits, k=1, score_bias=bias, provider=provider).indices[:, 0].tolist() == [0, 0, 0]
    bias[1] = float("nan")
    for _ in range(2):
        with pytest.raises(NonFiniteError, match="score_bias holds 1 non-finite"):
            M.moe_route(logits, k=1, score_bias=bias, provider=provider)
    bias[1] = 0.0
    assert M.moe_route(logits, k=1, score_bias=bias, provider=provider).indices[:, 0].tolist() == [0, 0, 0]


def _assert_option_errors(lg: torch.Tensor, provider: str | None) -> None:
    E = lg.shape[1]

    def route(**kw):
        return M.moe_route(lg, k=kw.pop("k", 2), provider=provider, **kw)

    with pytest.raises(ArgumentTypeError, match=r"score_bias must be a torch\.Tensor"):
        route(score_bias=[0.0] * E)
    for bad in (torch.zeros(E, dtype=torch.float16), torch.zeros(E, dtype=torch.float64), torch.zeros(E).long()):
        with pytest.raises(DTypeError, match="score_bias has dtype"):
            route(score_bias=bad)
    for bad in (torch.zeros(E + 1), torch.zeros(1, E), torch.zeros(())):
        with pytest.raises(ShapeError, match=r"score_bias must be \[E=12\]"):
            route(score_bias=bad)
    with pytest.raises(DeviceMismatchError, match="score_bias is on meta"):
        route(score_bias=torch.zeros(E, device="meta"))
    for v in (float("nan"), float("inf"), float("-inf")):
        b = torch.zeros(E)
        b[3] = v
        with pytest.raises(NonFiniteError, match="score_bias holds 1 non-finite"):
            route(score_bias=b)
    for kw in (dict(n_group=4), dict(topk_group=2)):
        with pytest.raises(InvalidArgumentError, match="give both"):
            route(**kw)
    for ng in (0, -1, 13):
        with pytest.raises(InvalidArgumentError, match=f"n_group={ng} must be an int"):
            route(n_group=ng, topk_group=1)
    with pytest.raises(InvalidArgumentError, match="n_group=5 does not split"):
        route(n_group=5, topk_group=1)
    for ng in (4.0, True, "4"):
        with pytest.raises(ArgumentTypeError, match="n_group must be an int"):
            route(n_group=ng, topk_group=2)
    for tg in (0, 5):
        with pytest.raises(InvalidArgumentError, match=f"topk_group={tg} must be an int"):
            route(n_group=4, topk_group=tg)
    with pytest.raises(ArgumentTypeError, match="topk_group must be an int"):
        route(n_group=4, topk_group=2.0)
    with pytest.raises(InvalidArgumentError, match="k=7 is more than the 6 experts"):
        route(k=7, n_group=4, topk_group=2)
    for s in (0, -1.0, float("nan"), float("inf"), 10**400):
        with pytest.raises(InvalidArgumentError, match=r"scaling=.* must be a finite number in \(0, "):
            route(scaling=s)
    for s in ("2", True, None, torch.tensor(2.0)):
        with pytest.raises(ArgumentTypeError, match="scaling must be a number"):
            route(scaling=s)


def test_typed_errors_of_the_selection_options():
    E = 12
    for lg in (torch.randn(5, E), torch.randn(5, E).half(), torch.randn(5, 2 * E)[:, ::2]):  # fast and general paths
        for provider in ("cpu", "torch", None):
            _assert_option_errors(lg, provider)
    # accepted: an int scaling, a strided bias, a bias parameter; a meta bias with meta logits (shapes only)
    lg = torch.randn(5, E)
    r = M.moe_route(lg, k=2, scaling=2, score_bias=torch.zeros(2 * E)[::2])
    torch.testing.assert_close(r.weights.sum(1), torch.full((5,), 2.0))
    param = torch.nn.Parameter(torch.zeros(E))
    param.data[7] = 5.0
    r = M.moe_route(lg, k=2, score_bias=param)
    assert bool((r.indices[:, 0] == 7).all()) and param.grad is None
    r = M.moe_route(torch.empty(5, E, device="meta"), k=2, score_bias=torch.empty(E, device="meta"), n_group=4,
                    topk_group=2)  # fmt: skip
    assert r.indices.is_meta and r.indices.shape == (5, 2)


def test_the_aux_loss_uses_the_unbiased_probabilities(gen):
    """P from the unbiased softmax; f from the unbiased top-K by default (Megatron-Core's rule), from the biased
    choices with count="routed": E * sum_e f_e P_e, by hand."""
    logits = rand((31, 6), torch.float32, gen)
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 1.0])
    r = M.moe_route(logits, k=2, score_bias=bias)
    p = torch.softmax(logits, -1)
    f = torch.bincount(r.indices.reshape(-1), minlength=6).float() / (31 * 2)
    f_top = torch.bincount(torch.topk(p, 2, dim=1).indices.reshape(-1), minlength=6).float() / (31 * 2)
    for provider in ("cpu", "torch"):
        torch.testing.assert_close(M.moe_aux_loss(logits, r, count="routed", provider=provider),
                                   6 * (f * p.mean(0)).sum())  # fmt: skip
        torch.testing.assert_close(M.moe_aux_loss(logits, r, provider=provider), 6 * (f_top * p.mean(0)).sum())
    assert f[5] == 0.5  # every token chose the biased expert


def test_the_options_compile_without_a_graph_break(gen):
    """torch.compile(fullgraph=True) of a route with every option: the reference's routing and gradients, and
    the bias's finite check at run time (it lives in the custom op)."""
    logits = rand((33, 12), torch.float32, gen, device="cpu").requires_grad_()
    bias = rand((12,), torch.float32, gen, device="cpu") * 0.3
    kw = dict(k=3, score="sigmoid", n_group=4, topk_group=2, scaling=2.5)

    def route(lg, b):
        r = M.moe_route(lg, score_bias=b, **kw)
        return r.weights, r.indices

    compiled = torch.compile(route, fullgraph=True, backend="aot_eager")
    w, idx = compiled(logits, bias)
    ref = M.moe_route_ref(logits, score_bias=bias, **kw)
    assert torch.equal(idx, ref.indices)
    torch.testing.assert_close(w, ref.weights)
    (got,) = torch.autograd.grad(w.sum(), logits)
    (want,) = torch.autograd.grad(ref.weights.sum(), logits)
    torch.testing.assert_close(got, want)
    bad = bias.clone()
    bad[0] = float("inf")
    with pytest.raises(NonFiniteError, match="score_bias holds 1 non-finite"):
        compiled(logits, bad)
