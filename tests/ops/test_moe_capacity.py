"""moe_route's capacity rules: a fixed ``capacity``, a capacity per sequence (``capacity_scope="sequence"``) and
expert groups padded to their capacity (``pad_to_capacity``), on every provider and dtype against the torch
reference and a brute-force oracle of the kept assignments; the padded layout through permute, unpermute and
their gradients; Hugging Face's Switch router; typed errors; hand-made routings with the new fields."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

import torsh_kernels.ops.moe as M
from tests.helpers import DEVICE, DTYPE_TOLS, rand
from tests.ops.test_moe import _poison_allocator
from torsh_kernels.errors import ArgumentTypeError, DTypeError, InvalidArgumentError, ShapeError

LENS = [7, 0, 1, 12, 3]  # T = 23: odd, unequal, one empty sequence, one of length 1

# (T, E, K, options): every option of the capacity rule, several in each case
SEQ = dict(capacity_scope="sequence")
CASES = {
    "seq-cap2-prob": (23, 5, 2, dict(SEQ, capacity=2, sequence_lengths=LENS)),
    "seq-cf-position-pad": (
        23,
        5,
        2,
        dict(
            SEQ, capacity_factor=0.8, drop_policy="position", sequence_lengths=torch.tensor(LENS), pad_to_capacity=True
        ),
    ),
    "seq-cap1-prob-pad": (17, 3, 2, dict(SEQ, capacity=1, sequence_lengths=(5, 1, 11), pad_to_capacity=True)),
    "call-cap4-prob": (29, 5, 2, dict(capacity=4)),
    "call-cap0-pad": (13, 4, 2, dict(capacity=0, pad_to_capacity=True)),
    "call-cap-over-T-position-pad": (11, 3, 2, dict(capacity=11 * 2 + 5, drop_policy="position", pad_to_capacity=True)),
    "call-cf-prob-pad": (31, 6, 3, dict(capacity_factor=0.6, score="sigmoid", pad_to_capacity=True)),
}
HALF_CASES = ("seq-cap2-prob", "seq-cf-position-pad")  # fp16/bf16 logits: one case per scope
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
ROUTE_PARAMS = [
    pytest.param(dt, case, id=f"{name}-{case}")
    for name, dt in DTYPES.items()
    for case in CASES
    if dt is torch.float32 or case in HALF_CASES
]


def _spans(r: M.Routing, T: int) -> list[tuple[int, int, int]]:
    """(first token, end, capacity) of each span the capacity applies to."""
    if r.sequence_lengths is None:
        return [(0, T, r.capacity if r.capacity is not None else 2**62)]
    ends = list(itertools.accumulate(r.sequence_lengths))
    return [(e - n, e, c) for e, n, c in zip(ends, r.sequence_lengths, r.sequence_capacity)]


def _oracle_dropped(r: M.Routing, T: int, K: int, policy: str) -> torch.Tensor:
    """[T, K]: the assignments the rule drops, by brute force: per span and expert, the assignments in token
    order ("position") or by score descending, equal scores in (token, choice) order ("probability"), all but
    the first C."""
    idx, sc = r.indices.cpu().tolist(), r.scores.cpu().tolist()
    dropped = [[False] * K for _ in range(T)]
    for a, b, cap in _spans(r, T):
        for e in range(r.num_experts):
            mine = [(t, j) for t in range(a, b) for j in range(K) if idx[t][j] == e]
            if policy == "probability":
                mine.sort(key=lambda tj: (-sc[tj[0]][tj[1]], tj[0], tj[1]))
            for t, j in mine[cap:]:
                dropped[t][j] = True
    return torch.tensor(dropped, dtype=torch.bool, device=r.indices.device).reshape(T, K)


def _check_layout(r: M.Routing, T: int, E: int, K: int) -> None:
    """The permuted layout, from its definition: expert e's group (``rows_per_expert[e]`` rows from
    ``expert_offsets()[e]``) holds its kept tokens in token order, then (padded) -1 up to ``capacity``; the row
    map points there; no (sequence, expert) pair keeps more than its capacity."""
    rows, kept = r.row_map, r.row_map >= 0
    assert torch.equal(r.dropped, ~kept)
    assert torch.equal(r.tokens_per_expert, torch.bincount(r.indices[kept], minlength=E))
    rpe, off = r.rows_per_expert, r.expert_offsets()
    assert rpe.dtype == off.dtype == torch.int64 and off.shape == (E + 1,)
    if r.padded:
        assert r.num_rows == E * r.capacity and rpe.tolist() == [r.capacity] * E
        assert r.num_dropped == int(r.dropped.sum())
    else:
        assert torch.equal(rpe, r.tokens_per_expert) and r.num_dropped == T * K - r.num_rows
    assert r.num_rows == r.token_index.numel() == int(off[-1])
    for e in range(E):
        mine = (r.indices == e) & kept
        toks = mine.nonzero()[:, 0]  # token order (a token chooses an expert once)
        grp = r.token_index[off[e] : off[e + 1]]
        assert torch.equal(grp[: toks.numel()], toks)
        assert bool((grp[toks.numel() :] == -1).all())
        assert torch.equal(rows[mine], torch.arange(int(off[e]), int(off[e]) + toks.numel(), device=rows.device))
    for a, b, cap in _spans(r, T):
        assert int(torch.bincount(r.indices[a:b][kept[a:b]], minlength=E).max()) <= cap


@pytest.mark.parametrize(("dtype", "case"), ROUTE_PARAMS)
def test_route_capacity_rules_match_reference_and_oracle(provider, gen, dtype, case):
    T, E, K, opts = CASES[case]
    logits = rand((T, E), dtype, gen) * 2
    kw = dict(k=K, **opts)
    _poison_allocator(logits.numel() * 64)
    r = M.moe_route(logits, provider=provider, **kw)
    ref = M.moe_route_ref(logits, **kw)
    for f in ("indices", "tokens_per_expert", "row_map", "token_index", "dropped"):
        a, b = getattr(r, f), getattr(ref, f)
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), f
    torch.testing.assert_close(r.weights.detach(), ref.weights.detach(), atol=1e-6, rtol=1e-6)
    for f in ("num_rows", "capacity", "sequence_lengths", "sequence_capacity", "padded", "capacity_scope"):
        assert getattr(r, f) == getattr(ref, f), f
    assert r.padded == opts.get("pad_to_capacity", False)
    _check_layout(r, T, E, K)
    assert torch.equal(r.dropped, _oracle_dropped(r, T, K, opts.get("drop_policy", "probability")))
    if "sequence_lengths" in opts and "capacity" in opts:
        assert r.sequence_capacity == (opts["capacity"],) * len(opts["sequence_lengths"])
    if case != "call-cap-over-T-position-pad":
        assert r.num_dropped > 0, "the cases are built to overflow"
    M.check_routing(dataclasses.replace(r), "test")  # a copy passes the full check of the new fields


def test_capacity_values():
    """C_s per sequence (0 for an empty one), the routing's capacity their sum, the padded row count."""
    lg = torch.randn(23, 5)
    r = M.moe_route(lg, k=2, capacity_factor=0.8, capacity_scope="sequence", sequence_lengths=LENS)
    want = tuple(M.expert_capacity(n, 2, 5, 0.8) if n else 0 for n in LENS)
    assert want == (3, 0, 1, 4, 1) and r.sequence_capacity == want and r.capacity == 9
    r = M.moe_route(lg, k=2, capacity=2, capacity_scope="sequence", sequence_lengths=LENS, pad_to_capacity=True)
    assert r.sequence_capacity == (2,) * 5 and r.capacity == 10 and r.num_rows == 50
    assert repr(r).endswith("capacity=10, sequences=5, padded, score='softmax', device=cpu)")
    r = M.moe_route(lg, k=2, capacity=10**30)  # no limit in effect, the capacity as given
    assert r.capacity == 10**30 and r.num_rows == 46 and r.num_dropped == 0


