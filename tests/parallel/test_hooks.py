"""compression_hook under real DDP on real gloo processes (2 and 3 ranks, several buckets).

- Exactness of the plumbing: DDP + compression_hook gives the same parameters as the same training loop
  without DDP where every eligible gradient goes through ``compressed_all_reduce`` with its own state
  and the rest is averaged plainly (compressed_all_reduce itself is checked against a simulation of every
  rank's state in tests/collectives). Bit-exact on 2 ranks; on 3 a ring all-reduce sums in an order that
  depends on where an element falls in the buffer, so within float tolerance there.
- Against uncompressed DDP: FP16 within fp16 tolerance; the others within stated bounds.
- Checkpoint: a fresh process-side DDP that loads the hook state, model and optimizer mid-training
  continues exactly as the uninterrupted run.
"""

from __future__ import annotations

import io
import pickle

import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from tests import helpers
from tests.helpers import make_compressor
from torsh_kernels.collectives import run_local
from torsh_kernels.compression import NoCompression, TopK, compressed_all_reduce
from torsh_kernels.errors import ArgumentTypeError, InvalidArgumentError
from torsh_kernels.parallel import CompressionHookState, compression_hook

STEPS = 4
CAP_MB = 0.005  # about 1300 fp32 elements per bucket: several buckets for this model


def make(name: str):
    # the shared factory, with this file's ratio and no PowerSGD warm-up (the hook state's start_iter rules)
    return make_compressor(name, **{"topk": {"ratio": 0.05}, "powersgd": {"start_iter": 0}}.get(name, {}))


def model() -> nn.Module:
    torch.manual_seed(1234)
    return nn.Sequential(
        nn.Linear(37, 61), nn.LayerNorm(61), nn.ReLU(), nn.Linear(61, 45), nn.ReLU(), nn.Linear(45, 10)
    )


def batch(step: int, rank: int):
    return helpers.batch(step, rank, rows=24, features=37, classes=10)


def train_ddp(comm, name, steps, *, state=None, net=None, opt=None, start=0, **ddp_kw):
    net = net if net is not None else model()
    ddp = DDP(net, bucket_cap_mb=CAP_MB, **ddp_kw)
    if state is None and name != "plain":
        state = CompressionHookState(compressor=make(name), min_numel=64)
    if state is not None:
        ddp.register_comm_hook(state, compression_hook)
    opt = opt if opt is not None else torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    for step in range(start, start + steps):
        x, y = batch(step, comm.rank)
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
    return net, opt, state


def train_reference(comm, state: CompressionHookState, ddp_params, steps):
    """The same loop without DDP: each eligible gradient through compressed_all_reduce with its own
    state (keyed and seeded as the hook keys and seeds it), the others averaged."""
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    c = state.compressor
    keys = [state._keys[id(p)] for p in ddp_params]  # same construction order: parameter i is parameter i
    states = {k: c.new_state(seed=(comm.rank * 1_000_003 + k) & 0x7FFFFFFF) for k in keys}
    for step in range(steps):
        x, y = batch(step, comm.rank)
        opt.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        for p, k in zip(net.parameters(), keys):
            if c is not None and step >= state.start_iter and state._engine.eligible(p.grad):
                compressed_all_reduce(p.grad, comm, c, states[k])
            else:
                compressed_all_reduce(p.grad, comm)
        opt.step()
    return net


def _exact_worker(comm, names, ddp_kw, start_iter):
    out = {}
    for name in names:
        state = CompressionHookState(compressor=make(name), min_numel=64, start_iter=start_iter)
        net, _, _ = train_ddp(comm, name, STEPS, state=state, **ddp_kw)
        ref = train_reference(comm, state, list(net.parameters()), STEPS)
        diffs = [(a - b).abs().max().item() for a, b in zip(net.parameters(), ref.parameters())]
        out[name] = (max(diffs), state.stats.as_dict())
    return out


ALL = ["none", "fp16", "bf16", "topk", "int8", "int4", "sign", "powersgd"]


