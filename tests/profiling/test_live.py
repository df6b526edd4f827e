"""Live metrics: the records the DDP hook, the synchronizer, FSDP2's comms and the EP layer publish on real ranks,
and their sinks (rotated files, a Prometheus endpoint scraped by a plain HTTP GET, TensorBoard scalars)."""

from __future__ import annotations

import json
import os
import socket
import urllib.request

import pytest
import torch

from torsh_kernels import live
from torsh_kernels.collectives import run_local
from torsh_kernels.errors import ArgumentTypeError, InvalidArgumentError
from torsh_kernels.profiling.alerts import AlertSpec, JobAlerts
from torsh_kernels.profiling.live import LiveSpec, Publisher, start_from_env, watch


def _rec(rank=0, step=0, **kw):
    r = {"rank": rank, "world_size": 2, "source": "ddp", "step": step, "step_s": 0.01, "compute_s": 0.008,
         "comm_s": 0.001, "compress_s": 0.001, "wire_bytes": 1000, "payload_bytes": 4000, "sent_bytes": 1000,
         "link_Bps": 1e9, "ratio": 4.0, "error": None, "nonfinite": 0, "compressor": "int8",
         "switch": None}  # fmt: skip
    r.update(kw)
    return r


def _lines(path):
    with open(path) as f:
        return [json.loads(x) for x in f]


def test_files_are_append_only_bounded_and_rotated(tmp_path):
    with Publisher(LiveSpec(dir=str(tmp_path), max_bytes=4096, keep=2, job="rot")) as pub:
        for s in range(300):
            pub.publish(_rec(step=s))
    names = sorted(os.listdir(tmp_path))
    assert names == ["rank0.jsonl", "rank0.jsonl.1", "rank0.jsonl.2"]  # older ones deleted
    for n in names:
        assert os.path.getsize(tmp_path / n) <= 4096
    recs = _lines(tmp_path / "rank0.jsonl.2") + _lines(tmp_path / "rank0.jsonl.1") + _lines(tmp_path / "rank0.jsonl")
    steps = [r["step"] for r in recs]
    assert steps == list(range(steps[0], 300))  # in order across the rotation, the newest last
    assert all(list(r) == list(live.FIELDS) for r in recs)
    assert recs[-1]["schema"] == live.SCHEMA and recs[-1]["job"] == "rot" and recs[-1]["alerts"] == []


def test_a_record_gets_its_rank_alerts(tmp_path):
    with Publisher(LiveSpec(dir=str(tmp_path), alerts=AlertSpec(error_bound=2.0))) as pub:
        a = pub.publish(_rec(step=0, nonfinite=1))
        b = pub.publish(_rec(step=1, error=3.0))
        b2 = pub.publish(_rec(step=2, error=1.0))
        c = pub.publish(_rec(step=3, switch={"from": "none", "to": "int8", "reason": "link"}))
    assert [x["kind"] for x in a["alerts"]] == ["nonfinite"]
    assert [x["kind"] for x in b["alerts"]] == ["compression_error"] and b2["alerts"] == []
    assert "auto_switch" in [x["kind"] for x in c["alerts"]]


def test_spec_and_watch_errors_are_typed(tmp_path):
    with pytest.raises(InvalidArgumentError, match="nowhere to publish"):
        LiveSpec()
    with pytest.raises(InvalidArgumentError, match="prometheus"):
        LiveSpec(prometheus=70000)
    with pytest.raises(ArgumentTypeError, match="job"):
        LiveSpec(dir=str(tmp_path), job="")
    with pytest.raises(ArgumentTypeError, match="alerts"):
        LiveSpec(dir=str(tmp_path), alerts={"straggler": 1})
    with pytest.raises(ArgumentTypeError, match="unexpected keyword"):
        watch(directory=str(tmp_path))
    with watch(dir=str(tmp_path)) as pub:
        assert live.publisher is pub
        with pytest.raises(InvalidArgumentError, match="already publishes"):
            watch(dir=str(tmp_path))
    assert live.publisher is None


def _busy_port() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    return s


def test_a_failing_sink_never_stops_training(tmp_path, capsys):
    held = _busy_port()
    try:
        pub = Publisher(LiveSpec(dir=str(tmp_path), prometheus=held.getsockname()[1], addr="127.0.0.1"))
        for s in range(3):
            pub.publish(_rec(step=s))  # the port is taken: reported, not raised
        pub.close()
    finally:
        held.close()
    assert pub.errors and "cannot serve Prometheus" in pub.errors[0]
    assert "torsh live metrics" in capsys.readouterr().err
    assert len(_lines(tmp_path / "rank0.jsonl")) == 3  # the other sink kept going


def test_start_from_env(tmp_path, monkeypatch):
    monkeypatch.setenv("TORSH_LIVE", str(tmp_path))
    monkeypatch.setenv("TORSH_LIVE_JOB", "envjob")
    pub = start_from_env()
    try:
        assert pub is live.publisher and pub.spec.job == "envjob" and pub.spec.dir == str(tmp_path)
    finally:
        pub.close()
    monkeypatch.setenv("TORSH_LIVE_PROMETHEUS", "nine")
    with pytest.raises(InvalidArgumentError, match="TORSH_LIVE_PROMETHEUS"):
        start_from_env()


