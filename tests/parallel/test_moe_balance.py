"""BiasBalancer (DeepSeek-V3's aux-loss-free balancing): the update against Megatron-Core's formula, the counts
(training forwards only), the state in the layer's state_dict, typed errors, and on a skewed router the load
imbalance falling over steps with the balancer and not without it. (Its all-reduce over 2 ranks runs in the
expert-parallel job of test_moe_layers.py.)"""

from __future__ import annotations

import pytest
import torch

from torsh_kernels.errors import ArgumentTypeError, DeviceMismatchError, DTypeError, InvalidArgumentError, ShapeError
from torsh_kernels.parallel import BiasBalancer, MoELayer


def megatron_updated_expert_bias(tokens_per_expert, expert_bias, rate):
    """Megatron-Core's get_updated_expert_bias (moe_utils.py), without its all-reduce."""
    average_tokens = tokens_per_expert.sum(dim=-1, keepdim=True) / tokens_per_expert.shape[-1]
    offset = average_tokens - tokens_per_expert
    return expert_bias + torch.sign(offset) * rate


def test_update_is_megatrons_over_the_counts_since_the_last_step():
    g = torch.Generator().manual_seed(0)
    bal = BiasBalancer(6, rate=0.01)
    ref = torch.zeros(6)
    for step in range(5):
        forwards = [torch.randint(0, 9, (6,), generator=g) for _ in range(step % 3 + 1)]  # several per step
        if step == 3:  # equal counts: sign 0, nothing moves
            forwards = [torch.full((6,), 4)]
        for c in forwards:
            bal.observe(c)
        total = torch.stack(forwards).sum(0)
        load = bal.step()
        ref = megatron_updated_expert_bias(total.float(), ref, 0.01)
        assert torch.equal(load, total) and not bal.load.any()
        torch.testing.assert_close(bal.bias, ref, atol=0, rtol=0)
    assert bal.steps == 5 and bal.bias.dtype == torch.float32


def test_balancer_arguments_and_state_are_checked():
    for kw, err, text in [
        (dict(num_experts=0), InvalidArgumentError, "num_experts=0"),
        (dict(num_experts=4.0), ArgumentTypeError, "num_experts must be an int"),
        (dict(num_experts=4, rate=-1.0), InvalidArgumentError, "rate=-1.0"),
        (dict(num_experts=4, rate=float("nan")), InvalidArgumentError, "rate=nan"),
        (dict(num_experts=4, rate="0.1"), ArgumentTypeError, "rate must be a number"),
        (dict(num_experts=4, comm=object()), ArgumentTypeError, "comm must be a Communicator"),
    ]:
        with pytest.raises(err, match=text):
            BiasBalancer(**kw)
    bal = BiasBalancer(4)
    with pytest.raises(ShapeError, match=r"\[E=4\]"):
        bal.observe(torch.ones(5, dtype=torch.int64))
    with pytest.raises(DTypeError, match="integer counts"):
        bal.observe(torch.ones(4))
    with pytest.raises(ArgumentTypeError, match=r"must be a torch\.Tensor"):
        bal.observe([1, 2, 3, 4])
    with pytest.raises(DeviceMismatchError, match="on meta"):
        bal.observe(torch.ones(4, dtype=torch.int64, device="meta"))
    good = {"bias": torch.full((4,), 0.5), "load": torch.arange(4)}
    for bad, err, text in [
        ({"bias": torch.zeros(3)}, ShapeError, "has shape"),
        ({"bias": torch.tensor([0.0, float("inf"), 0.0, 0.0])}, InvalidArgumentError, "NaN or Inf"),
        ({"bias": torch.zeros(4, dtype=torch.int64)}, DTypeError, "floating point"),
        ({"load": torch.tensor([1, -1, 0, 0])}, InvalidArgumentError, "negative"),
        ({"load": torch.zeros(4)}, DTypeError, "integer counts"),
    ]:
        with pytest.raises(err, match=text):
            bal.load_state_dict({**good, **bad})
        assert not bal.bias.any() and not bal.load.any()  # nothing was copied
    bal.load_state_dict(good)
    assert torch.equal(bal.bias, good["bias"]) and torch.equal(bal.load, good["load"])


def _skewed_layer(rate: float) -> MoELayer:
    """8 experts, k=2, sigmoid scores; feature 0 of every token is 1 and experts 0 and 1 read it with weight 3:
    most tokens choose those two."""
    torch.manual_seed(0)
    layer = MoELayer(16, 8, 8, 2, score="sigmoid", expert_bias=True, bias_update_rate=rate, aux_loss_coef=0.0)
    with torch.no_grad():
        layer.router.weight.mul_(0.5)
        layer.router.weight[:, 0] = 0.0
        layer.router.weight[:2, 0] = 3.0
    return layer


def _tokens(step: int) -> torch.Tensor:
    x = torch.randn(256, 16, generator=torch.Generator().manual_seed(step))
    x[:, 0] = 1.0
    return x


def _imbalance(counts: torch.Tensor) -> float:
    return (counts.max() / counts.float().mean()).item()


