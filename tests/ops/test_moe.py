"""MoE routing ops: every provider and dtype against the torch reference (and against hand-built
expectations for ties, capacity and the losses), gradients against autograd of the reference, typed errors."""

from __future__ import annotations

import dataclasses
import math
import pickle

import pytest
import torch

import torsh_kernels.ops.moe as M
import torsh_kernels.ops.moe.providers as P
from tests.helpers import DEVICE, DTYPE_TOLS, rand
from torsh_kernels.errors import ArgumentTypeError, DTypeError, InvalidArgumentError, NonFiniteError, ShapeError
from torsh_kernels.ops.moe import custom as moe_ops

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DT_IDS = ["fp32", "fp16", "bf16"]

# (T, E, K, score, renormalize, capacity_factor, drop_policy)
CASES = [
    pytest.param(37, 6, 2, "softmax", True, None, "probability", id="T37-E6-k2"),
    pytest.param(1, 5, 1, "softmax", True, None, "probability", id="T1-k1"),
    pytest.param(13, 5, 5, "sigmoid", False, None, "probability", id="k=E-sigmoid"),
    pytest.param(41, 7, 3, "sigmoid", True, 0.5, "probability", id="cap-prob-sigmoid"),
    pytest.param(41, 7, 2, "softmax", False, 0.75, "position", id="cap-position"),
    pytest.param(64, 3, 1, "softmax", True, 1.0, "probability", id="E3-cap1.0"),
    pytest.param(1, 3, 2, "softmax", True, 0.25, "probability", id="T1-cap"),
]