# -- real ranks ----------------------------------------------------------------------------------------------


def _ddp_worker(comm, d, compressor, steps, prometheus):
    from torsh_kernels.apps.bench.live import train

    with watch(dir=d, prometheus=0 if prometheus else None, addr="127.0.0.1", job="t", error_every=5) as pub:
        out = train(comm, compressor=compressor, steps=steps, hidden=64)
        text = None
        if prometheus:
            with urllib.request.urlopen(pub.prometheus_url, timeout=10) as r:  # a plain HTTP GET
                text = r.read().decode()
    return out["stats"], text, out["timed"]


@pytest.mark.parametrize("compressor", ["int8", "topk:0.05"])
def test_ddp_hook_records_every_step(tmp_path, compressor):
    steps = 16
    outs = run_local(_ddp_worker, 2, str(tmp_path), compressor, steps, False, op_timeout=60)
    assert all(o[2] for o in outs)  # someone listened: the collectives were timed
    for rank in (0, 1):
        recs = _lines(tmp_path / f"rank{rank}.jsonl")
        assert [r["step"] for r in recs] == list(range(steps))
        assert all(r["source"] == "ddp" and r["rank"] == rank and r["world_size"] == 2 for r in recs)
        assert recs[0]["step_s"] is None and all(r["step_s"] > 0 for r in recs[1:])
        for r in recs[1:]:
            assert 0 <= r["compute_s"] <= r["step_s"] and r["comm_s"] >= 0 and r["compress_s"] >= 0
        warm, comp = recs[:5], recs[5:]  # the hook's start_iter (train's warmup=5): plain all-reduces
        assert all(r["compressor"] == "none" and r["ratio"] == 1.0 for r in warm)
        assert all(r["compressor"] == compressor for r in comp)
        stats = outs[rank][0]
        assert sum(r["wire_bytes"] for r in recs) == pytest.approx(stats["wire_bytes"], rel=0.05)
        assert sum(r["payload_bytes"] for r in recs) == stats["bytes_before"]
        assert sum(r["sent_bytes"] for r in recs) == stats["bytes_after"]
        assert all(r["link_Bps"] and r["link_Bps"] > 0 for r in recs[1:])
        assert all(r["ratio"] > 2.5 for r in comp)  # (the small model's biases travel uncompressed)
        errors = {r["step"]: r["error"] for r in recs if r["error"] is not None}
        if compressor == "topk:0.05":  # error feedback: the residual's norm over the gradient's, every 5 steps
            assert sorted(errors) == [5, 10, 15] and all(0 < e < 50 for e in errors.values())
        assert all(r["nonfinite"] == 0 and r["switch"] is None for r in recs)


def test_prometheus_endpoint_scraped_by_http_get(tmp_path):
    outs = run_local(_ddp_worker, 2, str(tmp_path), "int8", 8, True, op_timeout=60)
    for rank, (_, text, _) in enumerate(outs):
        lines = {ln.split(" ")[0]: float(ln.split(" ")[1]) for ln in text.splitlines() if ln and ln[0] != "#"}
        key = f'{{compressor="int8",job="t",rank="{rank}",source="ddp"}}'
        assert lines[f"torsh_steps_total{key}"] == 3  # steps 5, 6, 7 under int8 (the warm-up's under none)
        assert lines[f"torsh_wire_bytes_total{key}"] > 0
        assert lines[f"torsh_compression_ratio{key}"] > 2.5
        assert lines[f"torsh_step{key}"] == 7
        assert lines[f'torsh_alert{{job="t",kind="nonfinite",rank="{rank}",source="ddp"}}'] == 0.0


def _sync_worker(comm, d):
    from torsh_kernels.parallel import GradientSynchronizer

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    sync = GradientSynchronizer(model, comm, compressor="int8", start_iter=2, min_numel=16)
    x = torch.randn(16, 32)
    with watch(dir=d, job="s"):
        for _ in range(6):
            model.zero_grad()
            model(x).sum().backward()
            sync.sync_gradients()
    return True


def _unwatch_worker(comm, d):
    from torsh_kernels.parallel import GradientSynchronizer

    torch.manual_seed(0)
    model = torch.nn.Linear(32, 8)
    sync = GradientSynchronizer(model, comm, compressor="int8", start_iter=0, min_numel=16)
    timed = []
    for i in range(6):
        pub = watch(dir=d, job="u") if i == 2 else None
        model(torch.randn(4, 32)).sum().backward()
        sync.sync_gradients()
        timed.append(comm.traffic.timed)
        if pub is not None:
            pub.close()
    return timed


def test_collectives_are_timed_only_while_someone_listens(tmp_path):
    for timed in run_local(_unwatch_worker, 2, str(tmp_path), op_timeout=60):
        assert timed == [False, False, True, False, False, False]


