"""compressor="auto": pricing measured candidates on a link, and the choice itself (replica ranks here;
real gloo ranks in test_hooks / test_synchronizer)."""

from __future__ import annotations

import math

import pytest
import torch

from torsh_kernels.collectives import Link, Round, run_local
from torsh_kernels.collectives.replica import ReplicaCommunicator
from torsh_kernels.compression import FP16, TopK
from torsh_kernels.errors import ArgumentTypeError, InvalidArgumentError
from torsh_kernels.parallel.auto import AutoSelector, price
from torsh_kernels.parallel.engine import BucketCompressor


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


@pytest.mark.parametrize("gbit, expect", [(1e-3, "topk:0.01"), (1e4, "none")])
def test_the_choice_follows_the_link(gbit, expect):
    # the fastest of five timed runs each, on 2 MB of gradients: at 10 Tbit/s both candidates' times are compute
    # alone, and with 240 KB (a few hundred us of top-k) scheduling hiccups on a loaded 2-core machine flipped
    # the choice; top-k of 500k values takes milliseconds more than none, which no hiccup in all five undoes
    sel = _selector((None, TopK(0.01)), Link(latency=1e-6, bandwidth=gbit * 1e9 / 8), repeats=5)
    _observe(sel, [(1000, 500), (200,)])
    d = sel.decide(ReplicaCommunicator(2))
    assert d.choice == expect and sel.decision is d
    assert (d.compressor is None) == (expect == "none")
    assert d.candidates[0].name == expect and d.buckets == 1 and d.gradient_bytes == 4 * (1000 * 500 + 200)
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


def _hook_worker(comm):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from tests.parallel.test_hooks import CAP_MB, batch, model
    from torsh_kernels.parallel import CompressionHookState, compression_hook

    net = model()
    ddp = DDP(net, bucket_cap_mb=CAP_MB)
    state = CompressionHookState(compressor="auto", auto_candidates=(None, TopK(0.05)), min_numel=64)
    ddp.register_comm_hook(state, compression_hook)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    for step in range(4):
        x, y = batch(step, comm.rank)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
    auto = state.stats.auto
    # a fresh state restores the choice from the checkpoint without measuring again
    fresh = CompressionHookState(compressor="auto", auto_candidates=(None, TopK(0.05)), min_numel=64)
    fresh.load_state_dict(state.state_dict())
    return {
        "choice": auto["choice"],
        "names": sorted(c["compressor"] for c in auto["candidates"]),
        "in_effect": repr(state.compressor),
        "restored": repr(fresh.compressor),
        "restored_stats": fresh._engine.auto.decision.choice,
        "compressed": [it["bytes_after"] < it["bytes_before"] for it in state.stats.per_iteration],
        "params": torch.cat([p.detach().reshape(-1) for p in net.parameters()]),
    }


def test_the_hook_chooses_once_and_alike_on_every_rank():
    a, b = run_local(_hook_worker, 2, op_timeout=120)
    assert a["choice"] == b["choice"] and a["choice"] in ("none", "topk:0.05")
    assert a["names"] == ["none", "topk:0.05"]
    topk = a["choice"] != "none"
    assert ("TopK" in a["in_effect"]) == topk and a["restored"] == a["in_effect"] and a["restored_stats"] == a["choice"]
    # two iterations of plain all-reduce (the warm-up), then the choice
    assert a["compressed"] == [False, False, topk, topk]
    assert torch.equal(a["params"], b["params"])  # the ranks stayed in step


def _sync_worker(comm):
    from tests.parallel.test_hooks import batch, model
    from torsh_kernels.parallel import GradientSynchronizer

    net = model()
    sync = GradientSynchronizer(net, comm, bucket_mb=0.005, compressor="auto", auto_candidates=(None, FP16()),
                                start_iter=1)  # fmt: skip
    for step in range(3):
        x, y = batch(step, comm.rank)
        sync.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        sync.sync_gradients()
    stats = sync.get_sync_stats()
    return stats["auto"]["choice"], stats["compressor"], torch.cat([p.grad.reshape(-1) for p in net.parameters()])


def test_the_synchronizer_chooses_alike_on_every_rank():
    (c0, r0, g0), (c1, r1, g1) = run_local(_sync_worker, 2, op_timeout=120)
    assert c0 == c1 and c0 in ("none", "fp16") and r0 == r1
    assert ("FP16" in r0) == (c0 == "fp16")
    assert torch.equal(g0, g1)


def test_auto_arguments():
    from torsh_kernels.parallel import CompressionHookState

    with pytest.raises(InvalidArgumentError, match="'auto'"):  # neither a compressor's name nor 'auto'
        CompressionHookState(compressor="automatic")
    with pytest.raises(InvalidArgumentError, match="auto_candidates"):
        CompressionHookState(compressor=TopK(0.1), auto_candidates=(None,))
    with pytest.raises(InvalidArgumentError, match="empty"):
        CompressionHookState(compressor="auto", auto_candidates=())
    st = CompressionHookState(compressor="auto")
    assert st.start_iter == 2 and st.stats.auto is None
    saved = {**st.state_dict(), "auto": {"choice": "int4"}}
    with pytest.raises(InvalidArgumentError, match="candidates"):
        CompressionHookState(compressor="auto", auto_candidates=(None, FP16())).load_state_dict(saved)
    with pytest.raises(InvalidArgumentError, match="compressor='auto'"):
        CompressionHookState(compressor=None).load_state_dict(saved)


def test_decision_repr_is_one_line_and_str_the_table():
    from torsh_kernels.parallel.auto import AutoDecision, CandidateCost

    cands = [CandidateCost(f"c{i}", 0.001 * i, 1000 * i, 2, 0.002, math.inf) for i in range(8)]
    d = AutoDecision("c0", None, Link(latency=50e-6, bandwidth=1.25e9), 4, 3, 12_000_000, cands, 1.25)
    r = repr(d)
    assert len(r) <= 200 and "\n" not in r, r
    for fig in ("choice='c0' of 8 candidates", "link 10 Gbit/s 50 us", "world_size=4", "buckets=3", "measure_s=1.25"):
        assert fig in r, (fig, r)
    table = str(d).splitlines()
    assert table[0].startswith("auto chose c0") and len(table) == 2 + len(cands)
