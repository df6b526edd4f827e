"""MoE layers: MoELayer against an unfused Mixtral-style reference, ExpertParallelMoE on real gloo
processes (2 and 4 ranks) against the single-process layer: outputs, input gradients, expert and router
gradients, uneven and empty splits, capacity drops."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import count_calls
from torsh_kernels.collectives import run_local
from torsh_kernels.errors import InvalidArgumentError, ShapeError
from torsh_kernels.parallel import ExpertParallelMoE, MoELayer

H, FFN = 12, 10


def _mixtral_reference(layer: MoELayer, x: torch.Tensor) -> torch.Tensor:
    """The Hugging Face Mixtral block's loop (softmax in fp32, top-k, renormalise, index_add_)."""
    logits = x @ layer.router.weight.t()
    p = torch.softmax(logits.float(), dim=-1)
    w, sel = torch.topk(p, layer.k, dim=-1)
    w = w / w.sum(-1, keepdim=True)
    out = torch.zeros_like(x)
    for e in range(layer.num_experts):
        tok, slot = torch.where(sel == e)
        h = x[tok] @ layer.w_in[e]
        gate, up = h.chunk(2, dim=-1)
        y = (F.silu(gate) * up) @ layer.w_out[e]
        out.index_add_(0, tok, y * w[tok, slot, None])
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


def test_moe_layer_arguments():
    with pytest.raises(InvalidArgumentError, match="k=4"):
        MoELayer(H, FFN, 3, 4)
    with pytest.raises(InvalidArgumentError, match="activation"):
        MoELayer(H, FFN, 3, 1, activation="tanh")
    with pytest.raises(InvalidArgumentError, match="capacity_factor"):
        MoELayer(H, FFN, 3, 1, capacity_factor=0)
    layer = MoELayer(H, FFN, 3, 1, activation="gelu")
    with pytest.raises(ShapeError, match="hidden=12"):
        layer(torch.randn(4, H + 1))


def _inputs(rank: int, T: int, skew: bool) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(77 + rank)
    x = torch.randn(T, H, generator=g)
    if skew:
        x[:, 0] = 10.0  # with router row 0 = 50 * e_0, every token's first choice is expert 0
    return x, torch.randn(T, H, generator=g)


def _ep_worker(comm, E, K, cf, policy, activation, tokens, skew):
    """Each rank: its own tokens (uneven counts) through ExpertParallelMoE; the reference runs the
    single-process layer on every rank's tokens, one rank's batch at a time (capacity is per batch)."""
    torch.manual_seed(5)
    ref = MoELayer(H, FFN, E, K, capacity_factor=cf, drop_policy=policy, activation=activation,
                   aux_loss_coef=0.01, z_loss_coef=0.001)  # fmt: skip
    if skew:  # every token prefers expert 0: one rank overloaded, other splits small or empty
        with torch.no_grad():
            ref.router.weight[0].zero_()
            ref.router.weight[0, 0] = 50.0
    ep = ExpertParallelMoE.from_layer(ref, comm)
    W, rank = comm.world_size, comm.rank
    # reference: sum over ranks of (y_r * g_r).sum() + aux_r
    ref_y, ref_gx = [], []
    for r in range(W):
        x, g = _inputs(r, tokens[r], skew)
        x.requires_grad_()
        y = ref(x)
        ((y * g).sum() + ref.aux_loss).backward()
        ref_y.append(y.detach())
        ref_gx.append(x.grad)
    x, g = _inputs(rank, tokens[rank], skew)
    x.requires_grad_()
    y = ep(x)
    ((y * g).sum() + ep.aux_loss).backward()
    ep.reduce_gradients()
    lo, hi = ep.first_expert, ep.first_expert + ep.local_experts
    diffs = {
        "y": (y.detach() - ref_y[rank]).abs().max().item() if y.numel() else 0.0,
        "grad x": (x.grad - ref_gx[rank]).abs().max().item() if y.numel() else 0.0,
        "grad w_in": (ep.w_in.grad - ref.w_in.grad[lo:hi]).abs().max().item(),
        "grad w_out": (ep.w_out.grad - ref.w_out.grad[lo:hi]).abs().max().item(),
        "grad router": (ep.router.weight.grad - ref.router.weight.grad).abs().max().item(),
    }
    scale = max(ref.w_in.grad.abs().max().item(), ref.router.weight.grad.abs().max().item())
    return diffs, scale, ep.last_dispatch


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
    for rank, (diffs, scale, dispatch) in enumerate(results):
        for name, d in diffs.items():
            assert d <= 1e-5 * max(1.0, scale), f"rank {rank}: {name} differs by {d}"
        assert len(dispatch["sent_rows"]) == world
    if skew:  # nearly everything went to rank 0's expert 0: uneven splits, including empty ones
        recv = [res[2]["received_rows"] for res in results]
        assert sum(recv[0]) > sum(sum(r) for r in recv[1:])
        assert any(0 in r for r in recv)
    if cf is not None:
        assert any(res[2]["dropped"] > 0 for res in results)


def _bad_world_worker(comm):
    try:
        ExpertParallelMoE(H, FFN, 3, 1, comm)
    except InvalidArgumentError as e:
        return str(e)
    return None


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
    return out


def test_ranks_whose_moe_layers_differ_all_raise_naming_the_difference():
    named = {"experts": "num_experts: 4 on rank 0, 6 on rank 1", "k": "k: 2 on rank 0, 1 on rank 1",
             "hidden": f"hidden: {H} on rank 0, {H + 2} on rank 1",
             "capacity": "capacity_factor: None on rank 0, 1.25 on rank 1",
             "dtype": "parameter dtype: torch.float32 on rank 0, torch.bfloat16 on rank 1"}  # fmt: skip
    out = run_local(_mismatch_worker, 2, timeout=60)
    for res in out:
        for name, want in named.items():
            assert res[name] is not None, f"{name}: no error"
            assert want in res[name] and res[name] == out[0][name], (name, res[name])
        assert res["matching"] == (1, True)  # one exchange, at construction; the forwards add none
