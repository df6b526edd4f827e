"""`torsh bench compression`'s top-k peers and like-for-like pairing: the DGC-style sampled-threshold top-k in
plain torch (the same algorithm as torsh's approximate mode) selects the exact top-k and updates the residual
as torsh does, a wrong peer is refused before timing, a row's speedup is over the peers it names, and the
suite's JSON records which peer each row is compared with."""

from __future__ import annotations

import json

import pytest
import torch

from torsh_kernels.apps.bench import Case, Result, Timing, finish
from torsh_kernels.apps.bench import compression as bench
from torsh_kernels.apps.bench import compression_peers as peers
from torsh_kernels.apps.cli import main
from torsh_kernels.errors import InvalidArgumentError
from torsh_kernels.ops import topk_compress, topk_count
from torsh_kernels.ops.topk.api import _sample_stride

N = 1 << 19  # 524,288 elements: a strided sample (stride 5 at 1%), so the sampled path runs, not the exact one
RATIO = 0.01


def _exact(acc: torch.Tensor, k: int) -> set[int]:
    return set(torch.topk(acc.abs(), k, sorted=False).indices.tolist())


@pytest.mark.parametrize("with_residual", [False, True])
def test_the_dgc_style_peer_selects_the_exact_top_k_and_updates_the_residual(with_residual):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, generator=g)
    k = topk_count(N, RATIO)
    peer = peers.DgcTopk(N, k)
    assert peer.stride == _sample_stride(N, k) > 1 and peer.cap == k + (k + 3) // 4
    r = 0.3 * torch.randn(N, generator=g) if with_residual else None
    acc = x + r if r is not None else x.clone()
    vals, idx = peer(x, r) if r is not None else peer(x)
    assert idx.numel() == k and set(idx.tolist()) == _exact(acc, k)
    assert torch.equal(vals, acc[idx])
    if r is not None:  # r = x + r, zero where sent
        expect = acc.clone()
        expect[idx] = 0
        assert torch.equal(r, expect)
    assert (peer.calls, peer.rounds, peer.fallbacks) == (1, 1, 0)  # random data: in the band at once


def test_the_dgc_style_peer_selects_what_torsh_approximate_mode_selects():
    x = torch.randn(N, generator=torch.Generator().manual_seed(1))
    k = topk_count(N, RATIO)
    r_ours, r_peer = torch.zeros(N), torch.zeros(N)
    for _ in range(3):  # with error feedback over a few steps: the residuals stay equal
        _, i = topk_compress(x, ratio=RATIO, residual=r_ours, exact=False, provider="torch")
        _, pi = peers.DgcTopk(N, k)(x, r_peer)
        assert set(i.tolist()) == set(pi.tolist())
        assert torch.equal(r_ours, r_peer)


def test_an_unrepresentative_sample_is_re_aimed_or_falls_back_and_stays_exact():
    k = topk_count(N, RATIO)
    peer = peers.DgcTopk(N, k)
    x = torch.randn(N, generator=torch.Generator().manual_seed(2)) * 1e-3
    x[1 :: peer.stride][: 3 * k] = 10.0 + torch.arange(3 * k, dtype=torch.float32)  # large, and never sampled
    _, idx = peer(x)
    assert set(idx.tolist()) == _exact(x, k)
    assert peer.rounds > 1 or peer.fallbacks == 1


def test_a_wrong_top_k_peer_is_refused_before_timing_and_a_right_one_has_recall_one():
    x = torch.randn(N, generator=torch.Generator().manual_seed(3))
    k = topk_count(N, RATIO)
    assert peers.check_topk_peer(peers.DgcTopk(N, k), x, k, True) == 1.0
    assert peers.check_topk_peer(lambda x, r: peers.peer_topk_ef(x, r, k), x, k, True) == 1.0

    def first_k(x, r=None):
        idx = torch.arange(k)
        return x[idx], idx

    with pytest.raises(AssertionError, match="not the exact top-k"):
        peers.check_topk_peer(first_k, x, k, False)

    def forgets_the_residual(x, r):
        idx = torch.topk((x + r).abs(), k).indices
        return (x + r)[idx], idx

    with pytest.raises(AssertionError, match="residual"):
        peers.check_topk_peer(forgets_the_residual, x, k, True)


def _row(impl: str, kind: str, ms: float, peers: list[str] | None = None) -> Result:
    t = Timing(median_ms=ms, p20_ms=ms, p80_ms=ms, reps=1)
    return Result(case="c", op="top-k", impl=impl, kind=kind, bytes_moved=1, timing=t, peers=peers)