def test_fixed_capacity_agrees_with_the_factor_and_with_no_limit(provider, gen):
    """capacity=C routes as the factor that gives C; a capacity of every assignment or more routes as no limit."""
    T, E, K = 21, 4, 2
    lg = rand((T, E), torch.float32, gen)
    C = M.expert_capacity(T, K, E, 0.5)
    for policy in ("probability", "position"):
        a = M.moe_route(lg, k=K, capacity=C, drop_policy=policy, provider=provider)
        b = M.moe_route(lg, k=K, capacity_factor=0.5, drop_policy=policy, provider=provider)
        assert a.capacity == b.capacity == C and torch.equal(a.row_map, b.row_map)
        assert torch.equal(a.token_index, b.token_index) and a.num_dropped > 0
    free = M.moe_route(lg, k=K, provider=provider)
    for cap in (T * K, T * K + 1, 10**20):
        r = M.moe_route(lg, k=K, capacity=cap, drop_policy="position", provider=provider)
        assert torch.equal(r.row_map, free.row_map) and torch.equal(r.token_index, free.token_index)


def test_sequence_scope_routes_each_sequence_as_a_call(gen):
    """Per sequence, the sequence scope keeps what a call-scope route of that sequence alone keeps (the rows
    then differ: the sequence scope groups every sequence's rows by expert)."""
    T, E, K = 23, 5, 2
    lg = rand((T, E), torch.float32, gen)
    for policy, opts in itertools.product(("probability", "position"), (dict(capacity=2), dict(capacity_factor=0.9))):
        r = M.moe_route(lg, k=K, capacity_scope="sequence", sequence_lengths=LENS, drop_policy=policy,
                        provider="cpu", **opts)  # fmt: skip
        for (a, b, _), n in zip(_spans(r, T), LENS):
            if n:
                alone = M.moe_route_ref(lg[a:b], k=K, drop_policy=policy, **opts)
                assert torch.equal(r.dropped[a:b], alone.dropped)
        assert r.num_dropped > 0