def _poison_allocator(n_bytes: int) -> None:
    """Fill memory the allocator is about to hand out again with NaN, so an output element an op never
    writes is NaN (or garbage), not a value left over from an earlier identical computation."""
    torch.full((max(1, n_bytes // 4) + 64,), float("nan"), device=DEVICE).sum()


def _route(logits, provider, **kw):
    _poison_allocator(logits.numel() * 16)
    return M.moe_route(logits, provider=provider, **kw)


def _check_invariants(r: M.Routing, T: int, E: int, K: int) -> None:
    rows = r.row_map
    kept = rows >= 0
    n = r.num_rows
    assert int(kept.sum()) == n == r.token_index.numel() == int(r.tokens_per_expert.sum())
    assert torch.equal(torch.sort(rows[kept]).values, torch.arange(n, device=rows.device)), "rows are a permutation"
    tok = torch.arange(T, device=rows.device)[:, None].expand(T, K)
    assert torch.equal(r.token_index[rows[kept]], tok[kept]), "token_index inverts row_map"
    assert torch.equal(r.dropped, ~kept)
    # groups in ascending expert order, tokens ascending inside each group
    expert_of_row = torch.empty(n, dtype=torch.int64, device=rows.device)
    expert_of_row[rows[kept]] = r.indices[kept]
    assert bool((expert_of_row[1:] >= expert_of_row[:-1]).all())
    same = expert_of_row[1:] == expert_of_row[:-1]
    assert bool((r.token_index[1:][same] > r.token_index[:-1][same]).all())
    assert torch.equal(torch.bincount(expert_of_row, minlength=E), r.tokens_per_expert)
    if r.capacity is not None:
        assert int(r.tokens_per_expert.max()) <= r.capacity
    # each token's experts are distinct
    assert bool((torch.sort(r.indices, 1).values.diff(dim=1) > 0).all()) if K > 1 else True


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize(("T", "E", "K", "score", "renorm", "cf", "policy"), CASES)
def test_route_matches_reference(provider, gen, dtype, T, E, K, score, renorm, cf, policy):
    logits = rand((T, E), dtype, gen) * 2
    kw = dict(k=K, score=score, renormalize=renorm, capacity_factor=cf, drop_policy=policy)
    r = _route(logits, provider, **kw)
    ref = M.moe_route_ref(logits, **kw)
    assert r.indices.dtype == r.row_map.dtype == r.token_index.dtype == r.tokens_per_expert.dtype == torch.int64
    assert r.weights.dtype == r.scores.dtype == torch.float32
    assert r.indices.shape == r.weights.shape == r.row_map.shape == (T, K)
    assert torch.equal(r.indices, ref.indices)
    torch.testing.assert_close(r.scores, ref.scores.detach(), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(r.weights.detach(), ref.weights.detach(), atol=1e-6, rtol=1e-6)
    assert torch.equal(r.tokens_per_expert, ref.tokens_per_expert)
    assert torch.equal(r.row_map, ref.row_map)
    assert torch.equal(r.token_index, ref.token_index)
    assert torch.equal(r.dropped, ref.dropped)
    assert r.capacity == ref.capacity and r.num_rows == ref.num_rows
    _check_invariants(r, T, E, K)
    if cf is not None and T > 1:
        assert r.num_dropped > 0, "the capacity cases are built to overflow"


def test_route_weights_definition(provider, gen):
    """Weights are the chosen scores (renormalised to sum 1), scores descend, k=E picks every expert."""
    logits = rand((29, 6), torch.float32, gen)
    p = torch.softmax(logits.float(), -1)
    r = _route(logits, provider, k=6)
    assert torch.equal(torch.sort(r.indices, 1).values, torch.arange(6, device=DEVICE).expand(29, 6))
    torch.testing.assert_close(r.weights, p.gather(1, r.indices), atol=1e-6, rtol=1e-6)
    r = _route(logits, provider, k=3, renormalize=True)
    torch.testing.assert_close(r.weights.sum(1), torch.ones(29, device=DEVICE))
    torch.testing.assert_close(r.scores, p.gather(1, r.indices), atol=1e-6, rtol=1e-6)
    assert bool((r.scores.diff(dim=1) <= 0).all())
    assert torch.equal(r.indices[:, 0], p.argmax(1))
    s = torch.sigmoid(logits.float())
    r = _route(logits, provider, k=2, score="sigmoid", renormalize=False)
    torch.testing.assert_close(r.weights, s.gather(1, r.indices), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("bias", [False, True])
def test_sigmoid_scores_that_underflow_give_zero_weights_on_every_provider(provider, bias):
    """A collapsed router: sigmoid logits below about -88 underflow to a score of 0 in fp32, so a token's chosen
    scores sum to 0. Renormalised, its weights are 0 on every provider (the divisor is 1 where the sum is 0:
    reference.row_sums), not a ZeroDivisionError (cpu), NaN (torch) or anything else; tokens beside it route as
    always, and the backward gives finite gradients (0 for the underflowed tokens)."""
    logits = torch.full((5, 8), -100.0, device=DEVICE)
    logits[3] = torch.linspace(-2.0, 2.0, 8, device=DEVICE)  # a token that routes normally
    kw = {"score_bias": torch.linspace(0.0, 0.7, 8, device=DEVICE), "n_group": 4, "topk_group": 2} if bias else {}
    r = _route(logits, provider, k=2, score="sigmoid", renormalize=True, **kw)
    ref = M.moe_route_ref(logits, k=2, score="sigmoid", renormalize=True, **kw)
    dead = torch.tensor([True, True, True, False, True], device=DEVICE)
    assert torch.equal(r.scores[dead], torch.zeros(4, 2, device=DEVICE))
    assert torch.equal(r.weights[dead], torch.zeros(4, 2, device=DEVICE)), r.weights
    torch.testing.assert_close(r.weights[3].sum(), torch.tensor(1.0, device=DEVICE))
    torch.testing.assert_close(r.weights, ref.weights, atol=1e-6, rtol=1e-6)
    assert torch.equal(r.indices, ref.indices)
    x = logits.clone().requires_grad_(True)
    rg = M.moe_route(x, k=2, score="sigmoid", renormalize=True, provider=provider, **kw)
    (rg.weights * torch.arange(1.0, 3.0, device=DEVICE)).sum().backward()
    assert bool(torch.isfinite(x.grad).all()) and torch.equal(x.grad[dead], torch.zeros(4, 8, device=DEVICE))
    assert bool(x.grad[3].abs().sum() > 0)


def test_route_ties_go_to_the_lower_expert(provider):
    logits = torch.tensor(
        [[0.0, 0.0, 0.0, 0.0, 0.0], [1.0, 2.0, 2.0, 1.0, 2.0], [3.0, -1.0, 3.0, 3.0, -1.0]], device=DEVICE
    )
    r = _route(logits, provider, k=3)
    assert r.indices.tolist() == [[0, 1, 2], [1, 2, 4], [0, 2, 3]]
    torch.testing.assert_close(r.weights, torch.full((3, 3), 1 / 3, device=DEVICE))
    r = _route(logits, provider, k=1)
    assert r.indices.tolist() == [[0], [1], [0]]


def test_capacity_formula():
    assert M.expert_capacity(16, 2, 8, 1.0) == 4
    assert M.expert_capacity(10, 2, 3, 1.0) == 7  # ceil(20 / 3)
    assert M.expert_capacity(10, 1, 4, 0.25) == 1  # ceil(0.625)
    assert M.expert_capacity(1, 1, 64, 1.0) == 1
    assert M.expert_capacity(12, 2, 8, 1.0) == 3  # exactly 3, not 4 from rounding noise


def test_all_tokens_to_one_expert_and_overflow(provider):
    """Every token prefers expert 2; capacity C=ceil(T*k*cf/E) keeps the first C tokens (position) or the
    C highest scores (probability)."""
    T, E = 11, 5
    logits = torch.zeros(T, E, device=DEVICE)
    logits[:, 2] = torch.tensor([3.0, 5.0, 4.0, 5.0, 1.0, 2.0, 6.0, 0.5, 5.0, 7.0, 3.5], device=DEVICE)
    r = _route(logits, provider, k=1)
    assert r.tokens_per_expert.tolist() == [0, 0, T, 0, 0]
    assert r.row_map[:, 0].tolist() == list(range(T)) and r.token_index.tolist() == list(range(T))
    C = M.expert_capacity(T, 1, E, 2.0)  # ceil(22 / 5) = 5
    assert C == 5
    r = _route(logits, provider, k=1, capacity_factor=2.0, drop_policy="position")
    assert r.capacity == 5 and r.tokens_per_expert.tolist() == [0, 0, 5, 0, 0]
    assert r.token_index.tolist() == [0, 1, 2, 3, 4] and r.dropped[:, 0].tolist() == [False] * 5 + [True] * 6
    r = _route(logits, provider, k=1, capacity_factor=2.0, drop_policy="probability")
    # logits 7, 6, then three 5s tie for the last places: all kept (exactly C). Token order inside the group.
    assert r.token_index.tolist() == [1, 3, 6, 8, 9]
    assert r.row_map[:, 0].tolist() == [-1, 0, -1, 1, -1, -1, 2, -1, 3, 4, -1]
    # ties at the threshold: the lower tokens win
    r = _route(logits, provider, k=1, capacity_factor=1.5, drop_policy="probability")  # C = ceil(16.5/5) = 4
    assert r.capacity == 4 and r.token_index.tolist() == [1, 3, 6, 9]


def test_dropped_tokens_come_back_as_zeros(provider, gen):
    T, E, H = 9, 3, 5
    logits = torch.zeros(T, E, device=DEVICE)
    logits[:, 0] = 4.0  # all to expert 0 first
    r = _route(logits, provider, k=1, capacity_factor=1.0, drop_policy="position")  # C = 3
    x = rand((T, H), torch.float32, gen)
    y = M.moe_unpermute(M.moe_permute(x, r, provider=provider), r, weights=False, provider=provider)
    assert torch.equal(y[:3], x[:3]) and torch.equal(y[3:], torch.zeros(6, H, device=DEVICE))


# (T, E, K, H, cf)
PERM_CASES = [
    pytest.param(37, 6, 2, 19, None, id="T37-H19"),
    pytest.param(1, 3, 1, 7, None, id="T1"),
    pytest.param(23, 5, 5, 33, None, id="k=E"),
    pytest.param(13, 7, 3, 1030, 0.5, id="cap-H1030", marks=pytest.mark.slow),  # C = ceil(0.5 * 13 * 3 / 7) = 3
]


@pytest.mark.parametrize(("dtype", "atol", "rtol"), DTYPE_TOLS)
@pytest.mark.parametrize(("T", "E", "K", "H", "cf"), PERM_CASES)
def test_permute_unpermute_match_reference(provider, gen, dtype, atol, rtol, T, E, K, H, cf):
    logits = rand((T, E), torch.float32, gen)
    r = M.moe_route(logits, k=K, capacity_factor=cf, provider="torch")
    x = rand((T, H), dtype, gen)
    _poison_allocator(r.num_rows * H * x.element_size())
    xp = M.moe_permute(x, r, provider=provider)
    assert xp.shape == (r.num_rows, H) and xp.dtype == dtype
    assert torch.equal(xp, M.moe_permute_ref(x, r)), "permute is an exact copy"
    y_perm = rand((r.num_rows, H), dtype, gen)
    for weights in (True, False):
        _poison_allocator(T * H * x.element_size())
        y = M.moe_unpermute(y_perm, r, weights=weights, provider=provider)
        assert y.shape == (T, H) and y.dtype == dtype
        torch.testing.assert_close(y, M.moe_unpermute_ref(y_perm, r, weights=weights), atol=atol, rtol=rtol)


@pytest.mark.parametrize("block", [16, 64])
@pytest.mark.parametrize(("dtype", "atol", "rtol"), DTYPE_TOLS)
def test_permute_kernels_over_several_column_blocks(provider, gen, monkeypatch, block, dtype, atol, rtol):
    """Rows longer than a program's columns (the Triton launchers' ROW_BLOCK and BWD_BLOCK made small: H = 37 is
    three programs a row or one masked one, the backward's loop turns three times or once), with drops and padding
    rows, and the implementations below the public ops (the weighted permute; the unpermute backward), outputs
    poisoned: exact where the reference is exact."""
    monkeypatch.setattr(P, "ROW_BLOCK", block)
    monkeypatch.setattr(P, "BWD_BLOCK", block)
    T, E, K, H = 11, 4, 2, 37
    logits = rand((T, E), torch.float32, gen)
    x = rand((T, H), dtype, gen)
    for pad in (False, True):
        r = M.moe_route(logits, k=K, capacity_factor=0.7, pad_to_capacity=pad, provider="torch")
        assert bool(r.dropped.any())
        _poison_allocator(r.num_rows * H * x.element_size())
        assert torch.equal(M.moe_permute(x, r, provider=provider), M.moe_permute_ref(x, r))
        yp = rand((r.num_rows, H), dtype, gen)
        for weights in (True, False):
            _poison_allocator(T * H * x.element_size())
            y = M.moe_unpermute(yp, r, weights=weights, provider=provider)
            torch.testing.assert_close(y, M.moe_unpermute_ref(yp, r, weights=weights), atol=atol, rtol=rtol)
    rows, tok, w = r.row_map, r.token_index, r.weights
    got, want = torch.full_like(yp, float("nan")), torch.full_like(yp, float("nan"))
    P.scatter_rows.impls[provider](x, rows, tok, w, got)
    P.scatter_rows.impls["torch"](x, rows, tok, w, want)
    assert torch.equal(got.isnan(), want.isnan()), "padding rows untouched, every kept row written"
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol, equal_nan=True)
    gy = rand((T, H), dtype, gen)
    got, want = torch.full_like(yp, float("nan")), torch.full_like(yp, float("nan"))
    gw = P.gather_rows_bwd.impls[provider](gy, yp, rows, w, got)
    gw_ref = P.gather_rows_bwd.impls["torch"](gy, yp, rows, w, want)
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol, equal_nan=True)
    torch.testing.assert_close(gw, gw_ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_permute_then_unpermute_is_weighted_identity(provider, gen, dtype):
    """With renormalised weights and no drops, unpermute(permute(x)) == x (weights sum to one)."""
    T, E, H = 31, 6, 21
    r = M.moe_route(rand((T, E), torch.float32, gen), k=3, provider=provider)
    x = rand((T, H), dtype, gen)
    y = M.moe_unpermute(M.moe_permute(x, r, provider=provider), r, provider=provider)
    tol = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    torch.testing.assert_close(y, x, atol=tol, rtol=tol)


def _pipeline(route, permute, unpermute, logits0, x0, w_expert):
    logits = logits0.clone().requires_grad_()
    x = x0.clone().requires_grad_()
    r = route(logits)
    xp = permute(x, r)
    yp = torch.tanh(xp.float() @ w_expert).to(x.dtype)
    y = unpermute(yp, r)
    aux = M.moe_aux_loss(logits, r) + M.moe_z_loss(logits)
    loss = (y.float() * torch.linspace(-1, 1, y.shape[1], device=DEVICE)).sum() + y.float().square().sum() + aux
    loss.backward()
    return y.detach(), logits.grad, x.grad


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
@pytest.mark.parametrize("renorm", [True, False], ids=["renorm", "raw"])
@pytest.mark.parametrize("cf", [None, 0.6], ids=["nocap", "cap"])
def test_gradients_match_reference_autograd(provider, gen, score, renorm, cf):
    T, E, K, H = 23, 5, 2, 13
    logits0, x0 = rand((T, E), torch.float32, gen), rand((T, H), torch.float32, gen)
    w = rand((H, H), torch.float32, gen) * 0.3
    kw = dict(k=K, score=score, renormalize=renorm, capacity_factor=cf)
    ref = _pipeline(lambda lg: M.moe_route_ref(lg, **kw), M.moe_permute_ref, M.moe_unpermute_ref, logits0, x0, w)
    got = _pipeline(
        lambda lg: M.moe_route(lg, provider=provider, **kw),
        lambda x, r: M.moe_permute(x, r, provider=provider),
        lambda y, r: M.moe_unpermute(y, r, provider=provider),
        logits0, x0, w,
    )  # fmt: skip
    for name, a, b in zip(("y", "d logits", "d x"), got, ref):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5, msg=name)
    assert float(ref[1].abs().sum()) > 0 and float(ref[2].abs().sum()) > 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_gradients_low_precision(provider, gen, dtype):
    """bf16/fp16 activations and logits: gradients of x and y_perm are the reference's within the dtype."""
    T, E, K, H = 17, 4, 2, 9
    logits = rand((T, E), dtype, gen).requires_grad_()
    x = rand((T, H), dtype, gen).requires_grad_()
    g = rand((T, H), dtype, gen)
    outs = []
    for p in (provider, None):
        lg, xx = logits.detach().clone().requires_grad_(), x.detach().clone().requires_grad_()
        if p is None:
            r = M.moe_route_ref(lg, k=K)
            y = M.moe_unpermute_ref(M.moe_permute_ref(xx, r) * 2, r)
        else:
            r = M.moe_route(lg, k=K, provider=p)
            y = M.moe_unpermute(M.moe_permute(xx, r, provider=p) * 2, r, provider=p)
        (y.float() * g.float()).sum().backward()
        assert lg.grad.dtype == dtype and xx.grad.dtype == dtype
        outs.append((lg.grad, xx.grad))
    tol = {torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, atol=tol, rtol=tol)


def test_weight_gradient_of_dropped_assignment_is_zero(provider, gen):
    T, E, H = 8, 2, 4
    logits = torch.zeros(T, E, device=DEVICE)
    logits[:, 1] = torch.linspace(1, 2, T, device=DEVICE)
    logits.requires_grad_()
    r = M.moe_route(logits, k=1, capacity_factor=0.5, drop_policy="position", provider=provider, renormalize=False)
    y = M.moe_unpermute(rand((r.num_rows, H), torch.float32, gen), r, provider=provider)
    y.sum().backward()
    kept = ~r.dropped[:, 0]
    assert int(kept.sum()) == 2
    assert bool((logits.grad[~kept] == 0).all()) and bool((logits.grad[kept] != 0).any())


# ------------------------------------------------------------------------------------------ losses


def test_aux_loss_hand_computed():
    ln3 = math.log(3.0)
    logits = torch.tensor([[0.0, ln3], [0.0, ln3]], requires_grad=True)  # probs [.25, .75] each
    r = M.moe_route(logits, k=1)
    assert r.indices.tolist() == [[1], [1]]
    loss = M.moe_aux_loss(logits, r)  # f = [0, 1], P = [.25, .75] -> 2 * .75
    assert loss.item() == pytest.approx(1.5, abs=1e-6)
    loss.backward()  # dL/dl_t = (2 / T) * p_t1 * (onehot_1 - p_t)
    torch.testing.assert_close(logits.grad, torch.tensor([[-0.1875, 0.1875], [-0.1875, 0.1875]]))
    balanced = torch.tensor([[0.0, 5.0], [5.0, 0.0]])
    assert M.moe_aux_loss(balanced, M.moe_route(balanced, k=1)).item() == pytest.approx(1.0, abs=1e-6)
    # k=2 of E=2: every expert gets half the assignments: E * sum(0.5 * P_e) = 1
    assert M.moe_aux_loss(logits, M.moe_route(logits, k=2)).item() == pytest.approx(1.0, abs=1e-6)
    # from probabilities, and sigmoid scores normalised per token
    p = torch.tensor([[0.1, 0.9], [0.3, 0.7]])
    assert M.moe_aux_loss(p, r, from_probs=True).item() == pytest.approx(2 * 0.8, abs=1e-6)
    lg = torch.tensor([[0.0, 0.0], [0.0, 0.0]])  # sigmoid .5, .5 -> normalised .5, .5
    rs = M.moe_route(lg, k=1, score="sigmoid")
    assert rs.indices.tolist() == [[0], [0]]
    assert M.moe_aux_loss(lg, rs).item() == pytest.approx(2 * 0.5, abs=1e-6)


def test_z_loss_hand_computed():
    ln3 = math.log(3.0)
    logits = torch.tensor([[0.0, 0.0], [ln3, 0.0]], requires_grad=True)  # lse: ln 2, ln 4
    loss = M.moe_z_loss(logits)
    ln2 = math.log(2.0)
    assert loss.item() == pytest.approx(2.5 * ln2**2, rel=1e-6)
    loss.backward()  # d/dl = 2 * lse * softmax / T
    expect = torch.tensor([[ln2 * 0.5, ln2 * 0.5], [2 * ln2 * 0.75, 2 * ln2 * 0.25]])
    torch.testing.assert_close(logits.grad, expect)
    big = torch.tensor([[1000.0, 1000.0]], dtype=torch.bfloat16)  # computed in fp32, no overflow
    assert M.moe_z_loss(big).item() == pytest.approx((1000 + ln2) ** 2, rel=1e-5)


# ------------------------------------------------------------------------------------------ errors


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # NaN arithmetic in the emulators
def test_nonfinite_logits(provider):
    logits = torch.randn(6, 4, device=DEVICE)
    logits[2, 1] = float("nan")
    logits[4] = float("-inf")  # a softmax row of all -inf
    with pytest.raises(NonFiniteError, match="2 of 6 tokens"):
        M.moe_route(logits, k=2, provider=provider)
    r = M.moe_route(logits, k=2, provider=provider, check_finite=False)  # routed anyway, indices valid
    assert bool(((r.indices >= 0) & (r.indices < 4)).all())
    _check_invariants(r, 6, 4, 2)
    masked = torch.randn(6, 4, device=DEVICE)
    masked[:, 3] = float("-inf")  # masking an expert with -inf is legitimate
    r = M.moe_route(masked, k=2, provider=provider)
    assert bool((r.indices != 3).all())


def test_typed_errors():
    lg = torch.randn(5, 4)
    with pytest.raises(ShapeError, match=r"\[T, E\]"):
        M.moe_route(lg.view(-1), k=1)
    with pytest.raises(InvalidArgumentError, match="k=5"):
        M.moe_route(lg, k=5)
    with pytest.raises(InvalidArgumentError, match="k=0"):
        M.moe_route(lg, k=0)
    with pytest.raises(ArgumentTypeError, match="k must be an int"):
        M.moe_route(lg, k=2.0)
    with pytest.raises(InvalidArgumentError, match="score="):
        M.moe_route(lg, k=1, score="relu")
    with pytest.raises(InvalidArgumentError, match="drop_policy="):
        M.moe_route(lg, k=1, capacity_factor=1.0, drop_policy="random")
    for bad in (0, -1.0, float("nan"), float("inf")):
        with pytest.raises(InvalidArgumentError, match="capacity_factor"):
            M.moe_route(lg, k=1, capacity_factor=bad)
    with pytest.raises(ArgumentTypeError, match="capacity_factor"):
        M.moe_route(lg, k=1, capacity_factor="1.0")
    with pytest.raises(DTypeError, match="int64"):
        M.moe_route(lg.long(), k=1)
    with pytest.raises(ArgumentTypeError, match="logits"):
        M.moe_route(lg.tolist(), k=1)
    r = M.moe_route(lg, k=2)
    with pytest.raises(ShapeError, match=r"\[T=5, H\]"):
        M.moe_permute(torch.randn(4, 3), r)
    with pytest.raises(ShapeError, match=r"\[N=10, H\]"):
        M.moe_unpermute(torch.randn(9, 3), r)
    with pytest.raises(ArgumentTypeError, match="Routing"):
        M.moe_permute(torch.randn(5, 3), r.indices)
    with pytest.raises(DTypeError):
        M.moe_permute(torch.randn(5, 3).long(), r)
    with pytest.raises(ShapeError, match="shape"):
        M.moe_aux_loss(torch.randn(5, 3), r)


def test_empty_and_noncontiguous_inputs(provider, gen):
    r = M.moe_route(torch.randn(0, 4), k=2, provider=provider)
    assert r.num_rows == 0 and r.tokens_per_expert.tolist() == [0, 0, 0, 0]
    assert M.moe_permute(torch.randn(0, 3), r, provider=provider).shape == (0, 3)
    big = rand((9, 12), torch.float32, gen)
    logits = big[:, ::2]  # non-contiguous [9, 6]
    r = M.moe_route(logits, k=2, provider=provider)
    ref = M.moe_route_ref(logits.contiguous(), k=2)
    assert torch.equal(r.row_map, ref.row_map)
    x = rand((7, 9), torch.float32, gen).t()  # non-contiguous [9, 7]
    assert torch.equal(M.moe_permute(x, r, provider=provider), M.moe_permute_ref(x, ref))


def test_custom_ops_pass_opcheck(gen):
    """Schemas, fake implementations and autograd registrations are consistent (torch.library.opcheck)."""
    logits = rand((11, 5), torch.float32, gen).requires_grad_()
    bias = rand((5,), torch.float32, gen)
    for cap in (-1, 3):  # without and with a capacity (a data-dependent number of rows)
        args = (logits, 2, "softmax", True, None, 0, 0, 1.0, cap, "probability", [], [], -1, True, "")
        torch.library.opcheck(torch.ops.torsh.moe_route.default, args)
    # the selection options: a bias, groups, a scaling
    args = (logits, 2, "sigmoid", True, bias, 5, 3, 2.5, -1, "probability", [], [], -1, True, "")
    torch.library.opcheck(torch.ops.torsh.moe_route.default, args)
    r = M.moe_route(logits.detach(), k=2)
    x = rand((11, 6), torch.float32, gen).requires_grad_()
    torch.library.opcheck(torch.ops.torsh.moe_permute.default, (x, r.row_map, r.token_index, ""))
    y = rand((r.num_rows, 6), torch.float32, gen).requires_grad_()
    w = r.weights.detach().clone().requires_grad_()
    torch.library.opcheck(torch.ops.torsh.moe_unpermute.default, (y, r.row_map, r.token_index, w, ""))


@pytest.mark.parametrize("cf", [None, 0.6], ids=["nocap", "cap"])
def test_torch_unpermute_in_token_blocks(gen, cf):
    """On the CPU the torch unpermute works in token blocks (about 2 MiB of fp32 each): several blocks and
    a ragged last one, with and without drops, equal the reference."""
    T, E, K, H = 301, 5, 2, 4097  # blocks of 127 tokens: 3 blocks, the last one ragged
    r = M.moe_route(rand((T, E), torch.float32, gen), k=K, capacity_factor=cf, provider="torch")
    y_perm = rand((r.num_rows, H), torch.bfloat16, gen)
    y_perm[0] = float("inf")  # a dropped assignment must not read it (0 * inf = NaN)
    for weights in (True, False):
        got = M.moe_unpermute(y_perm, r, weights=weights, provider="torch")
        torch.testing.assert_close(got, M.moe_unpermute_ref(y_perm, r, weights=weights), atol=8e-3, rtol=8e-3)


def test_kernel_limits_fall_back_to_torch_or_raise(gen):
    """Past the kernels' limits (K unrolled up to 32, E up to 1024 per tile) automatic selection runs the
    torch path; an explicitly requested kernel provider raises."""
    logits = rand((3, 40), torch.float32, gen)
    r = M.moe_route(logits, k=33)  # automatic: torch
    assert torch.equal(r.row_map, M.moe_route_ref(logits, k=33).row_map)
    with pytest.raises(ShapeError, match="k=32"):
        M.moe_route(logits, k=33, provider="triton")
    with pytest.raises(ShapeError, match="k=32"):
        M.moe_permute(rand((3, 4), torch.float32, gen), r, provider="numba")
    with pytest.raises(ShapeError, match="1024 experts"):
        M.moe_route(rand((2, 1025), torch.float32, gen), k=1, provider="triton")


def test_routing_prints_sizes_not_tensors():
    T, E, K = 4096, 16, 2
    r = M.moe_route(torch.randn(T, E), k=K, capacity_factor=0.5, provider="torch")
    s = repr(r)
    assert len(s) <= 160 and "\n" not in s and "tensor(" not in s, s
    assert s == (f"Routing(tokens={T}, experts={E}, k={K}, rows={r.num_rows}, dropped={T * K - r.num_rows}, "
                 f"capacity={math.ceil(T * K * 0.5 / E)}, score='softmax', device=cpu)")  # fmt: skip
    assert 0 < r.num_rows < T * K


# --------------------------------------------------------------------------------------------------
# Hardening (issue 24): a Routing not made by moe_route is checked before any kernel reads it


def _edited(r: M.Routing, field: str, i: int, value: int) -> M.Routing:
    t = getattr(r, field).clone()
    t.view(-1)[i] = value
    return dataclasses.replace(r, **{field: t})


@pytest.mark.parametrize("field", ["row_map", "token_index"])
def test_a_routing_indexing_outside_the_rows_is_refused_on_every_provider(provider, field):
    """The probe's segfault (triton, row_map) and out-of-bounds reads (triton and numba, token_index; torch
    raised a bare IndexError): a typed error before anything runs, and nothing the caller passed changes."""
    r = M.moe_route(torch.randn(7, 5, device=DEVICE), k=2, capacity_factor=1.0)
    x, y = torch.randn(7, 3, device=DEVICE), torch.randn(r.num_rows, 3, device=DEVICE)
    for value in (10**6, -5):
        bad = _edited(r, field, 1, value)
        before = [t.clone() for t in (x, y, bad.row_map, bad.token_index)]
        with pytest.raises(ShapeError, match=f"routing.{field} holds {value}"):
            M.moe_permute(x, bad, provider=provider)
        with pytest.raises(ShapeError, match=f"routing.{field} holds {value}"):
            M.moe_unpermute(y, bad, provider=provider)
        assert all(torch.equal(a, b) for a, b in zip((x, y, bad.row_map, bad.token_index), before))


def test_the_fields_of_a_hand_made_routing_must_agree():
    r = M.moe_route(torch.randn(7, 5), k=2, capacity_factor=1.0)
    x = torch.randn(7, 3)
    rows = r.row_map.clone()
    rows[rows == rows.max()] = 0  # two assignments on row 0, the last row never written
    cases = {
        "repeats a row": dataclasses.replace(r, row_map=rows, dropped=rows < 0),
        "not the inverse": dataclasses.replace(r, token_index=r.token_index.flip(0)),
        "disagrees with routing.row_map": dataclasses.replace(r, dropped=~r.dropped),
        "tokens_per_expert disagrees": dataclasses.replace(r, tokens_per_expert=r.tokens_per_expert.flip(0) + 1),
        "must be contiguous": dataclasses.replace(r, row_map=r.row_map.t().contiguous().t()),
        "more than T": dataclasses.replace(r, num_rows=10**9),
    }
    for match, bad in cases.items():
        with pytest.raises(ShapeError, match=match):
            M.moe_permute(x, bad)
    with pytest.raises(DTypeError, match=r"routing\.weights"):
        M.moe_unpermute(torch.randn(r.num_rows, 3), dataclasses.replace(r, weights=r.weights.half()))
    with pytest.raises(ArgumentTypeError, match=r"routing\.num_rows"):
        M.moe_permute(x, dataclasses.replace(r, num_rows=str(r.num_rows)))
    # an equal copy (rebuilt, unpickled) is checked once and then used like the original
    for same in (dataclasses.replace(r), pickle.loads(pickle.dumps(r))):
        assert torch.equal(M.moe_permute(x, same), M.moe_permute_ref(x, r))


def test_a_sealed_routing_is_trusted_until_edited_in_place_or_swapped(monkeypatch):
    from torsh_kernels.ops.moe import routing as R

    checks = []
    real = R._check_values
    monkeypatch.setattr(R, "_check_values", lambda r, what: (checks.append(what), real(r, what))[1])
    r = M.moe_route(torch.randn(7, 5), k=2)
    x = torch.randn(7, 3)
    for provider in ("torch", "cpu", None):
        M.moe_permute(x, r, provider=provider)
        M.moe_unpermute(torch.randn(r.num_rows, 3), r, provider=provider)
    assert checks == [], "a routing from moe_route is not checked again"
    r.row_map[0, 0] = 10**6  # an edit in place moves the version counter: checked (and refused) again
    with pytest.raises(ShapeError, match="outside the rows"):
        M.moe_permute(x, r)
    r2 = M.moe_route(torch.randn(7, 5), k=2)
    object.__setattr__(r2, "token_index", r2.token_index.clone().fill_(99))  # a swapped field
    with pytest.raises(ShapeError, match="token_index holds 99"):
        M.moe_unpermute(torch.randn(r2.num_rows, 3), r2)
    hand = dataclasses.replace(M.moe_route(torch.randn(7, 5), k=2))
    n = len(checks)
    M.moe_permute(x, hand)
    M.moe_permute(x, hand)
    assert len(checks) == n + 1, "a hand-made routing is checked once, then sealed"


@pytest.mark.parametrize("p", ["triton", "numba"])
def test_the_permute_kernels_stay_inside_their_buffers_whatever_the_row_map(p):
    """Below the checks (a compiled graph passes the custom ops a routing's tensors as they are): a row
    outside [0, N) is neither read nor written, so a bad row map cannot crash the process."""
    r = M.moe_route(torch.randn(5, 4), k=2)
    rows = r.row_map.clone()
    rows[0, 0], rows[1, 1] = 10**6, -7
    x, y = torch.randn(5, 3), torch.randn(r.num_rows, 3)
    out = moe_ops.permute_op(x, rows, r.token_index, p)
    ok = r.row_map.clone()
    ok[0, 0] = ok[1, 1] = -1
    for t in range(5):
        for j in range(2):
            if ok[t, j] >= 0:
                assert torch.equal(out[ok[t, j]], x[t])
    got = moe_ops.unpermute_op(y, rows, r.token_index, r.weights, p)
    want = M.moe_unpermute_ref(y, dataclasses.replace(r, row_map=ok))
    torch.testing.assert_close(got, want)


def test_capacity_factor_is_clamped_to_every_assignment():
    """capacity_factor=1e300 overflowed the kernels' capacity argument; capacity never exceeds T * k, so a
    huge factor is no limit. inf, nan, <= 0 and bool stay errors (None is the way to say no limit)."""
    lg = torch.randn(7, 5)
    r = M.moe_route(lg, k=2, capacity_factor=1e300)
    assert r.capacity == 14 and r.num_rows == 14
    assert torch.equal(r.row_map, M.moe_route(lg, k=2).row_map)
    assert M.expert_capacity(7, 2, 5, 1e-300) == 1
    for bad in (math.inf, math.nan, -1.0, 0.0):
        with pytest.raises(InvalidArgumentError, match="capacity_factor"):
            M.moe_route(lg, k=2, capacity_factor=bad)
    with pytest.raises(ArgumentTypeError, match="capacity_factor"):
        M.moe_route(lg, k=2, capacity_factor=True)


def test_router_losses_of_no_tokens_are_zero_and_meta_tensors_give_meta_results():
    for provider in ("cpu", "torch"):
        lg = torch.empty(0, 5, requires_grad=True)
        r = M.moe_route(lg.detach(), k=2)
        for loss in (M.moe_aux_loss(lg, r, provider=provider), M.moe_z_loss(lg, provider=provider)):
            assert float(loss.detach()) == 0.0
            loss.backward()
    meta = torch.empty(7, 5, device="meta")
    r = M.moe_route(meta, k=2)
    assert r.row_map.is_meta and r.num_rows == 14
    assert M.moe_permute(torch.empty(7, 3, device="meta"), r).shape == (14, 3)
    assert M.moe_unpermute(torch.empty(14, 3, device="meta"), r).shape == (7, 3)
    assert M.moe_z_loss(meta, provider="cpu").is_meta and M.moe_aux_loss(meta, r).is_meta
    with pytest.raises(InvalidArgumentError, match="meta"):
        M.moe_route(meta, k=2, capacity_factor=1.0)