def test_a_row_naming_its_like_for_like_peer_is_compared_with_it_not_with_the_fastest():
    rows = [_row("copy", "copy", 1.0), _row("approx", "ours", 2.0, ["same algorithm"]), _row("exact", "ours", 8.0),
            _row("same algorithm", "peer", 4.0), _row("other algorithm", "peer", 20.0),
            _row("fastest other", "peer", 1.0)]  # fmt: skip
    finish(rows)
    approx, exact = rows[1], rows[2]
    assert approx.best_peer == "same algorithm" and approx.speedup_vs_best_peer == 2.0
    assert approx.speedups == {"same algorithm": 2.0, "other algorithm": 10.0, "fastest other": 0.5}
    assert exact.peers is None and exact.best_peer == "fastest other" and exact.speedup_vs_best_peer == 1.0 / 8.0
    assert rows[3].speedups == {} and rows[3].best_peer is None


def test_a_named_peer_must_exist_in_its_op_and_only_rows_of_ours_name_peers():
    case = Case("c", torch.device("cpu"))
    case.add("copy", "copy", "copy", lambda: None, 1)
    case.add("op", "ours", "ours", lambda: None, 1, peers=["nobody"])
    case.add("op", "somebody", "peer", lambda: None, 1)
    with pytest.raises(ValueError, match="no peer 'nobody'"):
        case.time(1)
    with pytest.raises(ValueError, match="only a row of ours"):
        case.add("op", "p", "peer", lambda: None, 1, peers=["somebody"])


@pytest.mark.slow  # the whole suite at a tiny size (compiles the cpu kernels on a first run)
def test_the_suite_runs_and_its_json_names_each_rows_like_for_like_peer(tmp_path, capsys):
    out = tmp_path / "compression.json"
    assert main(["bench", "compression", "--device", "cpu", "--providers", "cpu", "--sizes", "1", "--ortho-batch",
                 "2", "--ortho-rows", "64", "--reps", "1", "--json", str(out)]) == 0  # fmt: skip
    text = capsys.readouterr().out
    for needle in ("over (like for like)", "DGC-style sampled threshold in plain torch", "different algorithm",
                   "speedup (peer's time / ours"):  # fmt: skip
        assert needle in text, needle
    doc = json.loads(out.read_text())
    assert doc["config"]["torch_threads"] >= 1
    rows = {(r["case"], r["op"], r["impl"]): r for r in doc["results"]}
    buf = next(c for c, _, _ in rows if c.startswith("1 MiB"))
    for op, exact_peer in (("top-k 1% + error feedback", bench.TOPK_EXACT_EF), ("top-k 1%", bench.TOPK_EXACT)):
        dgc = [i for c, o, i in rows if (c, o) == (buf, op) and i.startswith("DGC-style")]
        assert len(dgc) == 1 and "[::2] sample" in dgc[0]  # 1 MiB: 262,144 elements, a sample of half
        assert rows[buf, op, dgc[0]]["extra"]["fallbacks"] == 0 and rows[buf, op, dgc[0]]["extra"]["calls"] > 0
        approx = rows[buf, op, "torsh[cpu] approx"]
        assert approx["peers"] == dgc and approx["best_peer"] == dgc[0]
        assert approx["speedup_vs_best_peer"] == approx["speedups"][dgc[0]]
        assert set(approx["speedups"]) == {dgc[0], exact_peer}
        assert "recall of the exact top-k 1.0000" in approx["extra"]["note"]
    exact = rows[buf, "top-k 1% + error feedback", "torsh[cpu] exact"]
    assert exact["peers"] == [bench.TOPK_EXACT_EF] and exact["best_peer"] == bench.TOPK_EXACT_EF
    ortho = [r for r in doc["results"] if r["op"] == "orthogonalize" and r["kind"] == "ours"]
    assert ortho
    for r in ortho:  # each of the orthogonalization's three peers, by name
        loop = [i for c, o, i in rows if c == r["case"] and o == "orthogonalize" and "gram_schmidt" in i]
        assert set(r["speedups"]) == {bench.QR_LABEL, bench.HOOK_LABEL, peers.CHOLQR2_LABEL, *loop} and len(loop) == 1


@pytest.mark.parametrize("r", [1, 2, 5, 16])
def test_the_cholesky_qr2_peer_is_torsh_s_algorithm_in_plain_torch(r):
    """The same-algorithm peer of orthogonalize gives torsh's Q (unique: R's diagonal positive), also where a
    matrix is ill-conditioned enough to need the second iteration, and refuses dependent columns."""
    from torsh_kernels.ops import orthogonalize

    g = torch.Generator().manual_seed(r)
    p = torch.randn(5, 257, r, generator=g)
    if r > 1:  # one matrix with two nearly parallel columns (condition ~1e3): its first iteration is not enough
        p[2, :, -1] = p[2, :, 0] + 1e-3 * p[2, :, -1]
    got, want = p.clone(), p.clone()
    peers.peer_cholesky_qr2(got)
    orthogonalize(want)
    assert (got - want).abs().max().item() < 1e-5
    assert (got.mT @ got - torch.eye(r)).abs().max().item() < 1e-5
    if r > 1:
        dep = p.clone()
        dep[0, :, 1] = dep[0, :, 0]
        with pytest.raises(InvalidArgumentError, match="not positive definite"):
            peers.peer_cholesky_qr2(dep)