def test_switch_router_capacity_per_sequence_matches_hugging_face(provider, gen):
    """Hugging Face's SwitchTransformersTop1Router (eval mode: no jitter) keeps, per batch row, each expert's
    first expert_capacity tokens: capacity=C, capacity_scope="sequence", drop_policy="position", k=1."""
    tf = pytest.importorskip("transformers.models.switch_transformers.modeling_switch_transformers")
    B, L, H, E, C = 3, 9, 16, 4, 2
    cfg = tf.SwitchTransformersConfig(d_model=H, num_experts=E, expert_capacity=C, router_jitter_noise=0.5)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1234)  # (the router's weights: nn.Linear's initialisation)
        router = tf.SwitchTransformersTop1Router(cfg).eval()
    hidden = rand((B, L, H), torch.float32, gen, device="cpu")
    with torch.no_grad():
        dispatch, probs, logits = router(hidden)  # [B, L, E] one-hot, kept only; [B, L, 1]; [B, L, E]
    lg = logits.reshape(B * L, E).to(DEVICE)
    r = M.moe_route(lg, k=1, renormalize=False, capacity=C, capacity_scope="sequence", sequence_lengths=[L] * B,
                    drop_policy="position", provider=provider)  # fmt: skip
    ours = torch.zeros(B * L, E, dtype=dispatch.dtype, device=DEVICE)
    ours[torch.arange(B * L, device=DEVICE), r.indices[:, 0]] = (~r.dropped[:, 0]).to(dispatch.dtype)
    assert torch.equal(ours.cpu(), dispatch.reshape(B * L, E))
    assert torch.equal(r.indices[:, 0].cpu(), logits.reshape(B * L, E).argmax(-1))
    torch.testing.assert_close(r.weights[:, 0].cpu(), probs.reshape(B * L), atol=1e-6, rtol=1e-6)
    assert 0 < r.num_dropped < B * L, "the config overflows the capacity"
    assert r.sequence_capacity == (C,) * B


# (T, E, K, options): padded layouts for the row ops (the router prefers expert 0: it overflows, others do not)
PAD_CASES = {
    "call-prob": (23, 5, 2, dict(capacity=8)),
    "seq-position": (23, 5, 2, dict(SEQ, capacity=2, sequence_lengths=LENS, drop_policy="position")),
    "call-cap0": (9, 3, 1, dict(capacity=0)),
}


