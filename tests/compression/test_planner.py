"""The planner: compressed all-reduce times from each compressor's schemes, and the cheapest choice."""

from __future__ import annotations

import pytest

from torsh_kernels.collectives import Link, Topology, all_gather_time, all_reduce_time
from torsh_kernels.compression import DEFAULT_CANDIDATES, FP16, PowerSGD, Quantize, Sign, TopK, compressed_time, plan
from torsh_kernels.errors import ArgumentTypeError, InvalidArgumentError

A, BW = 10e-6, 1e9  # 10 us, 1 GB/s
LINK = Link(latency=A, bandwidth=BW)


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


def test_quantize_is_priced_by_its_cheaper_scheme():
    n = 10_000_000
    for ws in (2, 16):
        algo, t = compressed_time(Quantize(4), n, ws, LINK)
        gather = all_gather_time(Quantize(4).payload_nbytes(n), ws, LINK)
        assert t <= gather * (1 + 1e-12)
        assert algo == ("all_gather" if ws == 2 else "shared_scale_all_reduce")


def test_argument_errors():
    with pytest.raises(InvalidArgumentError):
        plan(-1, 2, LINK)
    with pytest.raises(ArgumentTypeError):
        plan(10, 2, 1e9)
    with pytest.raises(InvalidArgumentError, match="ratio"):  # a name: top-k's needs its ratio
        plan(10, 2, LINK, compressors=("topk",))
    with pytest.raises(ArgumentTypeError):
        plan(10, 2, LINK, compressors=(3,))


def test_plan_picks_the_cheapest():
    slow = Link.gbit(1)
    p = plan(32 << 20, 2, slow)
    # each default candidate priced on its own: the plan is the cheapest of them, and says so
    priced = {"none" if c is None else c.label(): compressed_time(c, ((32 << 20) // 4,), 2, slow)[1]
              for c in DEFAULT_CANDIDATES}  # fmt: skip
    cheapest = min(priced, key=priced.__getitem__)
    assert cheapest != "none" and p.compressor.label() == cheapest and p.seconds == priced[cheapest]
    assert [name for name, _, _ in p.candidates] == sorted(priced, key=priced.__getitem__)
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


def test_measured_compute_decides_where_the_link_is_fast():
    from torsh_kernels.compression import measure_compute

    cands = (None, FP16(), TopK(0.01))
    cs = measure_compute((64, 48), 2, compressors=cands, repeats=1)
    assert set(cs) == {"none", "fp16", "topk:0.01"} and all(s > 0 for s in cs.values())
    # a fixed, known compute cost: compression wins on a slow link and loses on a fast one
    known = {"none": 0.0, "fp16": 1e-3, "topk:0.01": 2e-3}
    # at 0.1 Gbit/s the 64 MiB wire time (seconds) dwarfs the ms of compute: the fewest bytes win, top-k 1%
    p = plan(64 << 20, 2, Link.gbit(0.1), compressors=cands, compute_seconds=known)
    wire = {n: s for n, _, s in plan(64 << 20, 2, Link.gbit(0.1), compressors=cands).candidates}
    assert p.compressor.label() == min(known, key=lambda n: wire[n] + known[n]) == "topk:0.01"
    assert plan(64 << 20, 2, Link.gbit(1000), compressors=cands, compute_seconds=known).compressor is None
    # the measured seconds are added to the wire time, exactly
    p = plan(1 << 20, 2, LINK, compressors=cands, compute_seconds=known)
    wire = {n: s for n, _, s in plan(1 << 20, 2, LINK, compressors=cands).candidates}
    assert {n: s for n, _, s in p.candidates} == pytest.approx({n: wire[n] + known[n] for n in known})
    with pytest.raises(InvalidArgumentError, match="no entry for 'fp16'"):
        plan(1 << 20, 2, LINK, compressors=cands, compute_seconds={"none": 0.0})
    with pytest.raises(InvalidArgumentError):
        plan(1 << 20, 2, LINK, compressors=cands, compute_seconds={**known, "fp16": float("nan")})
    with pytest.raises(InvalidArgumentError):
        measure_compute(10, 2, repeats=0)
