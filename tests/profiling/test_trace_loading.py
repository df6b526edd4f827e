"""Loading traces: real torch.profiler (Kineto) traces of a DDP training step, plain and gzip; and
malformed, truncated or foreign files, each with an error naming the problem."""

from __future__ import annotations

import gzip
import json

import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from torsh_kernels.apps.cli import main as cli
from torsh_kernels.collectives import run_local
from torsh_kernels.errors import TraceFormatError
from torsh_kernels.profiling import analysis as A
from torsh_kernels.profiling.report import build
from torsh_kernels.profiling.traces import load, read_json


def _profiled_worker(comm, d: str) -> None:
    from torch.profiler import ProfilerActivity, profile, schedule

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 10))
    ddp = DDP(net, bucket_cap_mb=0.01)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    suffix = ".pt.trace.json" if comm.rank == 0 else ".pt.trace.json.gz"

    def ready(p) -> None:
        p.export_chrome_trace(f"{d}/rank{comm.rank}{suffix}")

    with profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=0, warmup=1, active=3),
                 on_trace_ready=ready) as prof:  # fmt: skip
        for _ in range(4):
            opt.zero_grad()
            ddp(torch.randn(16, 32)).sum().backward()
            opt.step()
            prof.step()


@pytest.fixture(scope="module")
def kineto_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("kineto")
    run_local(_profiled_worker, 2, str(d), timeout=240)
    return d


def test_torch_profiler_traces_load(kineto_dir):
    files = sorted(p.name for p in kineto_dir.iterdir())
    assert files == ["rank0.pt.trace.json", "rank1.pt.trace.json.gz"]
    assert (kineto_dir / files[1]).read_bytes()[:2] == b"\x1f\x8b"  # really gzip
    tr = load(kineto_dir)
    assert list(tr.ranks) == [0, 1] and {m["source"] for m in tr.ranks.values()} == {"kineto"}
    assert all(m["world_size"] == 2 for m in tr.ranks.values())
    steps = tr.steps(0)
    assert len(steps) == 3 and all(s.name.startswith("ProfilerStep#") for s in steps)
    comm = [s for s in tr.spans if s.cls == "communication"]
    assert any(s.name.startswith("gloo:all_reduce") for s in comm) and {s.rank for s in comm} == {0, 1}
    assert any(s.cls == "compute" and s.name.startswith("aten::") for s in tr.spans)
    for r in (0, 1):
        b = A.breakdown(tr, r, A.windows(tr, r))
        assert b.steps == 3 and b.window_ms > 0 and 0 < b.comm_share <= 1 and b.compute_ms > 0
        parts = b.compute_ms + b.compression_ms + b.memory_ms + b.communication_ms + b.unrecorded_ms
        assert parts == pytest.approx(b.window_ms, rel=1e-9)
    rep = build(tr)
    assert rep["summary"]["steps_per_rank"] == 3 and len(rep["stragglers"]) == 2


def test_torch_profiler_trace_in_the_viewer(kineto_dir, capsys):
    n = sorted(A.step_number(s) for s in load(kineto_dir).steps(0))[1]
    assert cli(["timeline", str(kineto_dir), "--width", "140", "--step", str(n)]) == 0
    out = capsys.readouterr().out
    assert "2 rank(s) (kineto)" in out and f"step {n}" in out
    assert "pt_gloo" in out or "gloo" in out  # the gloo threads' lanes
    assert "gloo:all_reduce" in out and "per-rank totals over its steps" in out
    # one file alone, gzip
    assert cli(["timeline", str(kineto_dir / "rank1.pt.trace.json.gz"), "--width", "120", "--top", "3"]) == 0
    assert "1 rank(s) (kineto)" in capsys.readouterr().out


def _good() -> dict:
    return {"traceEvents": [{"ph": "X", "name": "a", "cat": "cpu_op", "ts": 1.0, "dur": 2.0, "pid": 1, "tid": 1}]}


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "the file is empty"),
        (b"not json at all", "invalid JSON at line 1, column 1"),
        (json.dumps(_good()).encode()[:-9], "the file ends early: truncated"),
        (b'{"foo": 1}', "no 'traceEvents' list"),
        (b"42", "expected a JSON object"),
        (b'{"traceEvents": [{"name": "a", "ts": 1, "dur": 1, "pid": 1, "tid": 1}]}', "has no 'ph'"),
        (b'{"traceEvents": [{"ph": "X", "name": "a", "ts": "1", "dur": 1, "pid": 1, "tid": 1}]}',
         "ts='1'; expected a number of microseconds"),
        (b'{"traceEvents": [{"ph": "X", "name": "a", "ts": 1, "dur": -3, "pid": 1, "tid": 1}]}', "negative duration"),
        (b'{"traceEvents": [{"ph": "X", "name": "a", "ts": 1, "dur": 3, "tid": 1}]}', "has no 'pid'"),
        (b'{"traceEvents": [{"ph": "X", "ts": 1, "dur": 3, "pid": 1, "tid": 1}]}', "no string 'name'"),
        (b'{"traceEvents": ["x"]}', "event 0 is a str"),
        (b'{"traceEvents": [{"ph": "M", "name": "thread_name", "pid": 1, "tid": 1, "args": {"name": "t"}}]}',
         "no complete events"),
        (b'{"traceEvents": "\xc3\x28"}', "not UTF-8 JSON"),
    ],
)  # fmt: skip
def test_malformed_traces(tmp_path, content, message, capsys):
    f = tmp_path / "t.json"
    f.write_bytes(content)
    with pytest.raises(TraceFormatError, match=message) as e:
        load(f)
    assert str(f) in str(e.value)
    assert cli(["timeline", str(f)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("torsh timeline: ") and message.split("'")[0].split("=")[0] in err


def test_truncated_gzip(tmp_path):
    whole = gzip.compress(json.dumps(_good()).encode() * 50)
    f = tmp_path / "t.json.gz"
    f.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(TraceFormatError, match="gzip stream is truncated or corrupt"):
        read_json(f)


def test_directory_problems(tmp_path):
    with pytest.raises(TraceFormatError, match="no trace files"):
        load(tmp_path)
    with pytest.raises(TraceFormatError, match="no such file or directory"):
        load(tmp_path / "missing")
    d = tmp_path / "dup"
    d.mkdir()
    for name in ("rank0.json", "run_rank0.json"):
        (d / name).write_text(json.dumps(_good()))
    with pytest.raises(TraceFormatError, match="rank 0 appears twice"):
        load(d)


def test_chrome_b_e_events(tmp_path):
    """Plain Chrome traces with begin/end pairs (e.g. Horovod's timeline) load as spans."""
    ev = [{"ph": "B", "name": "ALLREDUCE", "ts": 10, "pid": 0, "tid": 3},
          {"ph": "E", "ts": 30, "pid": 0, "tid": 3},
          {"ph": "X", "name": "compute", "ts": 0, "dur": 20, "pid": 0, "tid": 1}]  # fmt: skip
    f = tmp_path / "horovod.json"
    f.write_text(json.dumps(ev))
    tr = load(f)
    ar = next(s for s in tr.spans if s.name == "ALLREDUCE")
    assert ar.cls == "communication" and ar.start == pytest.approx(0.010) and ar.dur == pytest.approx(0.020)
    assert next(s for s in tr.spans if s.name == "compute").cls == "compute"
