"""MoE layers: MoELayer against an unfused Mixtral-style reference (with shared experts and their gate), the
grouped-GEMM expert compute against the per-expert loop (empty experts, gradients), the layer's argument and
sequence checks; ExpertParallelMoE on real gloo processes (2 and 4 ranks) against the single-process layer:
outputs, input gradients, expert, router and shared-expert gradients, uneven and empty splits, capacity
drops."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import assert_named_on_every_rank, count_calls
from torsh_kernels.collectives import run_local
from torsh_kernels.errors import ArgumentTypeError, DTypeError, InvalidArgumentError, ShapeError
from torsh_kernels.ops import moe_aux_loss
from torsh_kernels.parallel import ExpertParallelMoE, MoELayer, moe_experts
from torsh_kernels.parallel.moe import LOAD_BALANCING

H, FFN = 12, 10


def _act(h: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "swiglu":
        gate, up = h.chunk(2, dim=-1)
        return F.silu(gate) * up
    return F.gelu(h) if activation == "gelu" else F.relu(h)


def _mixtral_reference(layer: MoELayer, x: torch.Tensor) -> torch.Tensor:
    """The Hugging Face Mixtral block's loop (softmax in fp32, top-k, renormalise, index_add_), plus the shared
    expert written out (its MLP, times the sigmoid of its gate) where the layer has one."""
    logits = x @ layer.router.weight.t()
    p = torch.softmax(logits.float(), dim=-1)
    w, sel = torch.topk(p, layer.k, dim=-1)
    w = w / w.sum(-1, keepdim=True)
    out = torch.zeros_like(x)
    for e in range(layer.num_experts):
        tok, slot = torch.where(sel == e)
        y = _act(x[tok] @ layer.w_in[e], layer.activation) @ layer.w_out[e]
        out.index_add_(0, tok, y * w[tok, slot, None])
    if layer.shared_experts:
        s = _act(x @ layer.shared_w_in, layer.activation) @ layer.shared_w_out
        if layer.shared_expert_gate is not None:
            s = s * torch.sigmoid(x @ layer.shared_expert_gate.weight.t())
        out = out + s
    return out


@pytest.mark.parametrize("provider", ["torch", "triton", "numba"])
def test_moe_layer_matches_mixtral_loop(provider):
    torch.manual_seed(3)
    layer = MoELayer(H, FFN, 5, 2, provider=provider, aux_loss_coef=0.01, z_loss_coef=0.001)
    x = torch.randn(2, 9, H, requires_grad=True)
    y = layer(x)
    assert y.shape == x.shape
    x_ref = x.detach().clone().requires_grad_()
    ref = _mixtral_reference(layer, x_ref.view(-1, H)).view_as(x)
    torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-5)
    g = torch.randn_like(y)
    (y * g).sum().backward()
    wgrads = [p.grad.clone() for p in (layer.router.weight, layer.w_in, layer.w_out)]
    layer.zero_grad()
    (ref * g).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, atol=1e-5, rtol=1e-5)
    for a, p in zip(wgrads, (layer.router.weight, layer.w_in, layer.w_out)):
        torch.testing.assert_close(a, p.grad, atol=1e-5, rtol=1e-5)
    assert layer.aux_loss.requires_grad and layer.aux_loss.item() > 0
    assert layer.last_routing.num_rows == 36  # 18 tokens x k=2


@pytest.mark.parametrize(
    ("activation", "shared", "gate", "width"),
    [("swiglu", 2, True, None), ("gelu", 1, False, 20), ("relu", 3, True, None)],
)
def test_moe_layer_shared_experts_match_the_written_out_mlp(activation, shared, gate, width):
    torch.manual_seed(11)
    layer = MoELayer(H, FFN, 5, 2, activation=activation, shared_experts=shared, shared_gate=gate,
                     shared_ffn_hidden=width)  # fmt: skip
    S = width or FFN * shared  # DeepSeek: n shared experts are one MLP n times as wide
    assert layer.shared_ffn_hidden == S and layer.shared_w_out.shape == (S, H)
    assert layer.shared_w_in.shape == (H, S * (2 if activation == "swiglu" else 1))
    assert (layer.shared_expert_gate is not None) == gate
    x = torch.randn(3, 7, H, requires_grad=True)
    y = layer(x)
    x_ref = x.detach().clone().requires_grad_()
    ref = _mixtral_reference(layer, x_ref.view(-1, H)).view_as(x)
    torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-5)
    g = torch.randn_like(y)
    (y * g).sum().backward()
    params = [p for p in layer.parameters()]
    grads = [p.grad.clone() for p in params]
    layer.zero_grad()
    (ref * g).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, atol=1e-5, rtol=1e-5)
    for a, p in zip(grads, params):
        torch.testing.assert_close(a, p.grad, atol=1e-5, rtol=1e-5)
    assert all(a.abs().sum() > 0 for a in grads)  # every parameter, the shared ones included, got a gradient


def test_moe_layer_padding_and_sequences_change_only_what_they_should():
    """Padding to capacity: the same output and gradients as without, N = E * capacity rows. Per-sequence
    capacity: a [B, S, H] input is B sequences, as sequence_lengths=[S] * B says, and drops differ from the call
    scope's."""
    torch.manual_seed(8)
    plain = MoELayer(16, 8, 4, 2, capacity_factor=1.0)
    padded = MoELayer(16, 8, 4, 2, capacity_factor=1.0, pad_to_capacity=True)
    padded.load_state_dict(plain.state_dict())
    x0, g = torch.randn(30, 16), torch.randn(30, 16)
    out = {}
    for name, layer in (("plain", plain), ("padded", padded)):
        x = x0.clone().requires_grad_()
        y = layer(x)
        ((y * g).sum() + layer.aux_loss).backward()
        out[name] = [y.detach(), x.grad] + [p.grad for p in layer.parameters()]
    r = padded.last_routing
    assert r.padded and r.num_rows == 4 * r.capacity > plain.last_routing.num_rows and r.num_dropped > 0
    for a, b in zip(out["plain"], out["padded"]):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    seq = MoELayer(16, 8, 4, 2, capacity_factor=1.0, capacity_scope="sequence")
    seq.load_state_dict(plain.state_dict())
    with torch.no_grad():
        y3 = seq(x0.view(3, 10, 16))
        r3 = seq.last_routing
        y2 = seq(x0, sequence_lengths=[10, 10, 10])
        assert r3.sequence_lengths == (10, 10, 10) and torch.equal(y3.view(30, 16), y2)
        seq(x0)  # a [T, H] input is one sequence: the call's capacity
        assert seq.last_routing.sequence_lengths == (30,)
        assert not torch.equal(r3.dropped, plain.last_routing.dropped)


