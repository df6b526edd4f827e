"""The timeline recorder: what it records from each layer, the Chrome trace format of its files (from
real multi-process runs), TORSH_TRACE, and its errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import torsh_kernels as tk
from tests.helpers import MLP
from torsh_kernels import recording
from torsh_kernels.collectives import run_local
from torsh_kernels.compression import PowerSGD, TopK, compressed_all_reduce
from torsh_kernels.errors import FileAccessError, InvalidArgumentError, TraceFormatError
from torsh_kernels.parallel import CompressionHookState, GradientSynchronizer, compression_hook
from torsh_kernels.profiling import timeline
from torsh_kernels.profiling.traces import load, validate


def _xs(data: dict, cat: str | None = None) -> list[dict]:
    return [e for e in data["traceEvents"] if e["ph"] == "X" and (cat is None or e["cat"] == cat)]


def test_nothing_recorded_without_a_recorder():
    assert recording.recorder is None
    assert timeline.record("x") is recording.NULL and timeline.step(3) is recording.NULL
    with timeline.record("x"), timeline.step(1):
        tk.flatten([torch.randn(3), torch.randn(2)])


def test_recorder_in_one_process(tmp_path):
    xs = [torch.randn(5, 3), torch.randn(7)]
    with timeline.Recorder(tmp_path, rank=0, world_size=1) as rec:
        assert recording.recorder is rec and rec.active
        with timeline.step(0, label="a"), timeline.record("outer", note="n"):
            tk.flatten(xs, provider="torch")
            time.sleep(0.02)
    assert recording.recorder is None
    data = json.loads((tmp_path / "rank0.json").read_text())
    assert validate(data, "rank0.json") == "torsh"
    od = data["otherData"]
    assert od["rank"] == 0 and od["world_size"] == 1 and od["versions"]["torch"] == torch.__version__
    assert od["clock"]["base_unix_us"] % 86_400_000_000 == 0 and "monotonic" in od["clock"]["source"]
    step, outer, flat = (next(e for e in _xs(data) if e["name"] == n) for n in ("step 0", "outer", "flatten"))
    assert step["args"] == {"step": 0, "label": "a"} and outer["args"] == {"note": "n"}
    assert flat["cat"] == "op" and flat["args"]["provider"] == "torch"
    assert flat["args"]["bytes"] == 2 * (15 + 7) * 4  # the inputs and the flat output
    # microseconds: the 20 ms sleep inside "outer"
    assert 20_000 <= outer["dur"] < 20_000 + 200_000
    assert step["ts"] <= outer["ts"] <= flat["ts"] and flat["ts"] + flat["dur"] <= outer["ts"] + outer["dur"]
    # the wall clock anchors the timestamps: base + ts is within a minute of now
    assert abs((od["clock"]["base_unix_us"] + step["ts"]) / 1e6 - time.time()) < 60


def test_recorder_errors(tmp_path):
    with pytest.raises(InvalidArgumentError, match="rank"):
        timeline.Recorder(rank=-1)
    with pytest.raises(InvalidArgumentError, match="max_events"):
        timeline.Recorder(max_events=0)
    with timeline.Recorder(tmp_path), pytest.raises(InvalidArgumentError, match="another recorder is already active"):
        timeline.Recorder(tmp_path / "b").start()
    with pytest.raises(InvalidArgumentError, match="no directory"):
        timeline.Recorder().write()
    with pytest.raises(TypeError, match="name"), timeline.Recorder(rank=0, world_size=1):
        timeline.record("")


def test_max_events_drops_and_says_so():
    rec = timeline.Recorder(rank=0, world_size=1, max_events=3)
    with rec:
        for i in range(5):
            with timeline.record(f"s{i}"):
                pass
    t = rec.trace()
    assert len(_xs(t)) == 3 and t["otherData"]["dropped_events"] == 2


def test_start_stop_windows_and_threads(tmp_path):
    import threading

    rec = timeline.Recorder(rank=0, world_size=1)
    rec.start()
    with timeline.record("first"):
        pass
    rec.stop()
    with timeline.record("unrecorded"):
        pass
    rec.start()

    def other():
        with timeline.record("in thread"):
            time.sleep(0.001)

    th = threading.Thread(target=other, name="loader")
    th.start()
    with timeline.record("main work"):
        time.sleep(0.002)
    th.join()
    rec.stop()
    path = rec.write(tmp_path)
    data = json.loads(path.read_text())
    validate(data, path)
    names = {e["name"]: e for e in _xs(data)}
    assert "unrecorded" not in names and {"first", "in thread", "main work"} <= set(names)
    lanes = {e["tid"]: e["args"]["name"] for e in data["traceEvents"] if e["name"] == "thread_name"}
    assert lanes[names["main work"]["tid"]] == "main" and lanes[names["in thread"]["tid"]] == "thread loader"


# -- real multi-process runs ------------------------------------------------------------------------


def _Net() -> MLP:
    return MLP(24, 64, 10, seed=0)


def _traced_worker(comm, d: str) -> None:
    net = _Net()
    sync = GradientSynchronizer(net, comm, compressor=TopK(0.05), bucket_mb=0.004, first_bucket_mb=0.002,
                                min_numel=16)  # fmt: skip
    g = torch.Generator().manual_seed(comm.rank)
    with timeline.Recorder(d):
        for i in range(2):
            with timeline.step(i, label="sync"):
                with timeline.record("forward"):
                    loss = net(torch.randn(8, 24, generator=g)).sum()
                with timeline.record("backward"):
                    loss.backward()
                sync.sync_gradients()
                sync.zero_grad()
        # DDP with the comm hook
        ddp_net = _Net()
        ddp = DDP(ddp_net)
        ddp.register_comm_hook(CompressionHookState(compressor=PowerSGD(2), start_iter=0, min_numel=16),
                               compression_hook)  # fmt: skip
        with timeline.step(2, label="ddp"):
            ddp(torch.randn(8, 24, generator=g)).sum().backward()
        # plain collectives
        t = torch.randn(33, generator=g)
        comm.all_reduce(t)
        out = torch.empty(2 * 5)
        comm.all_gather(out, torch.randn(5, generator=g))
        # uneven all_to_all: rank r sends 1 + r rows to rank 0 and 2 rows to rank 1
        x = torch.randn(3 + comm.rank, 4, generator=g)
        outs = [1, 2] if comm.rank == 0 else [2, 2]
        comm.all_to_all(torch.empty(sum(outs), 4), x, output_splits=outs, input_splits=[1 + comm.rank, 2])
        comm.broadcast(torch.randn(9, generator=g), src=1)
        m = torch.randn(16, 12, generator=g)
        st = PowerSGD(2).new_state(seed=1)
        compressed_all_reduce(m, comm, PowerSGD(2), st)


def test_multiprocess_traces_validate(tmp_path):
    d = tmp_path / "tr"
    run_local(_traced_worker, 2, str(d), timeout=240)
    files = sorted(p.name for p in d.iterdir())
    assert files == ["rank0.json", "rank1.json"]
    datas = [json.loads((d / f).read_text()) for f in files]
    colls = []
    for r, data in enumerate(datas):
        assert validate(data, f"rank{r}.json") == "torsh"  # fields, microseconds, metadata, nesting
        od = data["otherData"]
        assert (od["rank"], od["world_size"]) == (r, 2) and od["device"] and od["versions"]["torsh_kernels"]
        assert {e["pid"] for e in _xs(data)} == {r}
        cats = {e["cat"] for e in _xs(data)}
        assert {"op", "collective", "bucket", "compression", "wait", "user", "step"} <= cats
        c = sorted(_xs(data, "collective"), key=lambda e: (e["args"]["group"], e["args"]["seq"]))
        # (the bytes differ where the payloads do: the uneven all_to_all, the broadcast's root)
        same_bytes = ("all_reduce", "all_gather")
        colls.append([(a["group"], a["seq"], a["op"], a["bytes"] if a["op"] in same_bytes else None)
                      for a in (e["args"] for e in c)])  # fmt: skip
        ops = {e["args"]["op"] for e in c}
        assert {"all_reduce", "all_gather", "all_to_all", "broadcast"} <= ops
        assert any(e["args"].get("compressor") == "TopK" and e["args"].get("algorithm") == "all_gather" for e in c)
        assert any(e["args"].get("compressor") == "PowerSGD" and e["args"].get("algorithm") == "all_reduce" for e in c)
        for e in c:
            assert e["args"]["wire_bytes"] >= 0 and e["args"]["group"] == "0,1"
        buckets = _xs(data, "bucket")
        assert {b["args"]["compressor"] for b in buckets} == {"TopK", "PowerSGD"}
        assert all(b["args"]["bytes"] > 0 for b in buckets)
        # the wire-bytes counter rises with every collective and ends at the recorded total
        sent = [e["args"]["sent"] for e in data["traceEvents"] if e["ph"] == "C"]
        assert sent == sorted(sent) and sent[-1] == od["wire_bytes"] == sum(e["args"]["wire_bytes"] for e in c)
        lanes = {e["args"]["name"] for e in data["traceEvents"] if e["name"] == "thread_name"}
        assert {"main", "comm 0", "bucket 0"} <= lanes
    # every rank issued the same collectives in the same order
    assert colls[0] == colls[1] and len(colls[0]) > 5
    tr = load(d)
    assert list(tr.ranks) == [0, 1] and len(tr.steps()) == 6


@pytest.mark.slow  # runs `torsh demo` on real ranks
def test_torsh_trace_env(tmp_path):
    d = tmp_path / "env"
    env = {**os.environ, "TORSH_TRACE": str(d)}
    p = subprocess.run([sys.executable, "-m", "torsh_kernels.apps.cli", "demo", "--steps", "12",
                        "--compressors", "fp16", "--hidden", "32", "--batch", "8", "--no-progress", "--link", "none"],
                       env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert sorted(f.name for f in d.iterdir()) == ["rank0.json", "rank1.json"]
    tr = load(d)
    assert len([s for s in tr.steps() if s.rank == 0]) == 12
    assert any(s.cls == "communication" and s.args.get("compressor") == "FP16" for s in tr.spans)


def test_an_unwritable_trace_directory_fails_when_recording_starts(tmp_path, monkeypatch):
    """TORSH_TRACE (read at import) and Recorder(dir).start(): a place that cannot take the trace is refused
    at once, with what to do, not at exit."""
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    for bad, why in ((blocker, "exists and is not a directory"), (blocker / "sub", "cannot be created")):
        monkeypatch.setenv("TORSH_TRACE", str(bad))
        with pytest.raises(FileAccessError, match=f"TORSH_TRACE: the trace directory {bad} {why}.*unset it"):
            timeline.start_from_env()
        assert recording.recorder is None
        with pytest.raises(FileAccessError, match=why):
            timeline.Recorder(bad).start()
        assert recording.recorder is None


_EXIT_SCRIPT = """
import pathlib, shutil, sys
import torsh_kernels
from torsh_kernels.profiling import timeline
with timeline.record("work"):
    pass