@pytest.mark.parametrize(("dtype", "atol", "rtol"), DTYPE_TOLS)
@pytest.mark.parametrize("case", list(PAD_CASES))
def test_padded_permute_unpermute_match_reference(provider, gen, dtype, atol, rtol, case):
    """The permute writes the padding rows as exact zeros (outputs poisoned first); the unpermute never reads
    them (they hold inf and NaN here)."""
    T, E, K, opts = PAD_CASES[case]
    H = 19
    lg = rand((T, E), torch.float32, gen)
    lg[:, 0] += 2.0
    r = M.moe_route(lg, k=K, pad_to_capacity=True, provider="torch", **opts)
    pad = r.token_index < 0
    assert r.padded and r.num_rows == E * r.capacity and r.num_dropped > 0
    assert bool(pad.any()) or r.capacity == 0
    x = rand((T, H), dtype, gen)
    _poison_allocator(r.num_rows * H * x.element_size())
    xp = M.moe_permute(x, r, provider=provider)
    assert xp.shape == (r.num_rows, H) and xp.dtype == dtype
    assert torch.equal(xp, M.moe_permute_ref(x, r)), "permute is an exact copy"
    assert torch.equal(xp[pad], torch.zeros(int(pad.sum()), H, dtype=dtype, device=DEVICE)), "padding rows are zeros"
    y_perm = rand((r.num_rows, H), dtype, gen)
    y_perm[pad] = float("inf")
    y_perm[pad.nonzero()[:1, 0]] = float("nan")
    for weights in (True, False):
        _poison_allocator(T * H * x.element_size())
        y = M.moe_unpermute(y_perm, r, weights=weights, provider=provider)
        want = M.moe_unpermute_ref(y_perm, r, weights=weights)
        assert bool(torch.isfinite(y).all())
        torch.testing.assert_close(y, want, atol=atol, rtol=rtol)


@pytest.mark.parametrize("scope", ["call", "sequence"])
def test_padded_gradients_match_reference(provider, gen, scope):
    """Gradients through a padded layout: of x (the padding rows' gradient reaches no token), of the logits,
    and of y_perm (exactly zero at the padding rows, which no assignment reads)."""
    T, E, K, H = 19, 4, 2, 11
    opts = dict(capacity=8, drop_policy="position", pad_to_capacity=True)
    if scope == "sequence":
        opts.update(capacity=2, capacity_scope="sequence", sequence_lengths=[6, 0, 1, 12], drop_policy="probability")
    logits0, x0 = rand((T, E), torch.float32, gen), rand((T, H), torch.float32, gen)
    logits0[:, 0] += 2.0  # expert 0 overflows, the others leave padding
    w = rand((H, H), torch.float32, gen) * 0.3
    c = rand((T, H), torch.float32, gen)
    n = E * (opts["capacity"] * (4 if scope == "sequence" else 1))
    g_perm, yp0 = rand((n, H), torch.float32, gen), rand((n, H), torch.float32, gen)

    def run(route, permute, unpermute):
        lg, x, yp = logits0.clone().requires_grad_(), x0.clone().requires_grad_(), yp0.clone().requires_grad_()
        r = route(lg)
        assert r.num_rows == n
        xp = permute(x, r)
        y = unpermute(torch.tanh(xp @ w) + xp, r)
        loss = (y * c).sum() + (xp * g_perm).sum() + (unpermute(yp, r) * c).square().sum()
        _poison_allocator(n * H * 8)
        loss.backward()
        return y.detach(), lg.grad, x.grad, yp.grad, r

    ref = run(lambda lg: M.moe_route_ref(lg, k=K, **opts), M.moe_permute_ref, M.moe_unpermute_ref)
    got = run(
        lambda lg: M.moe_route(lg, k=K, provider=provider, **opts),
        lambda x, r: M.moe_permute(x, r, provider=provider),
        lambda y, r: M.moe_unpermute(y, r, provider=provider),
    )
    for name, a, b in zip(("y", "d logits", "d x", "d y_perm"), got, ref):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5, msg=name)
    pad = got[4].token_index < 0
    assert bool(pad.any()) and got[4].num_dropped > 0
    assert torch.equal(got[3][pad], torch.zeros(int(pad.sum()), H, device=DEVICE))
    assert float(ref[1].abs().sum()) > 0 and float(ref[2].abs().sum()) > 0


