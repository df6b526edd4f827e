"""BiasBalancer (DeepSeek-V3's aux-loss-free balancing): the update against Megatron-Core's formula, the counts
(training forwards only), the state in the layer's state_dict, typed errors, and on a skewed router the load
imbalance falling over steps with the balancer and not without it. (Its all-reduce over 2 ranks runs in the
expert-parallel job of test_moe_layers.py.)"""

from __future__ import annotations

import pytest
import torch

from torsh_kernels.errors import ArgumentTypeError, DeviceMismatchError, DTypeError, InvalidArgumentError, ShapeError
from torsh_kernels.parallel import BiasBalancer


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