def test_moe_layer_load_balancing_kinds():
    """The load-balancing kinds. "aux_loss": moe_aux_loss over the call; "seq_aux_loss": its mean over the
    sequences (a [B, S, H] input, or sequence_lengths, empty ones left out); "none": no load-balancing loss
    whatever the coefficient."""
    torch.manual_seed(12)
    layers = {kind: MoELayer(16, 8, 4, 2, load_balancing=kind, aux_loss_coef=0.1) for kind in LOAD_BALANCING}
    for layer in layers.values():
        layer.load_state_dict(layers["aux_loss"].state_dict())
    x = torch.randn(3, 5, 16)
    aux = {}
    for kind, layer in layers.items():
        layer(x)
        aux[kind] = layer.aux_loss
    logits = layers["aux_loss"].router(x.view(15, 16))
    r = layers["aux_loss"].last_routing
    torch.testing.assert_close(aux["aux_loss"], 0.1 * moe_aux_loss(logits, r))
    torch.testing.assert_close(aux["seq_aux_loss"], 0.1 * moe_aux_loss(logits, r, groups=[5, 5, 5]))
    assert aux["none"] == 0 and not torch.equal(aux["aux_loss"], aux["seq_aux_loss"])
    seq = layers["seq_aux_loss"]
    seq(x.view(15, 16), sequence_lengths=[0, 9, 0, 6])
    torch.testing.assert_close(seq.aux_loss, 0.1 * moe_aux_loss(logits, r, groups=[9, 6]))
    seq(x.view(15, 16))  # one sequence: the call's loss
    torch.testing.assert_close(seq.aux_loss, aux["aux_loss"])
    seq.aux_loss.backward()
    assert seq.router.weight.grad.abs().sum() > 0


