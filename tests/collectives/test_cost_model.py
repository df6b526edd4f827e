"""The alpha-beta cost of plain collectives: formulas checked by hand, schemes of rounds, and the probe on
real processes."""

from __future__ import annotations

import math

import pytest

from torsh_kernels.collectives import (
    Link,
    Topology,
    all_gather_time,
    all_reduce_time,
    all_to_all_time,
    probe,
    probe_topology,
    rounds_time,
    run_local,
)
from torsh_kernels.collectives.cost_model import Round
from torsh_kernels.errors import InvalidArgumentError

A, BW = 10e-6, 1e9  # 10 us, 1 GB/s
LINK = Link(latency=A, bandwidth=BW)
N = 8e6  # bytes


def test_all_reduce_formulas_by_hand():
    # p = 4: ring 2*3 steps, 2*3/4 of the data
    assert all_reduce_time(N, 4, LINK, "ring") == pytest.approx(6 * A + 1.5 * N / BW)
    assert all_reduce_time(N, 4, LINK, "tree") == pytest.approx(2 * (A + N / BW))
    assert all_reduce_time(N, 4, LINK, "rabenseifner") == pytest.approx(4 * A + 1.5 * N / BW)
    # p = 6 is not a power of two: floor(log2 6) + 2 = 4 steps
    assert all_reduce_time(N, 6, LINK, "tree") == pytest.approx(4 * (A + N / BW))
    assert all_reduce_time(N, 1, LINK, "ring") == 0.0
    # 2 nodes of 4 ranks, intra 10x faster: RS + AG inside (3 steps, 3/4 n each), ring over 2 nodes of n/4
    fast = Link(latency=1e-6, bandwidth=10 * BW)
    topo = Topology(world_size=8, local_size=4, intra=fast)
    want = 2 * (3 * 1e-6 + 0.75 * N / (10 * BW)) + 2 * A + 2 * 0.5 * (N / 4) / BW
    assert all_reduce_time(N, topo, LINK, "hierarchical") == pytest.approx(want)
    # and it beats the flat ring that runs at the slow link's pace
    assert want < all_reduce_time(N, topo, LINK, "ring")
    assert all_gather_time(1e6, 4, LINK) == pytest.approx(3 * A + 3e6 / BW)
    assert all_to_all_time(4e6, 4, LINK) == pytest.approx(3 * A + 3e6 / BW)
    assert Link.gbit(1).bandwidth == 125e6


def test_argument_errors():
    with pytest.raises(InvalidArgumentError):
        Link(latency=-1, bandwidth=1)
    with pytest.raises(InvalidArgumentError):
        Link(latency=0, bandwidth=0)
    with pytest.raises(InvalidArgumentError):
        Topology(world_size=6, local_size=4)
    with pytest.raises(InvalidArgumentError):
        all_reduce_time(1, 4, LINK, "butterfly")
    with pytest.raises(InvalidArgumentError):
        Round("broadcast", 8)


def test_rounds_time_prices_a_scheme_round_by_round():
    # the all-reduce rounds share the algorithm that is cheapest for the first one
    rounds = (Round("all_reduce", N), Round("all_reduce", N / 4))
    algo, t = rounds_time(rounds, 4, LINK)
    assert algo == "rabenseifner"
    assert t == pytest.approx(all_reduce_time(N, 4, LINK, algo) + all_reduce_time(N / 4, 4, LINK, algo))
    algo, t = rounds_time(rounds, 4, LINK, ("ring",))
    assert algo == "ring" and t == pytest.approx(all_reduce_time(1.25 * N, 4, LINK, "ring") + 6 * A)
    # gathers and all-to-alls: no all-reduce algorithm
    algo, t = rounds_time((Round("all_to_all", 4e6), Round("all_gather", 1e6)), 4, LINK)
    assert algo is None and t == pytest.approx(all_to_all_time(4e6, 4, LINK) + all_gather_time(1e6, 4, LINK))
    assert rounds_time(rounds, 1, LINK)[1] == 0.0


def _probe_worker(comm, local_size):
    link = probe(comm, large_bytes=1 << 20, repeats=3)
    topo, inter = probe_topology(comm, local_size, large_bytes=1 << 20, repeats=3) if local_size else (None, None)
    return link, topo, inter


def test_probe_measures_a_real_link():
    res = run_local(_probe_worker, 2, 0, op_timeout=30)
    assert res[0][0] == res[1][0]  # every rank gets the same (slowest pair's) link
    link = res[0][0]
    # loopback: latency between 0 and 5 ms, bandwidth between 10 MB/s and 1 TB/s
    assert 0 <= link.latency < 5e-3 and 1e7 < link.bandwidth < 1e12 and math.isfinite(link.bandwidth)


def test_probe_survives_small_messages_slower_than_large_ones(monkeypatch):
    # scheduling noise on a shared machine can make every small exchange slower than the fastest large one:
    # the estimate then falls back to the large message alone (a lower bound on the bandwidth), never 1/0
    from torsh_kernels.collectives import cost_model
    from torsh_kernels.collectives.replica import ReplicaCommunicator

    times = {8: 9e-4, 1 << 20: 8e-4}
    monkeypatch.setattr(cost_model, "_pingpong", lambda comm, peer, first, size, n: [times[size]] * n)
    link = probe(ReplicaCommunicator(2), large_bytes=1 << 20, repeats=3)
    assert link.bandwidth == pytest.approx((1 << 20) / 8e-4) and link.latency == pytest.approx(
        9e-4 - 8 * 8e-4 / (1 << 20)
    )
    times[1 << 20] = 1e-3  # the usual case: the difference gives the bandwidth
    link = probe(ReplicaCommunicator(2), large_bytes=1 << 20, repeats=3)
    assert link.bandwidth == pytest.approx(((1 << 20) - 8) / 1e-4)


def test_probe_topology_measures_both_levels():
    res = run_local(_probe_worker, 4, 2, op_timeout=30)
    topo, inter = res[0][1], res[0][2]
    assert topo.world_size == 4 and topo.local_size == 2 and topo.intra is not None and inter is not None
    assert all(r[1] == topo and r[2] == inter for r in res)


def test_wire_bytes_by_the_ring_formulas():
    from torsh_kernels.collectives import wire_bytes

    # (op, input bytes, world) -> bytes this rank sends, worked out by hand; odd sizes round down
    cases = {("all_reduce", 1000, 2): 1000, ("all_reduce", 1000, 3): 1333, ("all_reduce", 1000, 4): 1500,
             ("all_gather", 1000, 3): 2000, ("reduce_scatter", 999, 3): 666, ("all_to_all", 1001, 4): 750,
             ("broadcast", 1000, 5): 1000, ("send", 7, 2): 7, ("recv", 1000, 2): 0, ("barrier", 4, 2): 4,
             ("all_reduce", 1000, 1): 0, ("all_gather", 1000, 1): 0}  # fmt: skip
    assert {k: wire_bytes(*k) for k in cases} == cases
