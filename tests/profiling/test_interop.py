"""torch.profiler and HolisticTraceAnalysis interop: torsh's spans as record_function ranges in Kineto
traces (with and without a torsh recorder, in one process and in a real 2-rank PowerSGD job), their
classification there, and HTA reading a 2-rank torsh trace written by the recorder in 2 gloo processes."""

from __future__ import annotations

import json

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile, schedule

import torsh_kernels as tk
from tests.helpers import MLP
from torsh_kernels import recording
from torsh_kernels.collectives import run_local
from torsh_kernels.compression import PowerSGD
from torsh_kernels.parallel import CompressionHookState, compression_hook
from torsh_kernels.profiling import timeline
from torsh_kernels.profiling.report import build
from torsh_kernels.profiling.traces import load, validate


def _annotations(data: dict) -> dict[str, int]:
    out: dict[str, int] = {}
    for e in data["traceEvents"]:
        if e.get("ph") == "X" and e.get("cat") == "user_annotation":
            out[e["name"]] = out.get(e["name"], 0) + 1
    return out


def _work() -> None:
    tk.flatten([torch.randn(5, 3), torch.randn(7)], provider="torch")
    with timeline.record("mine"), recording.span("issue all_reduce", "issue"):
        torch.randn(4).sum()


def test_torch_profiler_alone_records_torsh_spans(tmp_path):
    import torch.autograd.profiler as tap

    assert tap._run_on_profiler_start._torsh and tap._run_on_profiler_stop._torsh  # hooked at import
    assert recording.recorder is None
    with profile(activities=[ProfilerActivity.CPU]) as p:
        assert isinstance(recording.recorder, recording.Bridge) and timeline.current() is None
        with timeline.step(3):
            _work()
    assert recording.recorder is None  # nothing in the slot once the profiler stops: no cost outside profiling
    _work()  # and nothing breaks without it
    f = tmp_path / "rank0.pt.trace.json"
    p.export_chrome_trace(str(f))
    data = json.loads(f.read_text())
    names = _annotations(data)
    assert {"flatten", "mine", "issue all_reduce", "step 3"} <= set(names) and names["flatten"] == 1
    assert data["torsh"] == {"schema": "torsh-kineto/1",
                             "categories": {"flatten": "op", "mine": "user", "issue all_reduce": "issue"}}  # fmt: skip
    cls = {s.name: s.cls for s in load(f).spans}
    assert (cls["flatten"], cls["mine"], cls["issue all_reduce"], cls["step 3"]) == (
        "memory", "compute", "communication", "step")  # fmt: skip
    assert cls["aten::sum"] == "communication"  # plain compute nested in torsh's issuing span


def test_torch_profiler_with_a_recorder(tmp_path):
    with profile(activities=[ProfilerActivity.CPU]) as p:
        rec = timeline.Recorder(rank=0, world_size=1).start()  # the bridge steps aside for the recorder
        assert recording.recorder is rec
        _work()
        rec.stop()  # the profiler still records: the bridge comes back
        assert isinstance(recording.recorder, recording.Bridge)
        with timeline.record("after stop"):
            pass
    assert recording.recorder is None
    f = tmp_path / "k.json"
    p.export_chrome_trace(str(f))
    names = _annotations(json.loads(f.read_text()))
    assert {"flatten", "mine", "issue all_reduce", "after stop"} <= set(names)
    own = {e["name"] for e in rec.trace()["traceEvents"] if e["ph"] == "X"}
    assert own == {"flatten", "mine", "issue all_reduce"}  # the recorder's own trace is unchanged
    # a recorder's spans open no range while no profiler records
    with timeline.Recorder(rank=0, world_size=1):
        sp = timeline.record("x")
        with sp:
            assert sp.rf is None


def test_every_profiler_cycle_carries_the_categories(tmp_path):
    """With a schedule, each cycle is a new profiler session: its trace gets the categories again."""
    out = []

    def ready(p) -> None:
        f = tmp_path / f"cycle{len(out)}.json"
        p.export_chrome_trace(str(f))
        out.append(json.loads(f.read_text()))

    with profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=1, warmup=0, active=1, repeat=2),
                 on_trace_ready=ready) as p:  # fmt: skip
        for _ in range(4):
            _work()
            assert isinstance(recording.recorder, recording.Bridge) == torch.autograd.profiler._is_profiler_enabled
            p.step()
    assert len(out) == 2
    for data in out:
        assert data["torsh"]["categories"]["mine"] == "user" and _annotations(data)["mine"] == 1


# -- the case: a Kineto trace of a 2-rank job that compresses with torsh's PowerSGD ------------------