@pytest.mark.parametrize(
    "options",
    [dict(expert_bias=True), dict(n_group=4, topk_group=2), dict(expert_bias=True, n_group=4, topk_group=2)],
    ids=["bias", "groups", "both"],
)
def test_moe_layer_load_balancing_with_bias_or_groups_is_megatron_core(options):
    """With an expert bias and/or groups the layer's aux_loss and seq_aux_loss are Megatron-Core's (their
    formulas written out in tests/ops/test_moe_losses.py: the plain top-K of the unbiased scores counted), and
    aux_loss_count="routed" counts the experts the layer routed by instead."""
    from tests.ops.test_moe_losses import _megatron_aux_loss, _megatron_seq_aux_loss

    torch.manual_seed(14)
    B, L, E, K, coef = 4, 16, 16, 4, 0.01
    x = torch.randn(B, L, H)
    for kind in ("aux_loss", "seq_aux_loss"):
        layer = MoELayer(H, FFN, E, K, score="sigmoid", load_balancing=kind, aux_loss_coef=coef, **options)
        if layer.balancer is not None:
            layer.balancer.bias.copy_(torch.randn(E) * 0.3)
        layer(x)
        logits = layer.router(x.view(B * L, H)).detach()
        if kind == "aux_loss":
            want = _megatron_aux_loss(logits, K, "sigmoid")
        else:
            want = _megatron_seq_aux_loss(logits.view(B, L, E).transpose(0, 1).reshape(L * B, E), K, "sigmoid", L, B)
        torch.testing.assert_close(layer.aux_loss.detach(), coef * want, rtol=1e-5, atol=1e-8)
        routed = MoELayer(H, FFN, E, K, score="sigmoid", load_balancing=kind, aux_loss_coef=coef,
                          aux_loss_count="routed", **options)  # fmt: skip
        routed.load_state_dict(layer.state_dict())
        routed(x)
        groups = None if kind == "aux_loss" else L
        r = layer.last_routing
        torch.testing.assert_close(routed.aux_loss, coef * moe_aux_loss(logits, r, groups=groups, count="routed"))
        assert abs(routed.aux_loss.item() - layer.aux_loss.item()) > 1e-4 * layer.aux_loss.item()
    with pytest.raises(InvalidArgumentError, match="aux_loss_count"):
        MoELayer(H, FFN, E, K, aux_loss_count="biased")


@pytest.fixture
def grouped_calls(monkeypatch):
    """Counts the grouped GEMMs the expert compute launches."""
    calls = []
    real = moe_experts._GROUPED_MM

    def counted(*a, **kw):
        calls.append(a[0].shape)
        return real(*a, **kw)

    monkeypatch.setattr(moe_experts, "_GROUPED_MM", counted)
    return calls


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_grouped_gemm_equals_the_loop_with_empty_experts(activation, grouped_calls):
    torch.manual_seed(2)
    layer = MoELayer(16, 8, 6, 2, activation=activation, shared_experts=1, z_loss_coef=1e-3)
    with torch.no_grad():  # experts 1, 3, 4 and 5 get no tokens: x[:, 0] = 5 and their router rows -20 there
        layer.router.weight[[1, 3, 4, 5], 0] = -20.0
    x0 = torch.randn(2, 9, 16)
    x0[..., 0] = 5.0
    g = torch.randn(2, 9, 16)
    results = {}
    for mode in ("grouped", "loop"):
        layer.expert_compute = mode
        layer.zero_grad()
        x = x0.clone().requires_grad_()
        y = layer(x)
        ((y * g).sum() + layer.aux_loss).backward()
        results[mode] = [y.detach(), x.grad] + [p.grad.clone() for p in layer.parameters()]
        if mode == "grouped":
            counts = layer.last_routing.tokens_per_expert
            assert counts[[1, 3, 4, 5]].sum() == 0 and counts.sum() == 36
            assert [tuple(c) for c in grouped_calls] == [(36, 16), (36, 8)]  # one per projection (backward: torch's)
    assert len(grouped_calls) == 2  # the loop launched none
    for a, b in zip(results["grouped"], results["loop"]):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    assert results["grouped"][3 + 0].abs().sum() > 0  # (w_in's gradient: non-zero for the experts used)


