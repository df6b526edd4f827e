"""MoESpec: what an MoE layer is, one value; the layers take it or build it from their keywords."""

from __future__ import annotations

import pytest
import torch

from torsh_kernels.errors import ArgumentTypeError, InvalidArgumentError
from torsh_kernels.ops import RouterSpec
from torsh_kernels.parallel import MoELayer
from torsh_kernels.parallel.moe import MoESpec


def test_a_layer_built_from_keywords_equals_one_built_from_the_spec():
    spec = MoESpec(hidden=8, ffn_hidden=6, num_experts=4, route=RouterSpec(k=2, score="sigmoid", capacity_factor=1.5),
                   shared_experts=2, expert_bias=True)  # fmt: skip
    a = MoELayer(spec=spec)
    torch.manual_seed(0)
    b = MoELayer(8, 6, 4, 2, score="sigmoid", capacity_factor=1.5, shared_experts=2, expert_bias=True)
    assert a.spec == b.spec == spec
    assert spec.shared_ffn_hidden == 12  # resolved: ffn_hidden * shared_experts
    assert (b.k, b.score, b.capacity_factor, b.hidden, b.shared_ffn_hidden) == (2, "sigmoid", 1.5, 8, 12)
    with torch.no_grad():
        for p, q in zip(a.parameters(), b.parameters()):
            p.copy_(q)
    x = torch.randn(2, 5, 8)
    torch.testing.assert_close(a(x), b(x), rtol=0, atol=0)
    c = MoELayer(spec=spec, capacity_factor=2.0, activation="gelu")  # keywords refine the spec
    assert (c.spec.route.capacity_factor, c.spec.activation, c.spec.route.k) == (2.0, "gelu", 2)


def test_the_spec_is_frozen_and_typed():
    layer = MoELayer(8, 6, 4, 2)
    with pytest.raises(AttributeError, match=r"MoELayer\.score is part of the layer's spec"):
        layer.score = "sigmoid"
    layer.expert_compute = "loop"  # not part of the spec: may change at any time
    assert layer.expert_compute == "loop"
    with pytest.raises(AttributeError):
        _ = layer.no_such_thing
    for bad, err, text in [
        (dict(k=5), InvalidArgumentError, "MoELayer: k=5 exceeds num_experts=4"),
        (dict(n_group=3, topk_group=1), InvalidArgumentError, "MoELayer: n_group=3 does not split the E=4"),
        (dict(aux_loss_coef=-1), InvalidArgumentError, "MoELayer: aux_loss_coef=-1"),
        (dict(aux_loss_coef="0.1"), ArgumentTypeError, "MoELayer: aux_loss_coef must be a number"),
        (dict(scaling=0), InvalidArgumentError, "MoELayer: scaling=0"),
        (dict(shared_gate=True), InvalidArgumentError, "shared_gate=True without shared experts"),
        (dict(topk=2), ArgumentTypeError, "MoELayer: unexpected keyword argument.*'topk'"),
    ]:
        kw = {"k": 2, **bad}
        with pytest.raises(err, match=text):
            MoELayer(8, 6, 4, **kw)
    with pytest.raises(InvalidArgumentError, match="either as hidden, ffn_hidden, num_experts, k or in spec"):
        MoELayer(8, spec=layer.spec)
    with pytest.raises(ArgumentTypeError, match="spec must be a MoESpec or None, got RouterSpec"):
        MoELayer(spec=RouterSpec(k=1))


def test_the_signature_names_nested_fields():
    spec = MoESpec(hidden=8, ffn_hidden=6, num_experts=4, route=RouterSpec(k=2))
    fields = dict(spec.signature_fields("layer"))
    assert fields["layer.route.k"] == 2 and fields["layer.hidden"] == 8 and "layer.route.check_finite" not in fields


@pytest.mark.parametrize(
    ("shape", "needle"),
    [((16, 8, 10**5000, 2), "num_experts=<an int of about 5001 digits> must be an int in [1, 1048576]"),
     ((16, 8, 2**40, 2), "num_experts=1099511627776 must be an int in [1, 1048576]"),
     ((2**31, 8, 4, 2), "hidden=2147483648 must be an int in [1, 2147483647]"),
     ((2**30, 2**30, 64, 2), "the experts' weights would hold 2.21e+20 elements")],
    ids=["5000_digit_experts", "2**40_experts", "hidden_past_int32", "weights_past_2**50"],
)  # fmt: skip
def test_sizes_past_what_a_layer_can_hold_are_refused_at_the_spec(shape, needle):
    """Before: a 5000-digit expert count was an untyped TypeError from torch.empty, 2**40 an allocator error, a
    size product past int64 torch's 'Storage size calculation overflowed' (issue 41, item 9's follow-up)."""
    with pytest.raises(InvalidArgumentError) as e:
        MoELayer(*shape)
    assert needle in str(e.value)
