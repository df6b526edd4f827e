"""Loading traces: real torch.profiler (Kineto) traces of a DDP training step, plain and gzip; and
malformed, truncated or foreign files, each with an error naming the problem."""

from __future__ import annotations

import gzip
import json
import re

import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from torsh_kernels.apps.cli import main as cli
from torsh_kernels.collectives import run_local
from torsh_kernels.errors import InvalidArgumentError, TraceFormatError
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
    # each rank has a lane for its gloo thread, not only its Python thread: Kineto names it pt_gloo_... or, when
    # the profiler met the thread before gloo named it (seen under load), after the process ("python")
    for r in (0, 1):
        assert len(re.findall(rf"^r{r} \S+ \(\d+…?\)", out, re.M)) >= 2, out  # its name, the id dim (cut: …)
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
        (b'{"traceEvents": [{"ph": "X", "name": "a", "ts": 1, "dur": 3, "pid": {"a": 1}, "tid": 1}]}',
         "has pid=dict .*; expected a number or a string"),
        (b'{"traceEvents": [{"ph": "M", "name": "thread_name", "pid": 1, "tid": [2], "args": {"name": "t"}}]}',
         "has tid=list .*; expected a number or a string"),
        (b'{"traceEvents": ["x"]}', "event 0 is a str"),
        (b'{"traceEvents": [{"ph": "M", "name": "thread_name", "pid": 1, "tid": 1, "args": {"name": "t"}}]}',
         "no complete events"),
        (b'{"traceEvents": "\xc3\x28"}', "not UTF-8 JSON"),
        (b'{"traceEvents": [' + b"1" * 5000 + b"]}", "a number in it cannot be read"),
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


# -- limits: decompressed size and nesting depth; files that are not files ----------------------------------


def test_a_gzip_bomb_stops_at_the_size_limit(tmp_path, monkeypatch, capsys):
    """64 MiB of JSON in a 64 KiB gzip, read with a 4 MiB limit: refused having decompressed little more than
    the limit (Python's allocations peak far below what the file inflates to)."""
    import tracemalloc

    f = tmp_path / "bomb.json.gz"
    f.write_bytes(gzip.compress(b"[" + b" " * (64 << 20) + b"]", 9))
    assert f.stat().st_size < 100_000
    tracemalloc.start()
    try:
        with pytest.raises(TraceFormatError, match=rf"{f}: the trace decompresses to more than 4194304 bytes.*"
                                                    "TORSH_TRACE_MAX_BYTES=8GiB"):  # fmt: skip
            load(f, max_bytes=4 << 20)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 24 << 20, f"peak {peak / 2**20:.0f} MiB"
    monkeypatch.setenv("TORSH_TRACE_MAX_BYTES", "4MiB")  # the environment variable, and the CLI through it
    with pytest.raises(TraceFormatError, match="more than 4194304 bytes"):
        read_json(f)
    assert cli(["timeline", str(f)]) == 2 and "TORSH_TRACE_MAX_BYTES" in capsys.readouterr().err
    plain = tmp_path / "big.json"
    plain.write_bytes(b"[" + b" " * (5 << 20) + b"]")
    with pytest.raises(TraceFormatError, match=f"{plain}: the trace holds more than 4194304 bytes"):
        load(plain)
    monkeypatch.setenv("TORSH_TRACE_MAX_BYTES", "lots")
    with pytest.raises(InvalidArgumentError, match="TORSH_TRACE_MAX_BYTES='lots': expected a number of bytes"):
        load(plain)
    assert cli(["report", str(plain)]) == 2


def test_deep_nesting_is_refused_without_a_recursion_error(tmp_path, monkeypatch):
    f = tmp_path / "deep.json"
    for depth in (200_000, 65):
        f.write_text("[" * depth + "]" * depth)
        with pytest.raises(TraceFormatError, match=f"{f}: JSON nested deeper than 64 levels.*TORSH_TRACE_MAX_DEPTH"):
            load(f)
    with pytest.raises(TraceFormatError, match="event 0 is a list"):  # 65 levels allowed: the next check
        load(f, max_depth=65)
    monkeypatch.setenv("TORSH_TRACE_MAX_DEPTH", "65")
    with pytest.raises(TraceFormatError, match="event 0 is a list"):
        load(f)
    # brackets inside strings are not nesting
    f.write_text(json.dumps({"traceEvents": [{**_good()["traceEvents"][0], "name": "[" * 100 + "]" * 99}]}))
    assert load(f).spans[0].name.startswith("[[[")
    monkeypatch.setenv("TORSH_TRACE_MAX_DEPTH", "3GiB")
    with pytest.raises(InvalidArgumentError, match="TORSH_TRACE_MAX_DEPTH='3GiB': expected a number of levels"):
        load(f)


def test_paths_that_are_not_regular_files(tmp_path):
    import os

    fifo = tmp_path / "rank0.json"
    os.mkfifo(fifo)  # reading would block forever
    for target in (fifo, "/dev/zero"):  # and this one would never end
        with pytest.raises(TraceFormatError, match="not a regular file"):
            load(target)


def test_control_characters_and_markup_in_names_reach_the_terminal_escaped(tmp_path, capsys):
    """Event names, lane names, step labels and metadata with terminal escape sequences (CSI, OSC, a C1
    CSI), line breaks, bidirectional overrides and rich markup: `torsh timeline` and `torsh report` print
    them escaped and literal."""
    from tests.profiling.trace_fixtures import rank_trace

    evil = "[bold red]x[/bold red]\x1b[2J\u009b31m\u202e"  # (the top table shows 48 characters of a name)
    d = tmp_path / "t"
    d.mkdir()
    for r in range(2):
        data = rank_trace(r)
        for e in data["traceEvents"]:
            if e.get("name") == "forward":
                e["name"] = evil
            if e.get("name") == "thread_name" and e["args"]["name"] == "main":
                e["args"]["name"] = "m\x1b]0;owned\x07\n"  # OSC: sets the terminal's title
            if e.get("cat") == "step":
                e["args"]["label"] = f"lab{e['args']['step']}\x1b[1m"
        data["otherData"]["device"] = "gpu\x1b[5m"
        (d / f"rank{r}.json").write_text(json.dumps(data))
    tr = load(d)
    names = {s.name for s in tr.spans}
    assert "[bold red]x[/bold red]\\x1b[2J\\x9b31m\\u202e" in names
    assert tr.ranks[0]["device"] == "gpu\\x1b[5m" and {ln.name for ln in tr.lanes} >= {"m\\x1b]0;owned\\x07\\x0a"}
    assert cli(["timeline", str(d), "--width", "160", "--top", "20"]) == 0
    assert cli(["report", str(d), "--width", "160"]) == 0
    out = capsys.readouterr().out
    bad = sorted({hex(ord(c)) for c in out if (ord(c) < 32 and c != "\n") or 0x7F <= ord(c) <= 0x9F or c == "\u202e"})
    assert not bad, bad
    assert "[bold red]x[/bold red]" in out and "\\x1b[2J" in out, "escaped and literal, not interpreted"
    assert "r0 m\\x1b]0;owned\\x07\\x0a" in out and "lab0\\x1b[1m" in out
