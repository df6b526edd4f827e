"""Coalescer on real processes (gloo over loopback), world sizes 2 and 3: the results of coalesced
all-reduces against the single-process reference, and what goes on the wire (the wrapped
communicator's calls, in order)."""

from __future__ import annotations

import pytest
import torch

from torsh_kernels.collectives import Coalescer, TorchCommunicator, run_local
from torsh_kernels.errors import CollectiveError, ShapeError


def data(case: int, rank: int, n: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(case * 7919 + rank)
    if dtype.is_floating_point:
        return torch.randn(n, generator=g, dtype=torch.float64).to(dtype)
    return torch.randint(-50, 50, (n,), generator=g, dtype=dtype)


class _Recording:
    """A real communicator that also records which collectives it was asked for (name, numel, dtype)."""

    def __init__(self, comm: TorchCommunicator) -> None:
        self.inner = comm
        self.calls: list[tuple] = []

    def __getattr__(self, name):
        attr = getattr(self.inner, name)
        if name in ("all_reduce", "all_gather", "broadcast", "barrier"):

            def rec(*a, **kw):
                t = a[0] if name != "all_gather" else a[1]
                self.calls.append((name, t.numel(), t.dtype) if isinstance(t, torch.Tensor) else (name,))
                return attr(*a, **kw)

            return rec
        return attr


def _reference(case: int, ws: int, n: int, dtype, op: str) -> torch.Tensor:
    st = torch.stack([data(case, r, n, dtype) for r in range(ws)])
    if op == "sum":
        return st.sum(0)
    if op == "max":
        return st.amax(0)
    return st.double().mean(0).to(dtype)


def _worker(comm: TorchCommunicator) -> dict:
    ws, me = comm.world_size, comm.rank
    rec = _Recording(comm)
    c = Coalescer(rec)
    out: dict = {}

    # 1. mixed dtypes and ops, odd sizes: one collective per (dtype, op), in order of first appearance
    cases = [(1, 7, torch.float32, "sum"), (2, 1, torch.float64, "sum"), (3, 1001, torch.float32, "sum"),
             (4, 33, torch.int32, "sum"), (5, 5, torch.float32, "avg"), (6, 9, torch.float32, "max"),
             (7, 2, torch.float32, "sum")]  # fmt: skip
    xs = [data(case, me, n, dt) for case, n, dt, _ in cases]
    with c.batch():
        hs = [c.all_reduce(x, op, async_op=True) for x, (_, _, _, op) in zip(xs, cases)]
        out["completed_inside"] = any(h.is_completed() for h in hs)
        out["calls_inside"] = len(rec.calls)
    for h in hs:
        h.wait()
    for x, (case, n, dt, op) in zip(xs, cases):
        ref = _reference(case, ws, n, dt, op)
        if dt.is_floating_point:
            torch.testing.assert_close(x, ref, rtol=1e-6, atol=1e-6)
        else:
            assert torch.equal(x, ref)
    out["calls_1"] = rec.calls
    rec.calls = []

    # 2. a wait inside the batch sends what is recorded; what follows forms a new group
    a, b, d = data(10, me, 11), data(11, me, 3), data(12, me, 4)
    with c.batch():
        ha, hb = c.all_reduce(a, async_op=True), c.all_reduce(b, async_op=True)
        ha.wait()
        torch.testing.assert_close(a, _reference(10, ws, 11, torch.float32, "sum"))
        hd = c.all_reduce(d, async_op=True)
    hb.wait()
    hd.wait()
    torch.testing.assert_close(b, _reference(11, ws, 3, torch.float32, "sum"))
    torch.testing.assert_close(d, _reference(12, ws, 4, torch.float32, "sum"))
    out["calls_2"] = rec.calls
    rec.calls = []

    # 3. another collective, a synchronous all-reduce, and a tensor already in the batch go out after it
    e, f, g = data(20, me, 6), data(21, me, 5), data(22, me, 8)
    gathered = torch.empty(ws * 5)
    with c.batch():
        he = c.all_reduce(e, async_op=True)
        c.all_gather(gathered, f)
        hg = c.all_reduce(g, async_op=True)
        c.all_reduce(e.new_ones(3))  # synchronous
        hg.wait()
        hg2 = c.all_reduce(g, async_op=True)  # g again: sums the first's result
    he.wait()
    hg2.wait()
    u = data(23, me, 2)
    with c.batch():  # u twice without a wait between (outside the contract): the batch goes out first
        hus = [c.all_reduce(u, async_op=True), c.all_reduce(u, async_op=True)]
    for hu in hus:
        hu.wait()
    torch.testing.assert_close(e, _reference(20, ws, 6, torch.float32, "sum"))
    torch.testing.assert_close(gathered, torch.cat([data(21, r, 5) for r in range(ws)]))
    torch.testing.assert_close(g, ws * _reference(22, ws, 8, torch.float32, "sum"))
    out["calls_3"] = rec.calls
    rec.calls = []

    # 4. an error inside the block: what was recorded is not sent (a rank that failed part-way would send a
    # part of the batch, of another size than its peers' all-reduce); its handle says so, typed
    h = data(30, me, 7)
    before = h.clone()
    try:
        with c.batch():
            hh = c.all_reduce(h, async_op=True)
            raise ValueError("boom")
    except ValueError:
        pass
    for call in (hh.wait, lambda: hh.future().wait()):
        try:
            call()
            out.setdefault("abandoned", []).append(None)
        except CollectiveError as e:
            out.setdefault("abandoned", []).append("was not sent" in str(e))
    assert torch.equal(h, before)
    out["calls_4"] = rec.calls
    rec.calls = []

    # 5. a non-contiguous tensor is the transport's to reject, after the batch went out
    k, bad = data(31, me, 4), torch.zeros(4, 2).t()
    err = None
    with c.batch():
        hk = c.all_reduce(k, async_op=True)
        try:
            c.all_reduce(bad, async_op=True)
        except ShapeError as ex:
            err = type(ex).__name__
        out["calls_5"] = list(rec.calls)  # k sent, then the transport asked for the bad one
    hk.wait()
    out["error"] = err
    torch.testing.assert_close(k, _reference(31, ws, 4, torch.float32, "sum"))
    rec.calls = []

    # 6. future(): sends the batch; completes once the result is in the tensor (a communicator without a
    # wait timeout: only such a one offers futures, as the DDP hook's does)
    rec6 = _Recording(TorchCommunicator(comm.group))
    c6 = Coalescer(rec6)
    m, p = data(40, me, 9), data(41, me, 2)
    with c6.batch():
        hm = c6.all_reduce(m, async_op=True)
        hp = c6.all_reduce(p, async_op=True)
        fut = hm.future()
    fut.wait()
    hp.wait()
    torch.testing.assert_close(m, _reference(40, ws, 9, torch.float32, "sum"))
    torch.testing.assert_close(p, _reference(41, ws, 2, torch.float32, "sum"))
    out["calls_6"] = rec6.calls
    # ... and with a timeout, no future (the caller waits instead)
    with c.batch():
        hm = c.all_reduce(m, async_op=True)
        hp = c.all_reduce(p, async_op=True)
        out["future_with_timeout"] = hm.future()
    hm.wait()
    hp.wait()
    out["calls_6t"] = rec.calls
    rec.calls = []

    # 7. outside a batch and in a nested one: unchanged calls; the inner block joins the outer
    q, r_ = data(50, me, 3), data(51, me, 3)
    hq = c.all_reduce(q, async_op=True)
    out["outside_is_inner_handle"] = type(hq).__name__ == "TorchHandle"
    hq.wait()
    with c.batch():
        with c.batch():
            hr = c.all_reduce(r_, async_op=True)
        out["nested_sent_early"] = len(rec.calls) > 1
        hq2 = c.all_reduce(q, async_op=True)
    hr.wait()
    hq2.wait()
    torch.testing.assert_close(r_, _reference(51, ws, 3, torch.float32, "sum"))
    torch.testing.assert_close(q, ws * _reference(50, ws, 3, torch.float32, "sum"))
    out["calls_7"] = rec.calls
    out["forwards"] = (c.rank, c.world_size, c.backend) == (me, ws, comm.backend) and c.group is comm.group
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_coalesced_all_reduces_match_the_reference_and_go_out_together(world_size):
    res = run_local(_worker, world_size, op_timeout=60)
    f32, f64, i32 = torch.float32, torch.float64, torch.int32
    for out in res:
        assert out["completed_inside"] is False and out["calls_inside"] == 0
        # one per (dtype, op) group in order of first appearance: fp32 sum (7 + 1001 + 2), fp64, int32,
        # fp32 avg, fp32 max
        assert out["calls_1"] == [("all_reduce", 1010, f32), ("all_reduce", 1, f64), ("all_reduce", 33, i32),
                                  ("all_reduce", 5, f32), ("all_reduce", 9, f32)]  # fmt: skip
        assert out["calls_2"] == [("all_reduce", 14, f32), ("all_reduce", 4, f32)]
        assert out["calls_3"] == [("all_reduce", 6, f32), ("all_gather", 5, f32), ("all_reduce", 8, f32),
                                  ("all_reduce", 3, f32), ("all_reduce", 8, f32), ("all_reduce", 2, f32),
                                  ("all_reduce", 2, f32)]  # fmt: skip
        assert out["calls_4"] == [] and out["abandoned"] == [True, True]
        assert out["error"] == "ShapeError" and out["calls_5"] == [("all_reduce", 4, f32), ("all_reduce", 8, f32)]
        assert out["calls_6"] == out["calls_6t"] == [("all_reduce", 11, f32)]
        assert out["future_with_timeout"] is None
        assert out["outside_is_inner_handle"] and not out["nested_sent_early"]
        assert out["calls_7"] == [("all_reduce", 3, f32), ("all_reduce", 6, f32)]
        assert out["forwards"]