d = pathlib.Path(sys.argv[1])
shutil.rmtree(d)
d.write_text("now a file")  # the directory checked at start is gone by the time the trace is written
"""


def test_a_trace_that_cannot_be_written_at_exit_is_rescued_and_reported(tmp_path):
    d, rescue = tmp_path / "traces", tmp_path / "tmp"
    rescue.mkdir()
    env = {**os.environ, "TORSH_TRACE": str(d), "TMPDIR": str(rescue)}
    p = subprocess.run([sys.executable, "-c", _EXIT_SCRIPT, str(d)], env=env, capture_output=True, text=True,
                       timeout=120)  # fmt: skip
    assert p.returncode == 0 and d.read_text() == "now a file"
    assert f"torsh_kernels: error: TORSH_TRACE: could not write this process's trace to {d}" in p.stderr, p.stderr
    (saved,) = rescue.glob("torsh-trace-*/rank0.json")
    assert f"it was written to {saved} instead" in p.stderr
    assert [s.name for s in load(saved).spans] == ["work"]


def test_a_planted_symlink_redirects_no_trace_write(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    d = tmp_path / "traces"
    d.mkdir()
    os.symlink(victim, d / "rank0.json")
    os.symlink(victim, d / f"rank0.json.tmp{os.getpid()}")  # the temporary name the writer used to use
    with timeline.Recorder(d, rank=0, world_size=1), timeline.record("x"):
        pass
    assert victim.read_text() == "precious" and not (d / "rank0.json").is_symlink()
    assert validate(json.loads((d / "rank0.json").read_text())) == "torsh"
    assert sorted(f.name for f in d.iterdir()) == ["rank0.json", f"rank0.json.tmp{os.getpid()}"]


def test_overlapping_events_are_rejected():
    data = {"traceEvents": [{"ph": "M", "name": "process_name", "pid": 0, "tid": 0, "args": {"name": "r"}},
                            {"ph": "M", "name": "thread_name", "pid": 0, "tid": 1, "args": {"name": "main"}},
                            {"ph": "X", "name": "a", "cat": "user", "ts": 0, "dur": 10, "pid": 0, "tid": 1},
                            {"ph": "X", "name": "b", "cat": "user", "ts": 5, "dur": 10, "pid": 0, "tid": 1}],
            "otherData": {"schema": "torsh-trace/1", "rank": 0, "world_size": 1, "device": "cpu", "versions": {},
                          "clock": {"base_unix_us": 0}}}  # fmt: skip
    with pytest.raises(TraceFormatError, match="overlap without nesting on pid=0 tid=1"):
        validate(data, "t.json")
    data["traceEvents"][3]["ts"] = 2  # nested inside a: fine
    data["traceEvents"][3]["dur"] = 8
    assert validate(data, "t.json") == "torsh"
    del data["otherData"]["clock"]
    with pytest.raises(TraceFormatError, match="lacks"):
        validate(data, "t.json")


def test_offload_transfers_are_memory_spans(tmp_path):
    from torsh_kernels.parallel import OffloadedOptimizer

    net = _Net()
    opt = OffloadedOptimizer(net.parameters(), state_format="bf16", lr=1e-3, chunk_mb=1e-3)
    with timeline.Recorder(tmp_path, rank=0, world_size=1):
        net(torch.randn(4, 24)).sum().backward()
        opt.step()
    tr = load(tmp_path)
    mem = [s for s in tr.spans if s.cat == "offload"]
    assert {s.name for s in mem} == {"offload grads to host", "offload params to device"}
    assert all(s.cls == "memory" for s in mem)
    n = sum(p.numel() for p in net.parameters())
    assert sum(s.args["bytes"] for s in mem if s.name == "offload grads to host") == 4 * n


def test_parameter_offloader_units_are_memory_spans(tmp_path):
    from torsh_kernels.parallel import ParameterOffloader

    net = _Net()
    off = ParameterOffloader(net, fmt="bf16", prefetch=0, device="cpu")
    try:
        with timeline.Recorder(tmp_path, rank=0, world_size=1):
            net(torch.randn(4, 24)).sum().backward()
    finally:
        off.remove()
    spans = [s for s in load(tmp_path).spans if s.name == "offload unit to device"]
    assert spans and all(s.cls == "memory" and s.args["format"] == "bf16" for s in spans)
    assert {s.args["unit"] for s in spans} == {0, 1}  # both Linear layers were brought to the device


def test_recorder_and_loaded_trace_print_counts(tmp_path):
    """Neither the recorder nor a loaded Trace prints its events: counts, one line."""
    rec = timeline.Recorder(tmp_path, rank=0, world_size=1, max_events=1000)
    assert (
        repr(rec) == f"Recorder(directory={str(tmp_path)!r}, rank=0, world_size=1, active=False, events=0, dropped=0)"
    )
    with rec:
        for i in range(5):
            with timeline.step(i):
                for j in range(300):
                    with timeline.record(f"s{j}"):
                        pass
        live = repr(rec)
    assert live == f"Recorder(directory={str(tmp_path)!r}, rank=0, world_size=1, active=True, events=1000, dropped=505)"
    t = load(tmp_path)
    r = repr(t)
    assert len(t.spans) == 1000 and len(r) <= 150 and "\n" not in r, r
    assert r.startswith(f"Trace(ranks=[0], spans=1000, lanes={len(t.lanes)}, steps={len(t.steps())}, "), r
    assert r.endswith(f"{t.end:.3f} ms)"), r