@pytest.mark.parametrize(
    ("world_size", "ddp_kw", "start_iter"),
    [
        (2, {}, 0),
        (2, {"gradient_as_bucket_view": True}, 2),
        (2, {"static_graph": True}, 1),
        (3, {}, 1),
    ],
    ids=["2-ranks", "2-ranks-bucket-view-warmup", "2-ranks-static-graph", "3-ranks"],
)
def test_hook_equals_compressed_all_reduce_per_parameter(world_size, ddp_kw, start_iter):
    out = run_local(_exact_worker, world_size, ALL, ddp_kw, start_iter, op_timeout=60)
    for name in ALL:
        diff, stats = out[0][name]
        tol = 0.0 if world_size == 2 else {"fp16": 1e-3, "bf16": 1e-2}.get(name, 1e-5)
        assert diff <= tol, f"{name}: DDP+hook differs from the reference by {diff}"
        assert stats["iterations"] == STEPS
        assert stats["buckets"] > STEPS, "expected several buckets per iteration"
        if name in ("none",):
            assert stats["bytes_after"] == stats["bytes_before"]
        else:
            assert stats["bytes_after"] < stats["bytes_before"]
    for r in range(1, world_size):
        assert [out[r][n][1]["bytes_after"] for n in ALL] == [out[0][n][1]["bytes_after"] for n in ALL]


def _versus_plain_worker(comm, names, steps):
    plain, _, _ = train_ddp(comm, "plain", steps)
    init = model()
    out = {}
    for name in names:
        net, _, _ = train_ddp(comm, name, steps)
        # deviation of the trained parameters, relative to how far uncompressed training moved them
        dev = max(
            ((a - b).norm() / (b - p0).norm()).item()
            for a, b, p0 in zip(net.parameters(), plain.parameters(), init.parameters())
        )
        out[name] = dev
    return out


# stated bounds on ||p - p_plain|| / ||p_plain - p_init|| after 8 steps (SGD, momentum 0.9, lr 0.05)
# (measured: fp16 4e-4, bf16 1.4e-2, int8 1.1e-2, int4 4e-2, top-k 5% 0.54, sign 0.38, PowerSGD rank 2 0.74;
# the biased compressors trade per-step accuracy for bytes, error feedback keeps them from drifting)
BOUNDS = {"none": 1e-5, "fp16": 2e-3, "bf16": 3e-2, "int8": 0.03, "int4": 0.1, "topk": 0.7, "sign": 0.5,
          "powersgd": 0.9}  # fmt: skip


@pytest.mark.parametrize("world_size", [2, 3])
def test_compressed_ddp_stays_close_to_uncompressed_ddp(world_size):
    out = run_local(_versus_plain_worker, world_size, ALL, 8, op_timeout=60)
    for name in ALL:
        assert out[0][name] <= BOUNDS[name], f"{name}: relative deviation {out[0][name]:.3g} > {BOUNDS[name]}"


def _checkpoint_worker(comm, names):
    out = {}
    for name in names:
        whole, _, _ = train_ddp(comm, name, 6)
        # first half, then everything saved (as a training script would, with torch.save)
        net, opt, state = train_ddp(comm, name, 3)
        buf = io.BytesIO()
        torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "hook": state.state_dict()}, buf)
        del net, opt, state
        buf.seek(0)
        ck = torch.load(buf, weights_only=False)
        # a fresh model, optimizer, DDP and hook state, as in a restarted job
        net = model()
        net.load_state_dict(ck["model"])
        opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
        opt.load_state_dict(ck["opt"])
        state = CompressionHookState(compressor=make(name), min_numel=64)
        state.load_state_dict(ck["hook"])
        assert state.iteration == 3
        net, _, _ = train_ddp(comm, name, 3, state=state, net=net, opt=opt, start=3)
        out[name] = all(torch.equal(a, b) for a, b in zip(net.parameters(), whole.parameters()))
    return out


def test_checkpoint_restore_mid_training_reproduces_the_uninterrupted_run():
    names = ["topk", "int4", "sign", "powersgd"]
    out = run_local(_checkpoint_worker, 2, names, op_timeout=60)
    assert out == [dict.fromkeys(names, True)] * 2


def _state_worker(comm):
    res = {}
    # warm-up: plain all-reduce before start_iter, compressed after
    state = CompressionHookState(compressor=TopK(0.05), min_numel=64, start_iter=2)
    train_ddp(comm, "topk", 4, state=state)
    per = state.stats.per_iteration
    res["warmup"] = [it["bytes_after"] == it["bytes_before"] for it in per]
    # pickling drops the process group; the copy keeps the residuals and carries on
    state.process_group = comm.group
    clone = pickle.loads(pickle.dumps(state))
    res["pickled_pg"] = clone.process_group
    a, b = state.state_dict(), clone.state_dict()
    res["pickled_states"] = a["iteration"] == b["iteration"] and all(
        torch.equal(a["states"][k]["tensors"]["residual"], b["states"][k]["tensors"]["residual"]) for k in a["states"]
    )
    # the bucket policy: one state per group, residuals carried across DDP's bucket rebuild
    state = CompressionHookState(compressor=TopK(0.05), min_numel=64, policy="bucket")
    train_ddp(comm, "topk", 3, state=state)
    res["bucket_groups"] = sorted(len(k) for k in state.state_dict()["states"])
    return res