def test_grouped_gemm_backward_takes_any_gradient_layout(grouped_calls):
    """The grouped GEMM's backward needs a contiguous gradient: an expanded one (y.sum()) is made so first."""
    torch.manual_seed(4)
    counts = torch.tensor([3, 0, 4])
    x = torch.randn(7, 16, requires_grad=True)
    w_in, w_out = torch.randn(3, 16, 8, requires_grad=True), torch.randn(3, 8, 16, requires_grad=True)
    grads = {}
    for mode in ("grouped", "loop"):
        y = moe_experts.run_experts(x, counts, w_in, w_out, "gelu", mode, "test")
        grads[mode] = torch.autograd.grad(y.sum(), (x, w_in, w_out))
    assert len(grouped_calls) == 2
    for a, b in zip(grads["grouped"], grads["loop"]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert grads["grouped"][1][1].abs().sum() == 0  # expert 1 had no rows: a zero gradient


def test_grouped_gemm_where_it_cannot_run(grouped_calls):
    assert moe_experts.grouped_supported("cpu", torch.float32) == (True, "")
    ok, why = moe_experts.grouped_supported("cpu", torch.float64)  # torch's grouped GEMM has no fp64
    assert not ok and why
    grouped_calls.clear()  # (the probes' own calls)
    x, counts = torch.randn(5, 16, dtype=torch.float64), torch.tensor([2, 3])
    w_in, w_out = torch.randn(2, 16, 8, dtype=torch.float64), torch.randn(2, 8, 16, dtype=torch.float64)
    y = moe_experts.run_experts(x, counts, w_in, w_out, "relu", "auto", "test")  # auto: the loop
    torch.testing.assert_close(y[:2], F.relu(x[:2] @ w_in[0]) @ w_out[0], atol=1e-12, rtol=1e-12)
    assert not grouped_calls
    with pytest.raises(InvalidArgumentError, match=r"expert_compute='grouped'.*got Double"):
        moe_experts.run_experts(x, counts, w_in, w_out, "relu", "grouped", "test")
    odd = MoELayer(10, 8, 4, 2)  # H=10 fp32: rows of 40 bytes, not a multiple of 16
    y = odd(torch.randn(5, 10))
    assert y.shape == (5, 10) and not grouped_calls
    odd.expert_compute = "grouped"
    with pytest.raises(InvalidArgumentError, match="not a multiple of 16 bytes"):
        odd(torch.randn(5, 10))


def test_moe_layer_arguments():
    with pytest.raises(InvalidArgumentError, match="k=4"):
        MoELayer(H, FFN, 3, 4)
    with pytest.raises(InvalidArgumentError, match="activation"):
        MoELayer(H, FFN, 3, 1, activation="tanh")
    with pytest.raises(InvalidArgumentError, match="capacity_factor"):
        MoELayer(H, FFN, 3, 1, capacity_factor=0)
    for kw, err, text in [
        (dict(shared_experts=-1), InvalidArgumentError, "shared_experts=-1"),
        (dict(shared_experts=1.0), ArgumentTypeError, "shared_experts must be an int"),
        (dict(shared_gate=True), InvalidArgumentError, "shared_gate=True without shared experts"),
        (dict(shared_ffn_hidden=8), InvalidArgumentError, "shared_ffn_hidden without shared experts"),
        (dict(shared_experts=1, shared_ffn_hidden=0), InvalidArgumentError, "shared_ffn_hidden=0"),
        (dict(expert_bias=1), ArgumentTypeError, "expert_bias must be True or False"),
        (dict(bias_update_rate=-1e-3), InvalidArgumentError, "bias_update_rate=-0.001"),
        (dict(load_balancing="sinkhorn"), InvalidArgumentError, "load_balancing='sinkhorn'"),
        (dict(expert_compute="fast"), InvalidArgumentError, "expert_compute='fast'"),
        (dict(capacity_scope="batch"), InvalidArgumentError, "capacity_scope='batch'"),
        (dict(scaling="2"), ArgumentTypeError, "scaling must be a number"),
        (dict(scaling=-1.0), InvalidArgumentError, r"MoELayer: scaling=-1\.0"),  # moe_route checks, named MoELayer
        (dict(n_group=2, topk_group=1), InvalidArgumentError, "MoELayer: n_group=2 does not split the E=3 experts"),
        # an int too large for a float: refused as moe_route refuses it (the layer once raised OverflowError)
        (dict(scaling=10**400), InvalidArgumentError, r"MoELayer: scaling=1000.* must be a finite number in \(0, "),
        # the balancer's communicator without a balancer is refused, not ignored
        (dict(bias_comm=object()), InvalidArgumentError, "bias_comm without an expert bias"),
    ]:
        with pytest.raises(err, match=text):
            MoELayer(H, FFN, 3, 1, **kw)
    layer = MoELayer(H, FFN, 3, 1, activation="gelu")
    with pytest.raises(ShapeError, match="hidden=12"):
        layer(torch.randn(4, H + 1))
    with pytest.raises(InvalidArgumentError, match="has no expert bias"):
        layer.update_expert_bias()
    x = torch.randn(2, 3, H)
    for lengths, err, text in [
        ([2, 3], ShapeError, "sum to 5, but the logits hold T=6 tokens"),
        ([7, -1], InvalidArgumentError, r"sequence_lengths\[1\]=-1"),
        ([3.0, 3], ArgumentTypeError, r"sequence_lengths\[0\] must be an int"),
        (torch.tensor([3.0, 3.0]), DTypeError, "expected an integer dtype"),
        (torch.tensor([[3, 3]]), ShapeError, "must be 1-D"),
        ("3,3", ArgumentTypeError, "list or tuple"),
        (torch.tensor([3, 3], device="meta"), InvalidArgumentError, "meta tensor, which holds no lengths"),
    ]:
        with pytest.raises(err, match=text):
            layer(x, sequence_lengths=lengths)
    y = layer(x, sequence_lengths=torch.tensor([1, 5]))  # lengths given and read: the same output as without
    torch.testing.assert_close(y, layer(x))


def _inputs(rank: int, shape: tuple[int, ...], skew: bool) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(77 + rank)
    x = torch.randn(*shape, H, generator=g)
    if skew:
        x[..., 0] = 10.0  # with router row 0 = 50 * e_0, every token's first choice is expert 0
    return x, torch.randn(*shape, H, generator=g)


def _ep_compare(comm, E, K, options, shapes, skew=False, seed=5):
    """Each rank: its own tokens (uneven counts; ``shapes[r]`` the input's leading dimensions on rank r) through
    ExpertParallelMoE; the reference runs the single-process layer with the same ``options`` on every rank's
    tokens, one rank's batch at a time (capacity is per batch). Returns the largest differences of the output and
    every gradient (after reduce_gradients, which sums the replicated ones), the gradients' scale, the dispatch
    record, the all-to-alls of the forward, and the expert bias after one update (where the layer has one)."""
    from torsh_kernels.collectives.communicator import TorchCommunicator

    torch.manual_seed(seed)
    ref = MoELayer(H, FFN, E, K, aux_loss_coef=0.01, z_loss_coef=0.001, **options)
    with torch.no_grad():
        if skew:  # every token prefers expert 0: one rank overloaded, other splits small or empty
            ref.router.weight[0].zero_()
            ref.router.weight[0, 0] = 50.0
        if ref.balancer is not None:  # a bias that changes the selection
            ref.balancer.bias.copy_(torch.randn(E, generator=torch.Generator().manual_seed(seed)) * 0.2)
    ep = ExpertParallelMoE.from_layer(ref, comm)
    W, rank = comm.world_size, comm.rank
    ref_y, ref_gx = [], []
    for r in range(W):  # reference: sum over ranks of (y_r * g_r).sum() + aux_r
        x, g = _inputs(r, shapes[r], skew)
        x.requires_grad_()
        y = ref(x)
        ((y * g).sum() + ref.aux_loss).backward()
        ref_y.append(y.detach())
        ref_gx.append(x.grad)
    x, g = _inputs(rank, shapes[rank], skew)
    x.requires_grad_()
    with count_calls(TorchCommunicator, "all_to_all") as calls:
        y = ep(x)
    a2a = calls["all_to_all"]
    ((y * g).sum() + ep.aux_loss).backward()
    ep.reduce_gradients()
    lo, hi = ep.first_expert, ep.first_expert + ep.local_experts
    diffs = {"y": (y.detach() - ref_y[rank]).abs().max().item() if y.numel() else 0.0,
             "grad x": (x.grad - ref_gx[rank]).abs().max().item() if y.numel() else 0.0,
             "grad w_in": (ep.w_in.grad - ref.w_in.grad[lo:hi]).abs().max().item(),
             "grad w_out": (ep.w_out.grad - ref.w_out.grad[lo:hi]).abs().max().item()}  # fmt: skip
    names = ("router", "shared w_in", "shared w_out", "shared gate")
    for name, p, q in zip(names, ep._replicated(), ref._replicated()):
        diffs[f"grad {name}"] = (p.grad - q.grad).abs().max().item()
    scale = max(p.grad.abs().max().item() for p in ref.parameters())
    bias = None
    if ep.balancer is not None:  # one update: the counts summed over the ranks, as the reference saw them all
        ep.update_expert_bias()
        ref.update_expert_bias()
        bias = (ep.balancer.bias.tolist(), (ep.balancer.bias - ref.balancer.bias).abs().max().item())
    return diffs, scale, ep.last_dispatch, a2a, bias


def _ep_worker(comm, E, K, cf, policy, activation, tokens, skew):
    options = dict(capacity_factor=cf, drop_policy=policy, activation=activation)
    return _ep_compare(comm, E, K, options, [(t,) for t in tokens], skew)[:3]


def _check_ep(results, world):
    for rank, (diffs, scale, dispatch, *_) in enumerate(results):
        for name, d in diffs.items():
            assert d <= 1e-5 * max(1.0, scale), f"rank {rank}: {name} differs by {d}"
        assert len(dispatch["sent_rows"]) == world


@pytest.mark.parametrize(
    ("world", "E", "K", "cf", "policy", "activation", "tokens", "skew"),
    [
        pytest.param(2, 4, 2, None, "probability", "swiglu", (13, 7), False, id="W2-E4-k2"),
        pytest.param(2, 6, 1, None, "probability", "gelu", (1, 9), False, id="W2-E6-k1-T1"),
        pytest.param(2, 4, 2, 0.5, "probability", "swiglu", (16, 11), False, id="W2-capacity-prob"),
        pytest.param(2, 2, 2, None, "probability", "relu", (5, 8), False, id="W2-k=E"),
        pytest.param(4, 4, 2, None, "probability", "swiglu", (9, 3, 14, 6), False, id="W4-E4"),
        pytest.param(4, 12, 3, 0.75, "position", "swiglu", (10, 17, 4, 8), False, id="W4-E12-capacity-pos"),
        pytest.param(4, 8, 2, None, "probability", "swiglu", (6, 0, 11, 5), True, id="W4-skewed-empty-rank"),
    ],
)
def test_expert_parallel_matches_single_process(world, E, K, cf, policy, activation, tokens, skew):
    results = run_local(_ep_worker, world, E, K, cf, policy, activation, tokens, skew, timeout=240, threads=1)
    _check_ep(results, world)
    if skew:  # nearly everything went to rank 0's expert 0: uneven splits, including empty ones
        recv = [res[2]["received_rows"] for res in results]
        assert sum(recv[0]) > sum(sum(r) for r in recv[1:])
        assert any(0 in r for r in recv)
    if cf is not None:
        assert any(res[2]["dropped"] > 0 for res in results)


# The new options, several layers in one job per world size (a job's start dominates its time).
EP_CASES = {
    "shared-gated": (4, 2, dict(shared_experts=2, shared_gate=True), "T"),
    "shared-wide-gelu": (8, 3, dict(shared_experts=1, shared_ffn_hidden=20, activation="gelu"), "T"),
    "bias-groups-scaling": (8, 3, dict(score="sigmoid", expert_bias=True, n_group=4, topk_group=2, scaling=2.5), "T"),
    "capacity-call": (4, 2, dict(capacity=3, drop_policy="position", shared_experts=1), "T"),
    "capacity-sequence": (4, 2, dict(capacity_factor=1.0, capacity_scope="sequence", load_balancing="seq_aux_loss"),
                          "BS"),
    "padded": (4, 2, dict(capacity_factor=1.25, pad_to_capacity=True, expert_bias=True, score="sigmoid"), "P"),
}  # fmt: skip


def _balancer_steps(comm) -> tuple[list[float], list[list[int]]]:
    """A BiasBalancer over ``comm``: each rank observes its own counts for 3 steps; its bias, and its counts."""
    from torsh_kernels.parallel import BiasBalancer

    bal = BiasBalancer(6, rate=0.05, comm=comm)
    g = torch.Generator().manual_seed(100 + comm.rank)
    seen = []
    for _ in range(3):
        c = torch.randint(0, 20, (6,), generator=g)
        bal.observe(c)
        seen.append(c.tolist())
        bal.step()
    return bal.bias.tolist(), seen


def _ep_cases_worker(comm, shapes):
    out = {name: _ep_compare(comm, E, K, options, shapes[kind]) for name, (E, K, options, kind) in EP_CASES.items()}
    out["balancer"] = _balancer_steps(comm)
    return out


@pytest.mark.parametrize(
    ("world", "shapes"),
    [
        pytest.param(2, {"T": [(13,), (6,)], "BS": [(2, 5), (3, 4)], "P": [(2, 6)] * 2}, id="W2"),
        pytest.param(
            4, {"T": [(9,), (0,), (14,), (5,)], "BS": [(2, 3), (1, 6), (3, 3), (2, 4)], "P": [(12,)] * 4}, id="W4"
        ),
    ],
)
def test_expert_parallel_new_options_match_single_process(world, shapes):
    results = run_local(_ep_cases_worker, world, shapes, timeout=240, threads=1)
    for name, (E, _, options, _) in EP_CASES.items():
        per_rank = [res[name] for res in results]
        _check_ep(per_rank, world)
        for rank, (diffs, _, dispatch, a2a, _) in enumerate(per_rank):
            assert ("grad shared w_in" in diffs) == bool(options.get("shared_experts")), (name, rank)
            if options.get("pad_to_capacity"):  # static splits: no count exchange, capacity rows per expert
                C = 8  # T=12 tokens on every rank, k=2, factor 1.25, 4 experts: ceil(12 * 2 * 1.25 / 4)
                assert a2a == 2 and dispatch["received_rows"] == [E // world * C] * world, (name, rank, dispatch)
            else:  # the counts, the dispatch, the combine
                assert a2a == 3, (name, rank, a2a)
        if options.get("expert_bias"):  # one update over the ranks: every rank's bias equal, and the reference's
            assert all(b[0] == per_rank[0][4][0] for *_, b in per_rank) and per_rank[0][4][1] < 1e-6, name
        if "capacity" in options:  # 3 per expert: the ranks with tokens drop some
            assert any(res[2]["dropped"] > 0 for res in per_rank), name
    # the balancer over the ranks: every rank the same bias, the one the summed counts give (Megatron's update)
    from tests.parallel.test_moe_balance import megatron_updated_expert_bias

    biases = [res["balancer"][0] for res in results]
    assert all(b == biases[0] for b in biases[1:])
    ref = torch.zeros(6)
    for step in range(3):
        total = torch.tensor([res["balancer"][1][step] for res in results]).sum(0)
        ref = megatron_updated_expert_bias(total.float(), ref, 0.05)
    torch.testing.assert_close(torch.tensor(biases[0]), ref, atol=0, rtol=0)
    assert ref.abs().sum() > 0


def _bad_world_worker(comm):
    try:
        ExpertParallelMoE(H, FFN, 3, 1, comm)
    except InvalidArgumentError as e:
        return str(e)
    return None


def test_expert_parallel_bias_comm_only_with_an_expert_bias():
    """The balancer sums its counts over the layer's group by default, over bias_comm when given; bias_comm
    without an expert bias is refused (it was once ignored)."""
    from torsh_kernels.collectives.replica import ReplicaCommunicator

    comm, other = ReplicaCommunicator(1), ReplicaCommunicator(1)
    assert ExpertParallelMoE(H, FFN, 4, 2, comm, expert_bias=True).balancer.comm is comm
    assert ExpertParallelMoE(H, FFN, 4, 2, comm, expert_bias=True, bias_comm=other).balancer.comm is other
    assert ExpertParallelMoE(H, FFN, 4, 2, comm).balancer is None
    with pytest.raises(InvalidArgumentError, match="ExpertParallelMoE: bias_comm without an expert bias"):
        ExpertParallelMoE(H, FFN, 4, 2, comm, bias_comm=other)


def test_expert_parallel_needs_divisible_experts():
    msgs = run_local(_bad_world_worker, 2, timeout=60)
    assert all(m and "not divisible by the world size 2" in m for m in msgs)


def _mismatch_worker(comm) -> dict:
    """Every way two ranks' expert-parallel layers can differ, one after another in one job: every rank raises
    at construction (before the router's broadcast), naming the difference; then a matching layer agrees
    once and runs."""
    from torsh_kernels.collectives.communicator import TorchCommunicator
    from torsh_kernels.errors import CollectiveMismatchError

    odd = comm.rank == 1
    cases = {
        "experts": dict(num_experts=6 if odd else 4),
        "k": dict(k=1 if odd else 2),
        "hidden": dict(hidden=H + 2 if odd else H),
        "capacity": dict(capacity_factor=1.25 if odd else None),
        "dtype": dict(dtype=torch.bfloat16 if odd else torch.float32),
        "shared": dict(shared_experts=1 if odd else 0),
        "padding": dict(capacity_factor=1.0, pad_to_capacity=odd),
    }
    out = {}
    for name, kw in cases.items():
        args = {"hidden": H, "ffn_hidden": FFN, "num_experts": 4, "k": 2, **kw}
        try:
            ExpertParallelMoE(args.pop("hidden"), args.pop("ffn_hidden"), args.pop("num_experts"), args.pop("k"),
                              comm, **args)  # fmt: skip
            out[name] = None
        except CollectiveMismatchError as e:
            out[name] = str(e)
    with count_calls(TorchCommunicator, "all_gather") as calls:
        layer = ExpertParallelMoE(H, FFN, 4, 2, comm)
        y = [layer(torch.randn(5, H)) for _ in range(2)]
    out["matching"] = (calls["all_gather"], all(v.shape == (5, H) for v in y))
    # padded: static splits of every rank's capacity; ranks whose capacities differ (here their token counts)
    # raise at that forward, before the dispatch, and the layer runs on once they agree
    padded = ExpertParallelMoE(H, FFN, 4, 2, comm, capacity_factor=1.0, pad_to_capacity=True)
    try:
        padded(torch.randn(9 if odd else 5, H))  # capacity ceil(T * 2 / 4): 5 and 3
        out["padded capacity"] = None
    except CollectiveMismatchError as e:
        out["padded capacity"] = str(e)
    out["padded after"] = tuple(padded(torch.randn(5, H)).shape)
    return out


def test_ranks_whose_moe_layers_differ_all_raise_naming_the_difference():
    named = {"experts": "num_experts: 4 on rank 0, 6 on rank 1", "k": "k: 2 on rank 0, 1 on rank 1",
             "hidden": f"hidden: {H} on rank 0, {H + 2} on rank 1",
             "capacity": "capacity_factor: None on rank 0, 1.25 on rank 1",
             "dtype": "parameter dtype: torch.float32 on rank 0, torch.bfloat16 on rank 1",
             "shared": "shared_experts: 0 on rank 0, 1 on rank 1",
             "padding": "pad_to_capacity: False on rank 0, True on rank 1",
             "padded capacity": "padded capacity: 3 on rank 0, 5 on rank 1"}  # fmt: skip
    out = run_local(_mismatch_worker, 2, timeout=60)
    assert_named_on_every_rank(out, named)
    for res in out:
        assert res["matching"] == (1, True)  # one exchange, at construction; the forwards add none
        assert res["padded after"] == (5, H)