def test_balancer_evens_out_a_skewed_router():
    """The load imbalance (max / mean tokens per expert) of each forward, over 40 optimizer steps (the router
    itself fixed), with the balancer and with rate 0 (the bias never moves)."""
    runs = {}
    for rate in (0.02, 0.0):
        layer = _skewed_layer(rate)
        seen = []
        for step in range(40):
            layer(_tokens(step))
            seen.append(_imbalance(layer.last_routing.tokens_per_expert))
            layer.update_expert_bias()
        runs[rate] = seen
    balanced, frozen = runs[0.02], runs[0.0]
    assert balanced[0] > 3.0 and frozen[0] > 3.0  # skewed to start with: experts 0 and 1 take most tokens
    last = balanced[-10:]  # (the sign update keeps moving the bias by the rate: the imbalance oscillates)
    assert sum(last) / 10 < 1.75 and max(last) < 2.0 < balanced[0] / 1.5
    assert min(frozen[-10:]) > 3.0


def test_balancer_counts_training_forwards_and_travels_in_the_state_dict():
    layer = _skewed_layer(0.5)
    layer.eval()
    layer(_tokens(0))
    assert not layer.balancer.load.any()  # eval: no count
    layer.train()
    with torch.no_grad():
        layer(_tokens(0))
    assert not layer.balancer.load.any()  # no gradients (as Megatron-Core): no count
    layer(_tokens(1))
    first = layer.last_routing.tokens_per_expert.clone()
    layer(_tokens(2))
    assert torch.equal(layer.balancer.load, first + layer.last_routing.tokens_per_expert)
    layer.update_expert_bias()
    layer(_tokens(3))  # pending counts, saved too
    state = layer.state_dict()
    assert {"balancer.bias", "balancer.load"} <= set(state) and state["balancer.bias"].abs().sum() > 0
    fresh = _skewed_layer(0.5)
    fresh.load_state_dict(state)
    assert torch.equal(fresh.balancer.bias, layer.balancer.bias)
    assert torch.equal(fresh.balancer.load, layer.balancer.load)
    with torch.no_grad():
        x = _tokens(4)
        fresh(x), layer(x)
    assert torch.equal(fresh.last_routing.indices, layer.last_routing.indices)  # the bias routes alike
    zero = _skewed_layer(0.5)
    with torch.no_grad():
        zero(x)
    assert not torch.equal(zero.last_routing.indices, layer.last_routing.indices)  # and it does change the routing


def test_numeric_edges_end_typed():
    """Values that used to give inf weights, an overflowing bias, a matmul error deep in the layer or a silently
    wrong load (issue 41, item 10): each is a typed error naming the value, where it is given."""
    from torsh_kernels.ops import moe_route

    logits = torch.randn(8, 4)
    with pytest.raises(InvalidArgumentError, match=r"scaling=1e\+300 must be a finite number in \(0, 3.403e\+38\]"):
        moe_route(logits, k=2, scaling=1e300)
    top = float(torch.finfo(torch.float32).max)
    assert bool(torch.isfinite(moe_route(logits, k=2, scaling=top).weights).all())  # the largest one accepted
    with pytest.raises(InvalidArgumentError, match="capacity_factor="):
        moe_route(logits, k=2, capacity_factor=10**400)
    for rate in (1e308, 1.5, -1e-3):
        with pytest.raises(InvalidArgumentError, match=r"rate=.* must be a number in \[0, 1\]"):
            BiasBalancer(4, rate=rate)
    with pytest.raises(InvalidArgumentError, match=r"bias_update_rate=.* must be a number in \[0, 1\]"):
        MoELayer(8, 16, 4, 2, score="sigmoid", expert_bias=True, bias_update_rate=2.0)
    bal = BiasBalancer(4)
    with pytest.raises(InvalidArgumentError, match=r"observe: token counts must be >= 0, got \[-1, 2, 3, 4\]"):
        bal.observe(torch.tensor([-1, 2, 3, 4]))
    assert int(bal.load.sum()) == 0  # nothing was added
    layer = MoELayer(8, 16, 4, 2)
    with pytest.raises(DTypeError, match=r"MoELayer: input must be floating point .* got torch.int64"):
        layer(torch.ones(3, 8, dtype=torch.int64))


def _mismatched_balancers(comm):
    from torsh_kernels.errors import CollectiveMismatchError

    bal = BiasBalancer(8 if comm.rank == 0 else 4, comm=comm)  # a different expert count on each rank
    bal.observe(torch.ones(bal.num_experts, dtype=torch.int64))
    try:
        bal.step()
    except CollectiveMismatchError as e:
        return str(e)
    return "stepped"


def test_balancers_with_different_expert_counts_end_typed_on_every_rank():
    """BiasBalancer(comm=) with 8 experts on one rank and 4 on the other all-reduced [8] against [4]: gloo aborted
    the process (SIGABRT). The first step now agrees on the expert count and rate first: a typed
    CollectiveMismatchError on every rank, naming each rank's value (issue 41, item 6)."""
    from torsh_kernels.collectives import run_local

    out = run_local(_mismatched_balancers, 2, op_timeout=30)
    for msg in out:
        assert "num_experts: 8 on rank 0, 4 on rank 1" in msg, msg