def test_padding_gives_a_static_row_count_on_meta_and_under_opcheck(gen):
    """N = E * capacity without the values: meta logits route (no refusal), and the custom ops' fake
    implementations agree with their kernels (opcheck) for a padded and a per-sequence routing."""
    meta = torch.empty(7, 5, device="meta")
    r = M.moe_route(meta, k=2, capacity=3, pad_to_capacity=True)
    assert r.row_map.is_meta and r.num_rows == 15 and r.padded
    assert M.moe_permute(torch.empty(7, 3, device="meta"), r).shape == (15, 3)
    r = M.moe_route(meta, k=2, capacity=1, capacity_scope="sequence", sequence_lengths=[3, 4], pad_to_capacity=True)
    assert r.num_rows == 10
    with pytest.raises(InvalidArgumentError, match="meta"):
        M.moe_route(meta, k=2, capacity=3)
    logits = rand((11, 5), torch.float32, gen).requires_grad_()
    for args in ((3, [], [], 3), (-1, [4, 0, 7], [2, 0, 2], -1), (-1, [4, 0, 7], [2, 0, 2], 4)):
        cap, lens, caps, pad = args
        full = (logits, 2, "softmax", True, None, 0, 0, 1.0, cap, "probability", lens, caps, pad, True, "")
        torch.library.opcheck(torch.ops.torsh.moe_route.default, full)
    r = M.moe_route(logits.detach(), k=2, capacity=2, pad_to_capacity=True)
    x = rand((11, 6), torch.float32, gen).requires_grad_()
    torch.library.opcheck(torch.ops.torsh.moe_permute.default, (x, r.row_map, r.token_index, "", True))
    y = rand((r.num_rows, 6), torch.float32, gen).requires_grad_()
    wt = r.weights.detach().clone().requires_grad_()
    torch.library.opcheck(torch.ops.torsh.moe_unpermute.default, (y, r.row_map, r.token_index, wt, "", True))


# ------------------------------------------------------------------------------------------ errors


def test_typed_errors_of_the_capacity_options():
    lg = torch.randn(6, 4)
    seq = dict(SEQ, capacity=1)
    meta_lengths = torch.empty(2, dtype=torch.int64, device="meta")
    cases = [
        (InvalidArgumentError, "capacity=-1", dict(capacity=-1)),
        (ArgumentTypeError, "capacity must be an int", dict(capacity=2.0)),
        (ArgumentTypeError, "capacity must be an int", dict(capacity=True)),
        (ArgumentTypeError, "capacity must be an int", dict(capacity="3")),
        (InvalidArgumentError, "both given", dict(capacity=2, capacity_factor=1.0)),
        (InvalidArgumentError, "capacity_scope=", dict(capacity=2, capacity_scope="batch")),
        (InvalidArgumentError, "capacity_scope=", dict(capacity=2, capacity_scope=None)),
        (InvalidArgumentError, "needs sequence_lengths", dict(**seq)),
        (InvalidArgumentError, "without a capacity", dict(capacity_scope="sequence", sequence_lengths=[6])),
        (InvalidArgumentError, "would ignore them", dict(capacity=1, sequence_lengths=[6])),
        (ShapeError, "sum to 5", dict(**seq, sequence_lengths=[2, 3])),
        (ShapeError, "sum to 7", dict(**seq, sequence_lengths=torch.tensor([2, 5]))),
        (InvalidArgumentError, r"sequence_lengths\[1\]=-1", dict(**seq, sequence_lengths=[7, -1])),
        (ArgumentTypeError, r"sequence_lengths\[0\] must be an int", dict(**seq, sequence_lengths=[3.0, 3])),
        (ArgumentTypeError, r"sequence_lengths\[1\] must be an int", dict(**seq, sequence_lengths=[3, True, 2])),
        (ArgumentTypeError, "list or tuple", dict(**seq, sequence_lengths=6)),
        (ArgumentTypeError, "list or tuple", dict(**seq, sequence_lengths="6")),
        (DTypeError, "integer dtype", dict(**seq, sequence_lengths=torch.tensor([3.0, 3.0]))),
        (ShapeError, "1-D", dict(**seq, sequence_lengths=torch.tensor([[3, 3]]))),
        (InvalidArgumentError, "meta tensor", dict(**seq, sequence_lengths=meta_lengths)),
        (InvalidArgumentError, "needs a capacity", dict(pad_to_capacity=True)),
        (ArgumentTypeError, "pad_to_capacity must be a bool", dict(capacity=2, pad_to_capacity=1)),
        (InvalidArgumentError, "cannot fit", dict(capacity=2**60, pad_to_capacity=True)),
        (InvalidArgumentError, "capacity_factor", dict(SEQ, capacity_factor=0.0, sequence_lengths=[6])),
    ]
    for err, match, kw in cases:
        for route in (M.moe_route, M.moe_route_ref):
            with pytest.raises(err, match=match):
                route(lg, k=2, **kw)
    ok = M.moe_route(lg, k=2, capacity=1, capacity_scope="sequence", sequence_lengths=torch.tensor([2, 4]))
    assert ok.sequence_lengths == (2, 4)  # an integer tensor is fine (read on the host)