def test_synchronizer_records(tmp_path):
    run_local(_sync_worker, 2, str(tmp_path), op_timeout=60)
    recs = _lines(tmp_path / "rank1.jsonl")
    assert [r["step"] for r in recs] == list(range(6)) and all(r["source"] == "sync" for r in recs)
    assert [r["compressor"] for r in recs] == ["none"] * 2 + ["int8"] * 4
    assert all(r["ratio"] > 2 for r in recs[2:]) and all(r["wire_bytes"] > 0 for r in recs)


def _plain_worker(comm):
    from torsh_kernels.apps.bench.live import train

    # nobody listened: the communicator's collectives were never timed (no callback per collective)
    return train(comm, compressor="int8", steps=4, hidden=32)["timed"]


def test_nothing_is_paid_when_nobody_listens():
    assert run_local(_plain_worker, 2, op_timeout=60) == [False, False]


def test_tensorboard_scalars(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with Publisher(LiveSpec(tensorboard=str(tmp_path))) as pub:
        for s in range(5):
            pub.publish(_rec(step=s, step_s=0.1 * (s + 1)))
    acc = EventAccumulator(str(tmp_path / "rank0"))
    acc.Reload()
    ev = acc.Scalars("torsh/ddp/step_s")
    assert [e.step for e in ev] == list(range(5))
    assert [round(e.value, 6) for e in ev] == [round(0.1 * (s + 1), 6) for s in range(5)]


def _straggler_worker(comm, d):
    from torsh_kernels.apps.bench.live import train

    with watch(dir=d, job="strag"):
        train(comm, compressor="int8", steps=30, hidden=64, slow_rank=1, slow_from=12, slow_s=0.05)
    return True


@pytest.mark.slow
def test_a_slowed_rank_raises_the_straggler_alert_within_10_steps(tmp_path):
    run_local(_straggler_worker, 3, str(tmp_path), op_timeout=60)
    job = JobAlerts()
    for r in range(3):
        job.update(_lines(tmp_path / f"rank{r}.jsonl"))
    first = [a for a in job.history() if a["kind"] == "straggler"]
    assert first, job.history()
    assert {a["rank"] for a in first} == {1}
    assert 12 <= min(a["step"] for a in first) <= 12 + 10
    # the other ranks wait for it in their collectives, which lowers their measured link rates; across ranks that
    # is not taken for a slower link
    assert not [a for a in job.history() if a["kind"] == "link_drop"], job.history()


def _fsdp_worker(comm, d):
    import warnings

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from torsh_kernels.parallel import apply_quantized_comm

    warnings.simplefilter("ignore", FutureWarning)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(24, 64), torch.nn.ReLU(), torch.nn.Linear(64, 5))
    mesh = init_device_mesh("cpu", (comm.world_size,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    apply_quantized_comm(model, weights="int8", grads="int4")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(8, 24)
    with watch(dir=d, job="f", error_every=2):
        for _ in range(5):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
    return True


def test_fsdp2_comms_record_each_step(tmp_path):
    run_local(_fsdp_worker, 2, str(tmp_path), op_timeout=60)
    for rank in (0, 1):
        recs = _lines(tmp_path / f"rank{rank}.jsonl")
        # a step runs from one forward of the root to the next: five forwards, four complete steps
        assert [r["step"] for r in recs] == [0, 1, 2, 3] and all(r["source"] == "fsdp" for r in recs)
        for r in recs:
            assert r["compressor"] == "weights=int8,grads=int4" and r["comm_s"] is None
            assert r["step_s"] > 0 and r["compress_s"] > 0 and r["sent_bytes"] > 0
            assert 2.5 < r["ratio"] < 8  # int8 weights (4x less than fp32) and int4 gradients (8x)
            assert r["wire_bytes"] > 0 and r["link_Bps"] > 0
        # int4 gradients with error feedback: the residual's norm over the gradient's, on the sampled steps
        assert [r["step"] for r in recs if r["error"] is not None] == [0, 2]
        assert all(0 < r["error"] < 10 for r in recs if r["error"] is not None)


def _ep_worker(comm, d):
    from torsh_kernels.parallel import ExpertParallelMoE

    torch.manual_seed(0)
    layer = ExpertParallelMoE(16, 32, 4, 2, comm, wire="fp8")
    x = torch.randn(20, 16)
    with watch(dir=d, job="e"):
        for _ in range(4):
            layer(x).square().mean().backward()
    return layer.last_dispatch["bytes_sent"]


def test_expert_parallel_layer_records_each_step(tmp_path):
    run_local(_ep_worker, 2, str(tmp_path), op_timeout=60)
    for rank in (0, 1):
        recs = _lines(tmp_path / f"rank{rank}.jsonl")
        assert [r["step"] for r in recs] == [0, 1, 2] and all(r["source"] == "ep" for r in recs)
        for r in recs:  # fp8 dispatch, the rest in the layer's dtype (fp32 here)
            assert r["compressor"].startswith("e4m3") and r["payload_bytes"] > r["sent_bytes"] > 0
            assert r["comm_s"] > 0 and r["compress_s"] is None and r["wire_bytes"] > 0
