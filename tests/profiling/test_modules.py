"""The recorder's module spans (``Recorder(model=net)``): forward and backward recorded from hooks that
exist only while recording, nesting correctly on one thread (also under DDP's comm hook, in 2 real gloo
processes), and what they change in the report: time no span covers is unrecorded, not idle."""

from __future__ import annotations

import json
import time

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.helpers import MLP
from torsh_kernels.collectives import run_local
from torsh_kernels.compression import PowerSGD
from torsh_kernels.errors import InvalidArgumentError
from torsh_kernels.parallel import CompressionHookState, compression_hook
from torsh_kernels.profiling import timeline
from torsh_kernels.profiling.report import Thresholds, build
from torsh_kernels.profiling.traces import load, validate


def _xs(data: dict) -> list[dict]:
    return [e for e in data["traceEvents"] if e["ph"] == "X"]


def _inside(inner: dict, outer: dict) -> bool:
    return (outer["tid"] == inner["tid"] and outer["ts"] <= inner["ts"]
            and inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"] + 1e-3)  # fmt: skip


def _hooks(m: torch.nn.Module) -> int:
    return sum(len(x._forward_hooks) + len(x._forward_pre_hooks) + len(x._backward_hooks) for x in m.modules())


def test_forward_and_backward_spans(tmp_path):
    net = MLP(24, 64, 10, seed=0)
    x = torch.randn(8, 24)

    def mark(g):  # runs while the gradient flows through the model's hidden layer: inside its backward
        with timeline.record("in backward"):
            return g

    with timeline.Recorder(tmp_path, rank=0, world_size=1, model=net, module_depth=1) as rec:
        assert _hooks(net) == 2 * 4  # pre and post hooks on the model and its three children

        def on_act(module, inputs, out) -> None:
            if out.requires_grad:
                out.register_hook(mark)

        marker = net.act.register_forward_hook(on_act)
        for i in range(2):
            with timeline.step(i):
                net.b(net.act(net.a(x)))  # children alone: forward spans, no backward span (no gradient)
                net(x).sum().backward()
        marker.remove()
        # two micro-batches meeting in one loss: one backward span for the pass
        (net(x).sum() + net(2 * x).sum()).backward()
        # retain_graph: two passes over one graph, two spans
        y = net(x).sum()
        y.backward(retain_graph=True)
        y.backward()
        raising = net.a.register_forward_hook(lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
        with pytest.raises(RuntimeError, match="boom"), torch.no_grad():
            net(x)  # forward raises: the spans it opened still close
        raising.remove()
    assert _hooks(net) == 0  # ours are gone when recording stops
    data = json.loads((tmp_path / "rank0.json").read_text())
    assert validate(data, "rank0.json") == "torsh"  # nesting on one thread
    xs = _xs(data)
    names = [e["name"] for e in xs]
    assert names.count("forward") == 2 + 2 + 1 + 1 and names.count("backward") == 2 + 1 + 2
    # a and b: called alone and in the model in each step, in both micro-batches, once with retain_graph; a also
    # in the forward that raised (in a's hook, so b never ran)
    assert names.count("forward a") == 2 + 2 + 2 + 1 + 1 and names.count("forward b") == 2 + 2 + 2 + 1
    assert all(e["cat"] == "module" for e in xs if e["name"].startswith(("forward", "backward")))
    assert next(e for e in xs if e["name"] == "backward")["args"] == {"module": "MLP"}
    back = [e for e in xs if e["name"] == "backward"]
    marks = [e for e in xs if e["name"] == "in backward"]
    assert len(marks) == 2 and all(any(_inside(m, b) for b in back) for m in marks)  # gradients flow inside it
    # the children's spans nest in the model's, except where a child was called on its own (once per step)
    fwd = [e for e in xs if e["name"] == "forward"]
    assert sum(any(_inside(f, o) for o in fwd) for f in xs if f["name"] == "forward a") == 8 - 2
    # nothing recorded while stopped, and a stopped recorder leaves no hooks behind
    n = len(xs)
    net(x).sum().backward()
    assert len(_xs(rec.trace())) == n and _hooks(net) == 0


def test_watch_errors():
    with pytest.raises(TypeError, match=r"torch\.nn\.Module"):
        timeline.Recorder(model="net")
    with pytest.raises(InvalidArgumentError, match="depth"):
        timeline.Recorder(model=MLP(3, 4), module_depth=-1)
    with pytest.raises(InvalidArgumentError, match="without a model"):
        timeline.Recorder(module_depth=2)


# -- 2 real ranks: DDP with torsh's comm hook, with and without the model's spans ----------------------------


def _ddp_job(comm, d: str, with_model: bool) -> None:
    net = MLP(32, 128, 128, 10, seed=0)
    ddp = DDP(net, bucket_cap_mb=0.05)
    ddp.register_comm_hook(CompressionHookState(compressor=PowerSGD(2), start_iter=0, min_numel=16),
                           compression_hook)  # fmt: skip
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(comm.rank)
    rec = timeline.Recorder(d, model=ddp if with_model else None)
    for i in range(5):  # two warm-up steps, then three recorded ones (the hooks come and go with start/stop)
        if i >= 2:
            rec.start()
        with timeline.step(i):
            opt.zero_grad()
            time.sleep(0.01)  # "loading data": host time no span covers, whatever the machine's speed
            x, y = torch.randn(1024, 32, generator=g), torch.randint(0, 10, (1024,), generator=g)
            torch.nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()
        rec.stop()
    rec.write()


def test_module_spans_under_ddp_and_unrecorded_time(tmp_path):
    reps = {}
    for with_model in (False, True):
        d = tmp_path / ("model" if with_model else "plain")
        run_local(_ddp_job, 2, str(d), with_model, timeout=240)
        for r in (0, 1):
            data = json.loads((d / f"rank{r}.json").read_text())
            assert validate(data, f"rank{r}.json") == "torsh"  # the backward span nests with the hook's spans
            xs = _xs(data)
            rounds = [e for e in xs if e["name"].startswith("PowerSGD round")]
            back = [e for e in xs if e["name"] == "backward"]
            assert rounds and len(back) == (3 if with_model else 0)
            if with_model:  # DDP calls the comm hook during backward: its rounds nest inside the span
                assert all(any(_inside(e, b) for b in back) for e in rounds if e["name"] == "PowerSGD round 1")
        reps[with_model] = build(load(d), thresholds=Thresholds(unrecorded=0.05))
    plain, model = reps[False], reps[True]
    for rep in (plain, model):
        ids = [g["id"] for g in rep["suggestions"]]
        assert "idle" not in ids and "stall" not in " ".join(g["message"] for g in rep["suggestions"])
        assert rep["summary"]["measured_on"] == ["host"] and rep["summary"]["gpu_idle_share"] is None
        assert rep["summary"]["host_unrecorded_share"] > 0.05 and "unrecorded" in ids
    # without the model's spans nothing computes in the trace: forward and backward are unrecorded (or show as
    # exposed communication), and the report says how to record them; with them, they are compute
    assert all(r["compute_ms"] == 0 for r in plain["ranks"])
    assert all(r["compute_ms"] > 0 for r in model["ranks"])
    msg = {
        rep is model: next(g["message"] for g in rep["suggestions"] if g["id"] == "unrecorded") for rep in reps.values()
    }
    assert "Recorder(dir, model=net)" in msg[False] and "Recorder(dir, model=net)" not in msg[True]
    assert plain["facts"]["comm_during_backward"] is None and model["facts"]["comm_during_backward"] is True