def test_warmup_pickling_and_bucket_policy():
    out = run_local(_state_worker, 2, op_timeout=60)
    assert out[0] == out[1]
    r = out[0]
    assert r["warmup"] == [True, True, False, False]
    assert r["pickled_pg"] is None and r["pickled_states"]
    assert r["bucket_groups"] and max(r["bucket_groups"]) > 1


def test_bad_arguments_raise_typed_errors():
    with pytest.raises(InvalidArgumentError, match="policy"):
        CompressionHookState(compressor=TopK(0.1), policy="global")
    with pytest.raises(InvalidArgumentError, match="start_iter"):
        CompressionHookState(compressor=TopK(0.1), start_iter=-1)
    with pytest.raises(ArgumentTypeError, match="Compressor"):
        CompressionHookState(compressor="topk")
    with pytest.raises(ArgumentTypeError, match="ProcessGroup"):
        CompressionHookState(process_group=3)
    with pytest.raises(ArgumentTypeError, match="CompressionHookState"):
        compression_hook(None, None)
    st = CompressionHookState(compressor=TopK(0.1))
    with pytest.raises(InvalidArgumentError, match="policy"):
        CompressionHookState(compressor=TopK(0.1), policy="bucket").load_state_dict(st.state_dict())
    with pytest.raises(InvalidArgumentError, match="saved with"):
        CompressionHookState(compressor=TopK(0.2)).load_state_dict(st.state_dict())
    with pytest.raises(InvalidArgumentError, match="state_dict"):
        st.load_state_dict({"x": 1})
    assert isinstance(CompressionHookState(compressor=None).compressor, NoCompression)