def test_hand_made_routings_with_the_new_fields_are_checked():
    lg = torch.randn(9, 4)
    r = M.moe_route(lg, k=2, capacity=2, capacity_scope="sequence", sequence_lengths=[4, 0, 5], pad_to_capacity=True)
    x = torch.randn(9, 3)
    pad_row = int((r.token_index < 0).nonzero()[0, 0])
    ti = r.token_index.clone()
    ti[pad_row] = 0
    over = r.row_map.clone()
    cases = {
        "names a token at a row no assignment": dataclasses.replace(r, token_index=ti),
        "E\\*capacity": dataclasses.replace(r, num_rows=r.num_rows - 1, token_index=r.token_index[:-1].clone()),
        "sequence_lengths sum to 8": dataclasses.replace(r, sequence_lengths=(4, 0, 4)),
        "sequence_capacity": dataclasses.replace(r, sequence_capacity=(2, 2)),
        "above routing.sequence_capacity": dataclasses.replace(r, sequence_capacity=(0, 6, 0)),
        "not the sum": dataclasses.replace(r, sequence_capacity=(2, 0, 1)),
        "padded must be a bool": dataclasses.replace(r, padded=1),
        "more than T\\*K": dataclasses.replace(r, padded=False, sequence_lengths=None, sequence_capacity=None),
        "padded is True": dataclasses.replace(r, capacity=None, sequence_lengths=None, sequence_capacity=None),
    }
    errors = (ShapeError, InvalidArgumentError, ArgumentTypeError)
    for match, bad in cases.items():
        with pytest.raises(errors, match=match):
            M.moe_permute(x, bad)
    with pytest.raises(ShapeError, match="does not group"):  # a kept row moved into another expert's padding
        e0 = int(r.indices.view(-1)[r.row_map.view(-1) >= 0][0])
        i = int((r.row_map.view(-1) >= 0).nonzero()[0, 0])
        free = next(int(p) for p in (r.token_index < 0).nonzero()[:, 0] if int(p) // r.capacity != e0)
        over.view(-1)[i] = free
        ti2 = r.token_index.clone()
        ti2[free], ti2[int(r.row_map.view(-1)[i])] = i // 2, -1
        M.moe_permute(x, dataclasses.replace(r, row_map=over, token_index=ti2))
    # the seal covers `padded`: flipped on the sealed routing itself, the full check runs (and refuses it)
    object.__setattr__(r, "padded", False)
    with pytest.raises(ShapeError, match="more than T\\*K"):
        M.moe_unpermute(torch.randn(r.num_rows, 3), r)