def _powersgd_profiled(comm, d: str) -> None:
    net = MLP(32, 128, 128, 10, seed=0)
    ddp = DDP(net, bucket_cap_mb=0.05)
    ddp.register_comm_hook(CompressionHookState(compressor=PowerSGD(4), start_iter=0, min_numel=16),
                           compression_hook)  # fmt: skip
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(comm.rank)

    def ready(p) -> None:
        p.export_chrome_trace(f"{d}/rank{comm.rank}.pt.trace.json")

    with profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=0, warmup=1, active=3),
                 on_trace_ready=ready) as prof:  # fmt: skip
        for _ in range(4):
            opt.zero_grad()
            ddp(torch.randn(16, 32, generator=g)).sum().backward()
            opt.step()
            prof.step()
    assert recording.recorder is None


def test_kineto_trace_of_a_powersgd_job(tmp_path):
    d = tmp_path / "k"
    d.mkdir()
    run_local(_powersgd_profiled, 2, str(d), timeout=240)
    tr = load(d)
    assert list(tr.ranks) == [0, 1] and all(m["source"] == "kineto" and m["torsh_spans"] for m in tr.ranks.values())
    cls = {}
    for s in tr.spans:
        cls.setdefault(s.name, set()).add(s.cls)
    assert cls["PowerSGD round 1"] == {"compression"} and cls["orthogonalize"] == {"compression"}
    assert cls["flatten"] == {"memory"} and cls["wait"] == {"wait"}
    rep = build(tr)
    for r in rep["ranks"]:
        assert r["steps"] == 3 and r["compression_ms"] > 0 and r["measured_on"] == "host"
    assert rep["summary"]["compression_share"] > 0.01
    assert rep["facts"]["compressors"] == ["PowerSGD"] and rep["facts"]["comm_during_backward"]
    text = " ".join(g["message"] for g in rep["suggestions"])
    assert "compression_hook" not in text and "stall" not in text


# -- HolisticTraceAnalysis on torsh's own traces -------------------------------------------------------------


def _recorded(comm, d: str) -> None:
    net = MLP(24, 64, 10, seed=0)
    ddp = DDP(net)
    ddp.register_comm_hook(CompressionHookState(compressor=PowerSGD(2), start_iter=0, min_numel=16),
                           compression_hook)  # fmt: skip
    g = torch.Generator().manual_seed(comm.rank)
    with timeline.Recorder(d, model=ddp):
        for i in range(3):
            with timeline.step(i):
                ddp(torch.randn(8, 24, generator=g)).sum().backward()


def test_hta_finds_both_ranks_of_a_torsh_trace(tmp_path):
    TraceAnalysis = pytest.importorskip("hta.trace_analysis").TraceAnalysis
    d = tmp_path / "tr"
    run_local(_recorded, 2, str(d), timeout=240)
    counts = {}
    for r in (0, 1):
        f = d / f"rank{r}.json"
        text = f.read_text()
        assert text.startswith(f'{{"distributedInfo": {{"backend": "gloo", "rank": {r}, "world_size": 2, ')
        data = json.loads(text)
        assert validate(data, f) == "torsh"
        di = data["distributedInfo"]
        assert di["pg_count"] >= 1 and di["pg_config"][0]["ranks"] == [0, 1]  # as Kineto writes them
        counts[r] = sum(1 for e in data["traceEvents"] if e["ph"] == "X")
    assert load(d).ranks[1]["backend"] == "gloo"
    ta = TraceAnalysis(trace_dir=str(d))
    assert sorted(ta.t.traces) == [0, 1]
    for r, df in ta.t.traces.items():
        names = set(ta.t.symbol_table.sym_table[i] for i in df["name"].unique())
        assert {"forward", "backward", "PowerSGD round 1", "step 0"} <= names
        assert len(df) == counts[r]
    # without distributedInfo (the files torsh wrote before) HTA takes every file for rank 0
    old = tmp_path / "old"
    old.mkdir()
    for r in (0, 1):
        data = json.loads((d / f"rank{r}.json").read_text())
        del data["distributedInfo"]
        (old / f"rank{r}.json").write_text(json.dumps(data, separators=(",", ":")))
    assert sorted(TraceAnalysis(trace_dir=str(old)).t.traces) == [0]


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "error-feedback"])
def test_topk_on_the_cpu_kernel_shows_in_a_kineto_trace(tmp_path, residual):
    # the cpu provider's exact selection (the small case: every element is its own sample) ran its kernel
    # straight from the arguments, so a trace of a TopK job showed its flatten and not its top-k
    from torsh_kernels.compression import TopK, roundtrip

    x = torch.randn(3001)
    with profile(activities=[ProfilerActivity.CPU]) as p:
        tk.topk_compress(x, ratio=0.01, residual=torch.zeros(3001) if residual else None, provider="cpu")
        tk.topk_compress(x, ratio=0.01, residual=torch.zeros(3001) if residual else None)  # the default: cpu
        roundtrip(TopK(0.01), x, TopK(0.01).new_state())  # the compressor (with its residual)
    f = tmp_path / "rank0.pt.trace.json"
    p.export_chrome_trace(str(f))
    names = _annotations(json.loads(f.read_text()))
    assert names.get("topk_compress") == 3, names
    assert {s.name: s.cls for s in load(f).spans}["topk_compress"] == "compression"