def test_bucket_policy_carries_residuals_into_new_groups():
    from torsh_kernels.parallel._engine import BucketCompressor

    e = BucketCompressor(TopK(0.1), policy="bucket")
    e.shapes = {0: (2, 3), 1: (4,), 2: (5,)}
    old = e._state((0, 1), rank=0)
    old.tensors["residual"] = torch.arange(10, dtype=torch.float32) + 1
    new = e._state((1, 2), rank=0)  # parameter 1 moved to a group with parameter 2
    assert new.tensors["residual"].tolist() == [7.0, 8.0, 9.0, 10.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    e._used = {(1, 2)}
    e.end_iteration()
    assert list(e.states) == [(1, 2)]


def _versus_torch_fp16_worker(comm):
    """One backward per hook on the same model and batch; what the hook waits for and issues, counted."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from torsh_kernels.collectives.communicator import TorchCommunicator, _TorchHandle
    from torsh_kernels.compression import FP16

    inside = [False]
    counts = {"wait": 0, "all_reduce": 0, "all_gather": 0, "buckets": 0, "pending_at_return": 0}
    orig = {n: getattr(TorchCommunicator, n) for n in ("all_reduce", "all_gather")}
    orig_wait = _TorchHandle.wait

    def counting(name):
        def f(self, *a, **kw):
            if inside[0]:
                counts[name] += 1
            return orig[name](self, *a, **kw)

        return f

    def wait(self):
        if inside[0]:
            counts["wait"] += 1
        return orig_wait(self)

    TorchCommunicator.all_reduce, TorchCommunicator.all_gather = counting("all_reduce"), counting("all_gather")
    _TorchHandle.wait = wait

    def counted(state, bucket):
        inside[0] = True
        try:
            fut = compression_hook(state, bucket)
        finally:
            inside[0] = False
        counts["buckets"] += 1
        counts["pending_at_return"] += not fut.done()
        return fut

    counted.__annotations__ = compression_hook.__annotations__

    def grads(hook, state, **kw):
        net = model()
        ddp = DDP(net, bucket_cap_mb=CAP_MB, **kw)
        ddp.register_comm_hook(state, hook)
        for k in counts:
            counts[k] = 0
        for step in range(2):  # the second step runs on DDP's rebuilt buckets
            x, y = batch(step, comm.rank)
            ddp.zero_grad()
            nn.functional.cross_entropy(ddp(x), y).backward()
        return [p.grad.clone() for p in net.parameters()], dict(counts)

    try:
        theirs, _ = grads(default_hooks.fp16_compress_hook, None)
        ours, c16 = grads(counted, CompressionHookState(compressor=FP16(), min_numel=64))
        ours_view, _ = grads(counted, CompressionHookState(compressor=FP16()), gradient_as_bucket_view=True)
        _, ctopk = grads(counted, CompressionHookState(compressor=TopK(0.05), min_numel=64))
        _, cpsgd = grads(counted, CompressionHookState(compressor=make("powersgd"), min_numel=64))
    finally:
        TorchCommunicator.all_reduce, TorchCommunicator.all_gather = orig["all_reduce"], orig["all_gather"]
        _TorchHandle.wait = orig_wait
    same = all(torch.equal(a, b) for a, b in zip(ours, theirs))
    same_view = all(torch.equal(a, b) for a, b in zip(ours_view, theirs))
    return same, same_view, c16, ctopk, cpsgd


@pytest.mark.parametrize("world_size", [2, 3])
def test_fp16_hook_equals_pytorch_fp16_compress_hook_and_returns_the_collectives_future(world_size):
    # Bitwise: both send fp16(fp16(g) / world_size) for the whole bucket, biases included, in one
    # all-reduce of the same buffer (so even gloo's ring sums in the same order on 3 ranks), and decode
    # with an exact fp16 -> fp32 copy.
    out = run_local(_versus_torch_fp16_worker, world_size, op_timeout=60)
    for same, same_view, c16, ctopk, cpsgd in out:
        assert same and same_view
        b = c16["buckets"]
        assert b > 2, "expected several buckets"
        # one collective per bucket, issued and not waited for inside the hook
        assert (c16["all_reduce"], c16["all_gather"], c16["wait"]) == (b, 0, 0)
        # top-k: the bucket's 1-D / small tensors in one all-reduce, the top-k payloads in one all-gather
        assert ctopk["wait"] == 0 and ctopk["all_gather"] == ctopk["buckets"]
        assert ctopk["all_reduce"] <= ctopk["buckets"]
        # PowerSGD has two rounds: the deterministic pipeline steps (waits) inside the hook
        assert cpsgd["wait"] > 0


def _plain_rides_along_worker(comm):
    """Every bucket one Linear layer (weight compressed, bias not): the collectives the hook issues per
    bucket once the states are warm, and the averaged gradients against the per-parameter reference."""
    from torsh_kernels.collectives.communicator import TorchCommunicator

    counts = {"all_reduce": 0, "all_gather": 0, "broadcast": 0}
    orig = {n: getattr(TorchCommunicator, n) for n in counts}

    def counting(name):
        def f(self, *a, **kw):
            counts[name] += 1
            return orig[name](self, *a, **kw)

        return f

    def net_of():
        torch.manual_seed(7)
        return nn.Sequential(nn.Linear(40, 40), nn.ReLU(), nn.Linear(40, 40), nn.ReLU(), nn.Linear(40, 40))

    out = {}
    for name in ("topk", "powersgd"):
        net = net_of()
        # 1600 + 40 elements per layer: DDP closes a bucket once it reaches 1625, so one layer per bucket
        ddp = DDP(net, bucket_cap_mb=1625 * 4 / 2**20)
        state = CompressionHookState(compressor=make(name), min_numel=64)
        ddp.register_comm_hook(state, compression_hook)
        ref = net_of()
        ref_states = {}
        per_step = []
        for step in range(3):
            x, y = helpers.batch(step, comm.rank, rows=24, features=40, classes=40)
            for k in counts:
                counts[k] = 0
            for n in counts:
                setattr(TorchCommunicator, n, counting(n))
            try:
                ddp.zero_grad()
                nn.functional.cross_entropy(ddp(x), y).backward()
            finally:
                for n in counts:
                    setattr(TorchCommunicator, n, orig[n])
            per_step.append(dict(counts, buckets=state.stats.buckets - sum(c["buckets"] for c in per_step)))
            # the reference: each weight through compressed_all_reduce with its own state, biases plainly
            ref.zero_grad()
            nn.functional.cross_entropy(ref(x), y).backward()
            for i, p in enumerate(ref.parameters()):
                k = state._keys[id(list(net.parameters())[i])]
                if state._engine.eligible(p.grad):
                    st = ref_states.setdefault(k, state.compressor.new_state(seed=(comm.rank * 1_000_003 + k)))
                    compressed_all_reduce(p.grad, comm, state.compressor, st)
                else:
                    compressed_all_reduce(p.grad, comm)
            same = all(torch.equal(a.grad, b.grad) for a, b in zip(net.parameters(), ref.parameters()))
            per_step[-1]["same"] = same
        out[name] = per_step
    return out


def test_uncompressed_tensors_ride_in_the_compressed_collective():
    # a bucket's bias travels in top-k's all-gather and in PowerSGD's P all-reduce: no collective of its
    # own (one collective per bucket for top-k; for PowerSGD, bucket i's P and bucket i-1's Q coalesced
    # into one all-reduce, so buckets + 1); the results are those of averaging it on its own (bit for bit
    # on 2 ranks). DDP's first iteration has one bucket, the rebuilt layout three.
    out = run_local(_plain_rides_along_worker, 2, op_timeout=60)
    for res in out:
        assert [s["buckets"] for s in res["topk"]] == [1, 3, 3]
        for s in res["topk"]:
            assert s["same"] and (s["all_reduce"], s["all_gather"], s["broadcast"]) == (0, s["buckets"], 0)
        assert [s["buckets"] for s in res["powersgd"]] == [1, 3, 3]
        for i, s in enumerate(res["powersgd"]):
            assert s["same"] and (s["all_reduce"], s["all_gather"]) == (s["buckets"] + 1, 0)
            assert s["broadcast"] == (i == 0)  # the fresh states' Q seeds, in one broadcast


@pytest.mark.parametrize("name, ws, bias, rides", [
    ("topk", 2, 20_000, True), ("topk", 4, 20_000, False), ("topk", 4, 1_000, True), ("topk", 64, 1_000, False),
    ("powersgd", 64, 20_000, True),
])  # fmt: skip
def test_uncompressed_tensors_ride_in_an_all_gather_only_while_cheap(name, ws, bias, rides):
    # an all-gather carries them to every rank: (ws - 2) x their bytes more than their own all-reduce, so they
    # ride only below GATHER_PLAIN_BYTES of that; an all-reduce (PowerSGD's P) carries them at any size
    from torsh_kernels.collectives.replica import ReplicaCommunicator
    from torsh_kernels.parallel._engine import GATHER_PLAIN_BYTES, BucketCompressor

    assert ((ws - 2) * 4 * bias <= GATHER_PLAIN_BYTES or ws <= 2 or name == "powersgd") == rides
    eng = BucketCompressor(make_compressor(name), start_iter=0, min_numel=16)
    gen = torch.Generator().manual_seed(ws + bias)
    grads = [torch.randn(64, 32, generator=gen), torch.randn(bias, generator=gen)]
    want = [g.clone() for g in grads]  # every replica holds this rank's values: the average is the value
    for _ in range(2):  # the second step reuses the bucket's plan
        comm = ReplicaCommunicator(ws)
        reductions, finish = eng.start(grads, [0, 1], comm)
        for r in reductions:
            r.wait()
        if finish is not None:
            finish()
        kinds = [r.collective for r in comm.rounds if r.nbytes]
        assert kinds.count("all_gather") == (name == "topk")
        assert kinds.count("all_reduce") == (2 if name == "powersgd" else 0) + (not rides)
        torch.testing.assert_close(grads[1], want[1], rtol=1e-6, atol=0)
        grads[1].copy_(want[1])


def _given_comm_worker(comm) -> bool:
    """CompressionHookState given a Communicator object (the generic path CupyNcclCommunicator and
    RdmaCommunicator take; here gloo's TorchCommunicator) trains exactly as one given the group."""
    from torsh_kernels.collectives import TorchCommunicator

    grads = []
    for given in (None, TorchCommunicator()):
        torch.manual_seed(0)
        model = DDP(nn.Sequential(nn.Linear(40, 60), nn.ReLU(), nn.Linear(60, 3)))
        model.register_comm_hook(CompressionHookState(given, TopK(0.1), min_numel=0), compression_hook)
        gen = torch.Generator().manual_seed(comm.rank)
        for _ in range(3):
            model.zero_grad()
            model(torch.randn(8, 40, generator=gen)).square().mean().backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    with pytest.raises(InvalidArgumentError):
        CompressionHookState(TorchCommunicator(), mesh_dim="dp")
    return torch.equal(grads[0], grads[1])


def test_hook_over_a_given_communicator():
    assert run_local(_given_comm_worker, 2, op_timeout=60) == [True, True]
