"""The alpha-beta cost model: formulas checked by hand, plan choices, and the probe on real processes."""

from __future__ import annotations

import math

import pytest

from torsh_kernels.collectives import (
    Link,
    Topology,
    all_gather_time,
    all_reduce_time,
    all_to_all_time,
    compressed_time,
    plan,
    probe,
    probe_topology,
    run_local,
)
from torsh_kernels.collectives.cost_model import quantize_shared_scale_cheaper
from torsh_kernels.compression import FP16, PowerSGD, Quantize, Sign, TopK
from torsh_kernels.errors import ArgumentTypeError, InvalidArgumentError

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


def test_compressed_traffic():
    numel = 2_000_000
    _, t = compressed_time(TopK(0.01), numel, 2, LINK)
    assert t == pytest.approx(all_gather_time(TopK(0.01).payload_nbytes(numel), 2, LINK))
    assert TopK(0.01).payload_nbytes(numel) == 20_000 * 8
    algo, t = compressed_time(FP16(), numel, 4, LINK, algorithm="ring")
    assert algo == "ring" and t == pytest.approx(all_reduce_time(2 * numel, 4, LINK, "ring"))
    # PowerSGD: two all-reduces, of P (rows x r) and Q (cols x r)
    algo, t = compressed_time(PowerSGD(4), (1000, 2000), 2, LINK, algorithm="ring")
    assert t == pytest.approx(all_reduce_time(16_000, 2, LINK, "ring") + all_reduce_time(32_000, 2, LINK, "ring"))
    algo, _ = compressed_time(Sign(), numel, 4, LINK)
    assert algo == "all_to_all+all_gather"
    # compute passes add passes * 4 bytes * numel / bandwidth
    _, t0 = compressed_time(TopK(0.01), numel, 2, LINK)
    _, t1 = compressed_time(TopK(0.01), numel, 2, LINK, compute_bandwidth=1e10)
    assert t1 - t0 == pytest.approx(6 * 4 * numel / 1e10)


def test_quantize_scheme_depends_on_world_size():
    n = 10_000_000
    # int4: codes sum in int8 up to 18 ranks; the all-gather grows with p, the all-reduce does not
    assert not quantize_shared_scale_cheaper(n, Quantize(4), 2, LINK)
    assert quantize_shared_scale_cheaper(n, Quantize(4), 16, LINK)
    # int8: the sum needs int32 (4 bytes per code), so gathering wins until p is large
    assert not quantize_shared_scale_cheaper(n, Quantize(8), 4, LINK)
    assert quantize_shared_scale_cheaper(n, Quantize(8), 32, LINK)


def test_plan_picks_the_cheapest():
    slow = Link.gbit(1)
    p = plan(32 << 20, 2, slow)
    assert p.compressor is not None and p.seconds == min(s for _, _, s in p.candidates)
    assert [name for name, _, _ in p.candidates][-1] == "none"  # uncompressed is slowest at 1 Gbit/s
    # a tiny buffer on a high-latency link: latency dominates, one-step algorithms win
    p = plan(64, 8, Link(latency=1e-3, bandwidth=1e10), compressors=(None,))
    assert p.algorithm == "tree"
    # a large buffer: bandwidth dominates, ring and Rabenseifner (same bytes) beat recursive doubling
    p = plan(1 << 30, 8, Link(latency=1e-6, bandwidth=1e9), compressors=(None,))
    assert p.algorithm in ("ring", "rabenseifner")
    # two nodes with a fast intra link: hierarchical
    topo = Topology(world_size=8, local_size=4, intra=Link(latency=1e-6, bandwidth=1e11))
    assert plan(1 << 28, topo, Link.gbit(10), compressors=(None,)).algorithm == "hierarchical"
    # with compute cost on a slow device, compression stops paying on a fast link
    p = plan(32 << 20, 2, Link.gbit(400), compute_bandwidth=5e9, compressors=(None, TopK(0.01)))
    assert p.compressor is None


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
        plan(-1, 2, LINK)
    with pytest.raises(ArgumentTypeError):
        plan(10, 2, 1e9)


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


def test_probe_topology_measures_both_levels():
    res = run_local(_probe_worker, 4, 2, op_timeout=30)
    topo, inter = res[0][1], res[0][2]
    assert topo.world_size == 4 and topo.local_size == 2 and topo.intra is not None and inter is not None
    assert all(r[1] == topo and r[2] == inter for r in res)
