"""RouterSpec: moe_route's options as one value, checked once; moe_route takes it or builds it from keywords."""

from __future__ import annotations

import math

import pytest
import torch

import torsh_kernels as tk
from torsh_kernels.errors import ArgumentTypeError, InvalidArgumentError
from torsh_kernels.ops import RouterSpec, moe_route, moe_route_ref


def _same(a, b) -> bool:
    return all(torch.equal(getattr(a, f), getattr(b, f)) for f in ("indices", "row_map", "token_index")) and bool(
        torch.allclose(a.weights, b.weights)
    )


@pytest.mark.parametrize("provider", ["cpu", "torch", "triton", "numba"])
def test_a_spec_routes_as_its_keywords_do(provider):
    g = torch.Generator().manual_seed(3)
    lg = torch.randn(13, 12, generator=g)
    bias = torch.randn(12, generator=g)
    opts = dict(k=3, score="sigmoid", n_group=4, topk_group=2, scaling=2.5, capacity_factor=1.0,
                drop_policy="position")  # fmt: skip
    spec = RouterSpec(**opts)
    a = moe_route(lg, spec, score_bias=bias, provider=provider)
    b = moe_route(lg, score_bias=bias, provider=provider, **opts)
    ref = moe_route_ref(lg, spec, score_bias=bias)
    assert _same(a, b) and _same(a, ref) and a.capacity == b.capacity == ref.capacity
    c = moe_route(lg, RouterSpec(k=3), provider=provider, score="sigmoid")  # keywords refine a spec
    assert _same(c, moe_route_ref(lg, k=3, score="sigmoid"))


def test_the_spec_is_checked_once_at_construction():
    for bad, err, text in [
        (dict(k=0), InvalidArgumentError, "k=0"),
        (dict(k=2.0), ArgumentTypeError, "k must be an int"),
        (dict(k=2, score="relu"), InvalidArgumentError, "score='relu'"),
        (dict(k=2, renormalize=1), ArgumentTypeError, "renormalize must be True or False"),
        (dict(k=2, n_group=4), InvalidArgumentError, "give both"),
        (dict(k=2, n_group=4, topk_group=5), InvalidArgumentError, r"topk_group=5 must be an int in \[1, 4\]"),
        (dict(k=2, scaling=0), InvalidArgumentError, r"scaling=0 must be a finite number in \(0, "),
        (dict(k=2, scaling=10**400), InvalidArgumentError, r"must be a finite number in \(0, "),
        (dict(k=2, scaling="1"), ArgumentTypeError, "scaling must be a number"),
        (dict(k=2, capacity_factor=math.nan), InvalidArgumentError, "capacity_factor=nan"),
        (dict(k=2, capacity=-1), InvalidArgumentError, "capacity=-1"),
        (dict(k=2, capacity=2, capacity_factor=1.0), InvalidArgumentError, "both given"),
        (dict(k=2, capacity_scope="batch"), InvalidArgumentError, "capacity_scope='batch'"),
        (dict(k=2, capacity_scope="sequence"), InvalidArgumentError, "without a capacity"),
        (dict(k=2, pad_to_capacity=True), InvalidArgumentError, "needs a capacity"),
        (dict(k=2, drop_policy="random"), InvalidArgumentError, "drop_policy='random'"),
    ]:
        with pytest.raises(err, match=text):
            RouterSpec(**bad)
        with pytest.raises(err, match="torsh_kernels.moe_route: .*" + text):  # named after the call
            moe_route(torch.randn(3, 8), **bad)


@pytest.mark.parametrize("provider", ["cpu", "torch"])
def test_the_sequence_scope_needs_its_sequences_on_the_fast_path_too(provider):
    spec = RouterSpec(k=1, capacity_factor=1.0, capacity_scope="sequence")  # (the probe found it accepted)
    with pytest.raises(InvalidArgumentError, match="capacity_scope='sequence' needs sequence_lengths"):
        moe_route(torch.randn(6, 4), spec, provider=provider)
    r = moe_route(torch.randn(6, 4), spec, sequence_lengths=[2, 4], provider=provider)
    assert r.sequence_lengths == (2, 4)


def test_what_depends_on_the_experts_is_checked_per_call():
    spec = RouterSpec(k=3, n_group=4, topk_group=1)
    with pytest.raises(InvalidArgumentError, match=r"k=3 must be an int in \[1, 2\]"):
        moe_route(torch.randn(3, 2), RouterSpec(k=3))
    with pytest.raises(InvalidArgumentError, match="n_group=4 does not split the E=6 experts"):
        moe_route(torch.randn(3, 6), spec)
    with pytest.raises(InvalidArgumentError, match="more than the 2 experts"):
        moe_route(torch.randn(3, 8), spec)
    assert spec.selection(12, "f") == (4, 1)


def test_signature_and_errors_of_the_call():
    s = RouterSpec(k=2, check_finite=False)
    assert dict(s.signature())["k"] == 2 and "check_finite" not in dict(s.signature())  # local: not agreed
    with pytest.raises(ArgumentTypeError, match="spec must be a RouterSpec or None, got int"):
        moe_route(torch.randn(3, 4), 2)
    with pytest.raises(ArgumentTypeError, match="missing 1 required keyword-only argument: 'k'"):
        moe_route(torch.randn(3, 4))
    with pytest.raises(ArgumentTypeError, match=r"unexpected keyword argument.*'topk'"):
        moe_route(torch.randn(3, 4), k=1, topk=2)
    assert tk.RouterSpec is RouterSpec
