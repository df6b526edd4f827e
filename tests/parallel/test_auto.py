"""compressor="auto": pricing measured candidates on a link, and the choice itself (replica ranks here;
real gloo ranks in test_hooks / test_synchronizer)."""

from __future__ import annotations

import math

import pytest
import torch

from torsh_kernels.collectives import Link, Round
from torsh_kernels.collectives.replica import ReplicaCommunicator
from torsh_kernels.compression import TopK
from torsh_kernels.errors import ArgumentTypeError, InvalidArgumentError
from torsh_kernels.parallel._engine import BucketCompressor
from torsh_kernels.parallel.auto import AutoSelector, price


def test_price_and_break_even():
    # none: 8 MB all-reduced, no compute; x: 1 MB all-gathered, 5 ms of compute
    names = ["none", "x"]
    rounds = [[Round("all_reduce", 8e6)], [Round("all_gather", 1e6)]]
    link = Link(latency=0.0, bandwidth=1e9)
    none, x = price(names, [0.0, 5e-3], rounds, 2, link)
    assert none.bytes_sent == 8_000_000 and x.bytes_sent == 1_000_000 and x.collectives == 1
    # ring all-reduce of 8 MB on 2 ranks moves 8 MB; an all-gather of 1 MB moves 1 MB
    assert none.wire_s == pytest.approx(8e-3) and x.wire_s == pytest.approx(1e-3)
    assert x.total_s == pytest.approx(6e-3) and math.isinf(none.break_even_bps)
    # x pays below 7 MB / 5 ms = 1.4 GB/s, and the model agrees on either side of it
    assert x.break_even_bps == pytest.approx(1.4e9)
    for bw, x_wins in ((1.3e9, True), (1.5e9, False)):
        n2, x2 = price(names, [0.0, 5e-3], rounds, 2, Link(latency=0.0, bandwidth=bw))
        assert (x2.total_s < n2.total_s) == x_wins
    # cheaper compute than none at every bandwidth: pays on any link; more bytes: never
    assert math.isinf(price(names, [1e-3, 0.0], rounds, 2, link)[1].break_even_bps)
    assert price(names, [0.0, 0.0], [rounds[0], [Round("all_gather", 9e6)]], 2, link)[1].break_even_bps == 0.0


def _selector(candidates, link, **kw):
    return AutoSelector(lambda c: BucketCompressor(c, start_iter=0, min_numel=16), candidates, link=link, **kw)


def _observe(sel, shapes):
    numels = [math.prod(s) for s in shapes]
    flat = torch.zeros(sum(numels))
    sel.observe([v.view(s) for v, s in zip(flat.split(numels), shapes)], list(range(len(shapes))), packed=True)
    sel.end_iteration()


@pytest.mark.parametrize("gbit, expect", [(1e-3, "topk(0.01)"), (1e4, "none")])
def test_the_choice_follows_the_link(gbit, expect):
    sel = _selector((None, TopK(0.01)), Link(latency=1e-6, bandwidth=gbit * 1e9 / 8), repeats=1)
    _observe(sel, [(300, 200), (200,)])
    d = sel.decide(ReplicaCommunicator(2))
    assert d.choice == expect and sel.decision is d
    assert (d.compressor is None) == (expect == "none")
    assert d.candidates[0].name == expect and d.buckets == 1 and d.gradient_bytes == 4 * (300 * 200 + 200)
    assert expect in d.reason and "Gbit/s" in str(d)
    rec = d.as_dict()
    assert rec["choice"] == expect and len(rec["candidates"]) == 2 and rec["link"]["bandwidth_Bps"] > 0


def test_bad_candidates():
    with pytest.raises(InvalidArgumentError, match="empty"):
        _selector((), None)
    with pytest.raises(ArgumentTypeError):
        _selector(("topk",), None)
    with pytest.raises(InvalidArgumentError, match="twice"):
        _selector((TopK(0.01), TopK(0.01)), None)
    with pytest.raises(InvalidArgumentError):
        _selector(None, None, repeats=0)
    with pytest.raises(ArgumentTypeError):
        _selector(None, 1e9)
