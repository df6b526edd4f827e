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
from torsh_kernels.errors import (
    ArgumentTypeError,
    CollectiveMismatchError,
    InvalidArgumentError,
    LayoutMismatchError,
    NonFiniteError,
    ShapeError,
)
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


ALL = ["none", "fp16", "bf16", "topk", "int8", "int4", "fp8", "sign", "powersgd"]


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
BOUNDS = {"none": 1e-5, "fp16": 2e-3, "bf16": 3e-2, "int8": 0.03, "int4": 0.1, "fp8": 0.05, "topk": 0.7, "sign": 0.5,
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
    with pytest.raises(InvalidArgumentError, match="ratio"):  # a name: top-k's needs its ratio
        CompressionHookState(compressor="topk")
    with pytest.raises(ArgumentTypeError, match="Compressor"):
        CompressionHookState(compressor=3)
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
    from torsh_kernels.parallel.engine import BucketCompressor

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

    from torsh_kernels.collectives.communicator import TorchCommunicator, TorchHandle
    from torsh_kernels.compression import FP16

    inside = [False]
    counts = {"wait": 0, "all_reduce": 0, "all_gather": 0, "buckets": 0, "pending_at_return": 0}
    layouts = set()  # the bucket layouts the hook saw: one signature exchange each
    orig = {n: getattr(TorchCommunicator, n) for n in ("all_reduce", "all_gather")}
    orig_wait = TorchHandle.wait

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
    TorchHandle.wait = wait

    def counted(state, bucket):
        inside[0] = True
        try:
            fut = compression_hook(state, bucket)
        finally:
            inside[0] = False
        counts["buckets"] += 1
        counts["pending_at_return"] += not fut.done()
        layouts.add(tuple(id(p) for p in bucket.parameters()))
        return fut

    counted.__annotations__ = compression_hook.__annotations__

    def grads(hook, state, **kw):
        net = model()
        ddp = DDP(net, bucket_cap_mb=CAP_MB, **kw)
        ddp.register_comm_hook(state, hook)
        for k in counts:
            counts[k] = 0
        layouts.clear()
        for step in range(2):  # the second step runs on DDP's rebuilt buckets
            x, y = batch(step, comm.rank)
            ddp.zero_grad()
            nn.functional.cross_entropy(ddp(x), y).backward()
        checks = state.stats.signature_checks if state is not None else 0
        return [p.grad.clone() for p in net.parameters()], dict(counts, layouts=len(layouts), signature_checks=checks)

    try:
        theirs, _ = grads(default_hooks.fp16_compress_hook, None)
        ours, c16 = grads(counted, CompressionHookState(compressor=FP16(), min_numel=64))
        ours_view, _ = grads(counted, CompressionHookState(compressor=FP16()), gradient_as_bucket_view=True)
        _, ctopk = grads(counted, CompressionHookState(compressor=TopK(0.05), min_numel=64))
        _, cpsgd = grads(counted, CompressionHookState(compressor=make("powersgd"), min_numel=64))
    finally:
        TorchCommunicator.all_reduce, TorchCommunicator.all_gather = orig["all_reduce"], orig["all_gather"]
        TorchHandle.wait = orig_wait
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
        # one signature exchange (a blocking all-gather) per bucket layout, the first time it is seen (DDP's
        # first layout, then its rebuilt one), and nothing else per layout
        for c in (c16, ctopk, cpsgd):
            assert c["signature_checks"] == c["layouts"] > 1
        n = c16["signature_checks"]
        # then one collective per bucket, issued and not waited for inside the hook
        assert (c16["all_reduce"], c16["all_gather"], c16["wait"]) == (b, n, n)
        # top-k: the bucket's 1-D / small tensors in one all-reduce, the top-k payloads in one all-gather
        assert ctopk["wait"] == n and ctopk["all_gather"] == ctopk["buckets"] + n
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
            per_step.append(
                dict(
                    counts,
                    buckets=state.stats.buckets - sum(c["buckets"] for c in per_step),
                    exchanges=state.stats.signature_checks - sum(c["exchanges"] for c in per_step),
                )
            )
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
    # on 2 ranks). DDP's first iteration has one bucket, the rebuilt layout three: each new layout costs one
    # signature exchange (an all-gather) the first time, none later.
    out = run_local(_plain_rides_along_worker, 2, op_timeout=60)
    for res in out:
        assert [s["buckets"] for s in res["topk"]] == [1, 3, 3]
        assert [s["exchanges"] for s in res["topk"]] == [1, 3, 0]
        for s in res["topk"]:
            assert s["same"] and (s["all_reduce"], s["all_gather"], s["broadcast"]) == (
                0,
                s["buckets"] + s["exchanges"],
                0,
            )
        assert [s["buckets"] for s in res["powersgd"]] == [1, 3, 3]
        assert [s["exchanges"] for s in res["powersgd"]] == [1, 3, 0]
        for i, s in enumerate(res["powersgd"]):
            assert s["same"] and (s["all_reduce"], s["all_gather"]) == (s["buckets"] + 1, s["exchanges"])
            assert s["broadcast"] == (i == 0)  # the fresh states' Q seeds, in one broadcast


@pytest.mark.parametrize("name, ws, bias, rides", [
    ("topk", 2, 20_000, True), ("topk", 4, 20_000, False), ("topk", 4, 1_000, True), ("topk", 64, 1_000, False),
    ("powersgd", 64, 20_000, True),
])  # fmt: skip
def test_uncompressed_tensors_ride_in_an_all_gather_only_while_cheap(name, ws, bias, rides):
    # an all-gather carries them to every rank: (ws - 2) x their bytes more than their own all-reduce, so they
    # ride only below GATHER_PLAIN_BYTES of that; an all-reduce (PowerSGD's P) carries them at any size
    from torsh_kernels.collectives.replica import ReplicaCommunicator
    from torsh_kernels.parallel.buckets import GATHER_PLAIN_BYTES
    from torsh_kernels.parallel.engine import BucketCompressor

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
    # ranks whose hooks differ: every rank raises from backward, naming the difference, before the bucket's
    # collectives (the signature exchange of its first layout)
    model = DDP(nn.Sequential(nn.Linear(40, 60), nn.ReLU(), nn.Linear(60, 3)))
    model.register_comm_hook(CompressionHookState(None, TopK(0.2 if comm.rank else 0.1)), compression_hook)
    try:
        model(torch.randn(8, 40)).sum().backward()
        mismatch = None
    except CollectiveMismatchError as e:
        mismatch = str(e)
    return torch.equal(grads[0], grads[1]), mismatch


def test_hook_over_a_given_communicator():
    out = run_local(_given_comm_worker, 2, op_timeout=60)
    for same, mismatch in out:
        assert same
        assert mismatch == out[0][1] and "compressor.ratio: 0.1 on rank 0, 0.2 on rank 1" in mismatch, mismatch


# -- where PyTorch users are: compiled autograd, sparse gradients, AMP, PowerSGD's matrix view ---------------


def _compiled_worker(comm, names, mode):
    """Each compressor under torch.compile: ``mode="python_reducer"`` with compiled autograd (the hook gets
    ``(param.grad, param)``), ``"ddp_optimizer"`` (the default: the C++ reducer, GradBuckets); against the
    eager reference loop."""
    import torch._dynamo

    torch._dynamo.config.optimize_ddp = mode
    out = {}
    for name in names:
        torch._dynamo.reset()
        net = model()
        # (DDPOptimizer wants the first bucket no larger than the others: DDP's default caps here)
        ddp = DDP(net, bucket_cap_mb=CAP_MB) if mode == "python_reducer" else DDP(net)
        state = CompressionHookState(compressor=make(name), min_numel=64)
        ddp.register_comm_hook(state, compression_hook)
        compiled = torch.compile(ddp, backend="eager")
        opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
        for step in range(STEPS):
            x, y = batch(step, comm.rank)
            opt.zero_grad()
            loss = nn.functional.cross_entropy(compiled(x), y)
            if mode == "python_reducer":
                with torch._dynamo.compiled_autograd._enable(torch.compile(backend="eager")):
                    loss.backward()
            else:
                loss.backward()
            opt.step()
        ref = train_reference(comm, state, list(net.parameters()), STEPS)
        diff = max((a - b).abs().max().item() for a, b in zip(net.parameters(), ref.parameters()))
        moved = max((a - b).abs().max().item() for a, b in zip(net.parameters(), model().parameters()))
        params = [p.detach().clone() for p in net.parameters()]
        iteration = state.iteration  # (closes the per-parameter form's last backward pass)
        out[name] = (diff, moved, state.stats.iterations, iteration, params)
    return out


@pytest.mark.slow  # torch.compile of DDP on 2 ranks for every compressor (python_reducer about a minute)
@pytest.mark.parametrize("mode", ["python_reducer", "ddp_optimizer"])
def test_every_compressor_under_torch_compile_and_compiled_autograd(mode):
    # compiled autograd recompiles per compressor (about 6 s each here): one of each family there (bf16 is fp16's
    # cast, int4 int8's quantizer); DDPOptimizer's mode runs all of them
    names = [n for n in ALL if n not in ("bf16", "int4")] if mode == "python_reducer" else ALL
    out = run_local(_compiled_worker, 2, names, mode, op_timeout=120)
    for name in names:
        diff, moved, iterations, iteration, params = out[0][name]
        assert moved > 1e-3, f"{name}: training did not move the parameters"
        # the same per-parameter compression as the eager reference loop (a compiled forward and backward may
        # round differently from the eager one: float tolerance, scaled by how far training moved)
        assert diff <= 1e-4 * max(1.0, moved), f"{name} under {mode}: differs from the reference by {diff}"
        assert all(torch.equal(a, b) for a, b in zip(params, out[1][name][4])), f"{name}: replicas differ"
        # per parameter (python_reducer): an iteration is a backward pass, closed by the next one or by reading
        # state.iteration between passes
        assert (iterations, iteration) == (STEPS, STEPS)


def test_parameter_call_form_rejects_what_is_not_a_gradient_and_its_parameter():
    st = CompressionHookState(compressor=TopK(0.1))
    with pytest.raises(ArgumentTypeError, match=r"GradBucket or a \(gradient, parameter\) pair"):
        compression_hook(st, (torch.zeros(3),))
    with pytest.raises(ArgumentTypeError, match=r"GradBucket or a \(gradient, parameter\) pair"):
        compression_hook(st, (torch.zeros(3), "w"))


def _sparse_train(comm, name, steps):
    net = helpers.SparseNet()
    ddp = DDP(net, bucket_cap_mb=CAP_MB)
    state = None
    if name != "plain":
        state = CompressionHookState(compressor=make(name), min_numel=64)
        ddp.register_comm_hook(state, compression_hook)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for step in range(steps):
        ids, bag, y = helpers.sparse_batch(step, comm.rank)
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(ids, bag), y).backward()
        opt.step()
    return net, state


def _sparse_worker(comm, names):
    out = {}
    one_plain, _ = _sparse_train(comm, "plain", 1)
    for name in names:
        one, state = _sparse_train(comm, name, 1)
        # after one step the embeddings' gradients depend only on the initial weights: equal to plain DDP's
        sparse_equal = torch.equal(one.emb.weight, one_plain.emb.weight) and torch.equal(
            one.bag.weight, one_plain.bag.weight
        )
        net, state = _sparse_train(comm, name, 4)
        out[name] = (sparse_equal, [p.detach().clone() for p in net.parameters()], state.stats.as_dict())
    return out


def test_sparse_gradients_go_through_uncompressed_for_every_compressor():
    names = [n for n in ALL if n != "none"]
    out = run_local(_sparse_worker, 2, names, op_timeout=120)
    for name in names:
        sparse_equal, params, stats = out[0][name]
        assert sparse_equal, f"{name}: the sparse embeddings differ from plain DDP's after one step"
        assert all(torch.equal(a, b) for a, b in zip(params, out[1][name][1])), f"{name}: replicas diverged"
        assert stats["sparse_buckets"] == 2 * 4, stats  # two sparse parameters, four steps
        assert stats["iterations"] == 4


def _powersgd_versus_torch_worker(comm):
    """PyTorch's powerSGD_hook and ours, rank 1, no size rule, on [n, 1] and [1, n] weights: a rank-1
    approximation of those views is exact, so both follow plain DDP (the old padded near-square view lost it)."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

    from torsh_kernels.compression import PowerSGD

    def net():
        torch.manual_seed(5)
        return nn.Sequential(nn.Linear(1, 96, bias=False), nn.Tanh(), nn.Linear(96, 1, bias=False))

    def run(hook, state):
        m = net()
        ddp = DDP(m)
        if hook is not None:
            ddp.register_comm_hook(state, hook)
        opt = torch.optim.SGD(m.parameters(), lr=0.05)
        for step in range(5):
            g = torch.Generator().manual_seed(step * 13 + comm.rank)
            x = torch.randn(32, 1, generator=g)
            opt.zero_grad()
            ((ddp(x) - torch.sin(3 * x)) ** 2).mean().backward()
            opt.step()
        return [p.detach().clone() for p in m.parameters()]

    plain = run(None, None)
    theirs = run(psgd.powerSGD_hook, psgd.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                                         start_powerSGD_iter=2, min_compression_rate=0))  # fmt: skip
    ours_state = CompressionHookState(compressor=PowerSGD(1, min_compression_rate=0.0), start_iter=2, min_numel=0)
    ours = run(compression_hook, ours_state)
    # both weights went through P and Q (more bytes than the tensor for [n, 1]: the size rule is off)
    compressed = sorted(tuple(s["tensors"]["q"].shape) for s in ours_state.state_dict()["states"].values())
    return plain, theirs, ours, compressed


def test_powersgd_views_column_and_row_weights_as_pytorch_does():
    out = run_local(_powersgd_versus_torch_worker, 2, op_timeout=60)
    plain, theirs, ours, compressed = out[0]
    assert compressed == [(1, 1), (96, 1)]  # Q of the [96, 1] view is 1 x 1, of the [1, 96] view 96 x 1
    assert [tuple(p.shape) for p in ours] == [(96, 1), (1, 96)]
    for a, b, c in zip(ours, theirs, plain):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(a, c, atol=1e-5, rtol=1e-4)


def _same_state(a: dict, b: dict) -> bool:
    """Two hook state_dicts hold the same iteration count and bit-identical compressor states."""
    if a["iteration"] != b["iteration"] or a["states"].keys() != b["states"].keys():
        return False
    for k, sa in a["states"].items():
        sb = b["states"][k]
        if (sa["step"], sa["seed"]) != (sb["step"], sb["seed"]) or sa["tensors"].keys() != sb["tensors"].keys():
            return False
        if not all(torch.equal(t, sb["tensors"][n]) for n, t in sa["tensors"].items()):
            return False
    return True


AMP_STEPS = 9
POISONED_STEP = 5  # rank 1 alone gets an inf input: only its gradients overflow


def _amp_train(comm, hook, state):
    """fp16 autocast + GradScaler; the first steps overflow (a huge initial scale), and one step overflows on
    rank 1 only. Returns the parameters, per step whether the scaler skipped it and whether the hook's state
    was left as it was."""
    net = model()
    ddp = DDP(net, bucket_cap_mb=CAP_MB)
    ddp.register_comm_hook(state, hook)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24, growth_interval=3)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    skipped, kept = [], []
    for step in range(AMP_STEPS):
        x, y = batch(step, comm.rank)
        if step == POISONED_STEP and comm.rank == 1:
            x[3, 5] = float("inf")
        before = state.state_dict() if isinstance(state, CompressionHookState) else None
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.cross_entropy(ddp(x), y)
        scale = scaler.get_scale()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        skipped.append(scaler.get_scale() < scale)
        if before is not None:
            kept.append(_same_state(before, state.state_dict()))
    return [p.detach().clone() for p in net.parameters()], skipped, kept


def _amp_worker(comm, names):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from torsh_kernels.parallel.engine import BucketCompressor

    out = {"auto_without_scaler": BucketCompressor(TopK(0.1)).mode()}
    out["torch_fp16"] = _amp_train(comm, default_hooks.fp16_compress_hook, None)
    for name in names:
        state = CompressionHookState(compressor=make(name), min_numel=64)
        params, skipped, kept = _amp_train(comm, compression_hook, state)
        out[name] = (params, skipped, kept, state._engine.mode(), state.stats.as_dict(), state.iteration)
    return out


def test_amp_grad_scaler_skips_overflow_steps_and_the_hook_state_is_left_as_before():
    names = ["fp16", "bf16", "topk", "int8", "int4", "sign", "powersgd"]
    out = run_local(_amp_worker, 2, names, op_timeout=120)
    assert out[0]["auto_without_scaler"] == "raise"
    torch_params, torch_skipped, _ = out[0]["torch_fp16"]
    assert torch_skipped[0] and torch_skipped[POISONED_STEP] and not all(torch_skipped), torch_skipped
    for name in names:
        params, skipped, kept, mode, stats, iteration = out[0][name]
        assert mode == "propagate"  # nonfinite="auto" with an enabled GradScaler
        # every rank received the overflow, so the scaler skipped the same steps as with PyTorch's hook
        assert skipped == torch_skipped == out[1][name][1], f"{name}: skipped {skipped}, torch {torch_skipped}"
        assert all(torch.equal(a, b) for a, b in zip(params, out[1][name][0])), f"{name}: replicas differ"
        stateful = name not in ("fp16", "bf16")
        if stateful:
            # a skipped step leaves residuals, PowerSGD's Q, step counts and the iteration count as they were
            assert [k for k, s in zip(kept, skipped) if s] == [True] * sum(skipped), f"{name}: state changed"
            assert stats["nonfinite_steps"] == sum(skipped) and iteration == AMP_STEPS - sum(skipped)
            assert not all(kept), f"{name}: the state never changed"
        if name == "fp16":  # the same parameters as PyTorch's fp16 hook through the same overflow steps
            for a, b in zip(params, torch_params):
                torch.testing.assert_close(a, b, atol=2e-3, rtol=2e-3)


def _raise_worker(comm):
    state = CompressionHookState(compressor=TopK(0.05), min_numel=64, nonfinite="raise")
    net = model()
    ddp = DDP(net, bucket_cap_mb=CAP_MB)
    ddp.register_comm_hook(state, compression_hook)
    x, y = batch(0, comm.rank)
    x[0, 0] = float("nan")
    try:
        nn.functional.cross_entropy(ddp(x), y).backward()
    except Exception as e:  # DDP re-raises the hook's error as it finds it
        return type(e).__name__, "non-finite" in str(e)
    return None


def test_nonfinite_raise_keeps_the_typed_error():

    out = run_local(_raise_worker, 2, op_timeout=60)
    assert out == [(NonFiniteError.__name__, True)] * 2
    with pytest.raises(InvalidArgumentError, match="nonfinite"):
        CompressionHookState(compressor=TopK(0.1), nonfinite="ignore")


def _auto_propagate_worker(comm):
    state = CompressionHookState(compressor="auto", auto_candidates=[TopK(0.1)], start_iter=1, min_numel=64,
                                 nonfinite="propagate")  # fmt: skip
    net = model()
    ddp = DDP(net, bucket_cap_mb=CAP_MB)
    ddp.register_comm_hook(state, compression_hook)
    for step in range(3):
        x, y = batch(step, comm.rank)
        if step == 1 and comm.rank == 1:  # the step where "auto" makes its choice
            x[2, 2] = float("nan")
        net.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        if step == 1:
            nonfinite_grads = any(not torch.isfinite(p.grad).all() for p in net.parameters())
    sd = state.state_dict()
    finite = all(torch.isfinite(t).all() for s in sd["states"].values() for t in s["tensors"].values())
    return state.stats.nonfinite_steps, nonfinite_grads, finite, len(sd["states"]), sd["iteration"]


def test_auto_choice_and_propagate_screen_the_bucket_where_the_choice_is_made():
    out = run_local(_auto_propagate_worker, 2, op_timeout=60)
    assert out[0] == out[1]
    nonfinite_steps, nonfinite_grads, finite, states, iteration = out[0]
    assert nonfinite_steps == 1 and nonfinite_grads and finite and states > 0 and iteration == 2


def _wire_worker(comm, names, tmp):
    from torsh_kernels.profiling import timeline
    from torsh_kernels.profiling.report import build
    from torsh_kernels.profiling.traces import load

    rec = timeline.Recorder(tmp, rank=comm.rank, world_size=comm.world_size)
    counts = {}
    for k, name in enumerate(names):
        torch.manual_seed(0)
        ddp = DDP(model(), bucket_cap_mb=0.001)
        state = CompressionHookState(compressor=make(name), start_iter=1)
        ddp.register_comm_hook(state, compression_hook)
        for i in range(4):
            if i == 2:
                rec.start()
            with timeline.step(4 * k + i, label=name):
                ddp(torch.randn(6, 37)).square().sum().backward()
        rec.stop()
        its = state.stats.per_iteration
        counts[name] = ([it["wire_bytes"] for it in its], [it["bytes_after"] for it in its])
    rec.write()
    comm.barrier()
    return counts, build(load(tmp))


def test_hook_counts_wire_bytes_as_the_timeline_does(tmp_path):
    """Two paths to one figure at world 3, where an all-reduce's wire bytes (4/3 of its payload) and an
    all-to-all's (2/3) differ from the payload: the hook reads its communicator's Traffic counters, the
    trace sums its collective spans; both use collectives.wire_bytes."""
    names = ["none", "sign", "powersgd"]
    out = run_local(_wire_worker, 3, names, str(tmp_path), op_timeout=60)
    counts, rep = out[0]
    for name in names:
        wire, payload = counts[name]
        # every rank sends alike in the traced steps (PowerSGD's first compressed step also broadcasts its
        # seeds from rank 0, which only rank 0 sends)
        assert [o[0][name][0][2:] for o in out] == [wire[2:]] * 3
        assert rep["by_label"][name]["wire_bytes_per_step"] == sum(wire[2:]) / 2 and wire[-1] > 0
        if name == "none":  # all-reduces only: 4/3 of the payload, each bucket's share rounded down
            assert 4 * payload[-1] / 3 - 16 <= wire[-1] <= 4 * payload[-1] / 3


# -- checkpoints that do not fit: a typed error, and the state exactly as before ------------------------------


def _owner(kind: str):
    """A hook state or a synchronizer with two iterations of top-k states (one process, a replica of 2 ranks)."""
    from torsh_kernels.collectives.replica import ReplicaCommunicator
    from torsh_kernels.parallel import GradientSynchronizer

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(12, 24), nn.ReLU(), nn.Linear(24, 3))
    if kind == "sync":
        owner = GradientSynchronizer(net, ReplicaCommunicator(2), compressor=TopK(0.1), min_numel=16, overlap=False)
        for _ in range(2):
            net(torch.randn(4, 12)).sum().backward()
            owner.sync_gradients()
            owner.zero_grad()
        return owner
    owner = CompressionHookState(compressor=TopK(0.1), min_numel=16)
    eng, comm = owner._engine, ReplicaCommunicator(2)
    for _ in range(2):  # what the hook does per bucket, without DDP
        grads = [torch.randn_like(p) for p in net.parameters()]
        for r in eng.start(grads, list(range(len(grads))), comm)[0]:
            r.wait()
        eng.end_iteration()
    return owner


def _spoil_residual(sd, n):
    """A residual of n zeros, the state's checksum dropped (as a state saved before checksums were): the size check."""
    (k, st), *_ = ((k, v) for k, v in sd["states"].items() if "residual" in v["tensors"])
    st = {n_: v for n_, v in st.items() if n_ != "checksum"}
    return {**sd, "states": {**sd["states"], k: {**st, "tensors": {**st["tensors"], "residual": torch.zeros(n)}}}}


def _flip_a_byte(sd):
    """One byte of a saved residual changed, the checksum kept: a damaged file."""
    (k, st), *_ = ((k, v) for k, v in sd["states"].items() if "residual" in v["tensors"])
    r = st["tensors"]["residual"].clone()
    r.view(torch.uint8)[5] ^= 0x10
    return {**sd, "states": {**sd["states"], k: {**st, "tensors": {**st["tensors"], "residual": r}}}}


def _other_kind(sd):
    (k, st), *_ = sd["states"].items()
    return {**sd, "states": {**sd["states"], k: {**st, "kind": "PowerSGD"}}}


def _nan_residual(sd):
    (k, st), *_ = ((k, v) for k, v in sd["states"].items() if "residual" in v["tensors"])
    r = st["tensors"]["residual"].clone()
    r[0] = float("nan")
    st = {n_: v for n_, v in st.items() if n_ != "checksum"}
    return {**sd, "states": {**sd["states"], k: {**st, "tensors": {**st["tensors"], "residual": r}}}}


BAD_CHECKPOINTS = [
    (lambda sd: None, ArgumentTypeError),
    (lambda sd: [sd], ArgumentTypeError),
    (lambda sd: {k: v for k, v in sd.items() if k != "states"}, InvalidArgumentError),
    (lambda sd: {**sd, "extra": 1}, InvalidArgumentError),
    (lambda sd: {**sd, "policy": "bucket"}, InvalidArgumentError),
    (lambda sd: {**sd, "iteration": "2"}, ArgumentTypeError),
    (lambda sd: {**sd, "iteration": True}, ArgumentTypeError),
    (lambda sd: {**sd, "iteration": 2.0}, ArgumentTypeError),
    (lambda sd: {**sd, "iteration": -1}, InvalidArgumentError),
    (lambda sd: {**sd, "compressor": "TopK(ratio=0.5)"}, InvalidArgumentError),
    (lambda sd: {**sd, "compressor": None}, ArgumentTypeError),
    (lambda sd: {**sd, "auto": {"choice": "topk(0.1)"}}, InvalidArgumentError),  # not an auto state
    (lambda sd: {**sd, "shapes": [(24, 12)]}, ArgumentTypeError),
    (lambda sd: {**sd, "shapes": {**sd["shapes"], "0": (24, 12)}}, ArgumentTypeError),
    (lambda sd: {**sd, "shapes": {**sd["shapes"], 0: (24.0, 12)}}, ArgumentTypeError),
    (lambda sd: {**sd, "shapes": {**sd["shapes"], 0: (12, 24)}}, LayoutMismatchError),  # not the model it has seen
    (lambda sd: {**sd, "states": list(sd["states"].values())}, ArgumentTypeError),
    (lambda sd: {**sd, "states": {**sd["states"], "w": next(iter(sd["states"].values()))}}, ArgumentTypeError),
    (lambda sd: {**sd, "states": {**sd["states"], (True,): next(iter(sd["states"].values()))}}, ArgumentTypeError),
    (lambda sd: {**sd, "states": {**sd["states"], (9,): next(iter(sd["states"].values()))}}, InvalidArgumentError),
    (lambda sd: {**sd, "states": {**sd["states"], (0,): {"step": 1}}}, InvalidArgumentError),
    (lambda sd: {**sd, "states": {**sd["states"], (0,): {"step": -1, "seed": 0, "tensors": {}}}}, InvalidArgumentError),
    (lambda sd: _spoil_residual(sd, 7), ShapeError),  # a residual of another size than its tensors
    (_flip_a_byte, InvalidArgumentError),  # a damaged file: the checksum (issue 41, item 13)
    (_other_kind, InvalidArgumentError),  # a PowerSGD state where a TopK state goes
    (_nan_residual, NonFiniteError),  # NaN in a saved residual
    (lambda sd: {**sd, "states": {**sd["states"], (0,): {"step": 1, "seed": 0, "tensors": {"residual": 0}}}},
     ArgumentTypeError),
]  # fmt: skip


@pytest.mark.parametrize("kind", ["hook", "sync"])
def test_a_checkpoint_that_does_not_fit_changes_nothing(kind):
    owner = _owner(kind)
    eng = owner._engine
    good = owner.state_dict()
    for i, (spoil, err) in enumerate(BAD_CHECKPOINTS):
        before = (eng.iteration, dict(eng.shapes), dict(eng.states), dict(eng._plans), eng.compressor)
        with pytest.raises(err):
            owner.load_state_dict(spoil(owner.state_dict()))
        after = (eng.iteration, dict(eng.shapes), dict(eng.states), dict(eng._plans), eng.compressor)
        assert all(a is b or a == b for a, b in zip(before, after)), i
        assert all(eng.states[k] is v for k, v in before[2].items()), i
    now = owner.state_dict()
    assert now["iteration"] == good["iteration"] and now["shapes"] == good["shapes"]
    for k, st in good["states"].items():
        assert all(torch.equal(v, now["states"][k]["tensors"][n]) for n, v in st["tensors"].items())
    owner.load_state_dict(good)  # the checkpoint itself loads
    assert owner.state_dict()["iteration"] == good["iteration"]


def test_an_auto_checkpoint_that_does_not_fit_changes_nothing():
    state = CompressionHookState(compressor="auto", auto_candidates=(None, TopK(0.1)))
    sd = state.state_dict()
    for bad, err in (({"choice": "int8"}, InvalidArgumentError), ({"choice": "topk(0.1)"}, InvalidArgumentError),
                     ("topk(0.1)", ArgumentTypeError), ({"choice": 3}, InvalidArgumentError)):  # fmt: skip
        with pytest.raises(err):
            state.load_state_dict({**sd, "auto": bad})
        assert state._engine.auto.decision is None and isinstance(state.compressor, NoCompression)


def _cross_rank_load(comm):
    """Each rank trains, then loads the other rank's hook state (what one shared checkpoint file does)."""
    _, _, state = train_ddp(comm, "topk", 3)
    mine = state.state_dict()
    import torch.distributed as dist

    theirs = [None] * comm.world_size
    dist.all_gather_object(theirs, mine, group=comm.group)
    fresh = CompressionHookState(compressor=make("topk"), min_numel=64)
    fresh.load_state_dict(mine)  # its own loads
    try:
        fresh.load_state_dict(theirs[1 - comm.rank])
    except InvalidArgumentError as e:
        return (mine["rank"], mine["world_size"], str(e))
    return (mine["rank"], mine["world_size"], "loaded")


def test_a_state_refuses_to_load_on_another_rank():
    """Residuals differ per rank, but the settings, shapes and iteration are alike: rank 1 loading rank 0's state
    (one shared checkpoint file, Accelerate's register_for_checkpointing) went through silently. A state records
    its rank and world size and refuses another's, naming both (issue 41, item 17)."""
    out = run_local(_cross_rank_load, 2, op_timeout=60)
    for rank, (saved_rank, world, msg) in enumerate(out):
        assert (saved_rank, world) == (rank, 2)
        assert f"saved by rank {1 - rank} of 2, and this process is rank {rank} of 2" in msg, msg


_LOAD_BEFORE_INIT = """
import tempfile, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torsh_kernels.compression import TopK
from torsh_kernels.errors import InvalidArgumentError
from torsh_kernels.parallel import CompressionHookState, compression_hook
states = {}
for saved in ((0, 1), (1, 2), (0, 2)):  # no group yet: whose state it is cannot be judged at load
    st = states[saved] = CompressionHookState(compressor=TopK(0.5), min_numel=1)
    sd = st.state_dict()
    assert "rank" not in sd  # nor recorded
    st.load_state_dict({**sd, "rank": saved[0], "world_size": saved[1]})
dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
for saved, st in states.items():
    model = DDP(torch.nn.Linear(4, 3))
    model.register_comm_hook(st, compression_hook)
    try:
        model(torch.randn(2, 4)).sum().backward()
        print(saved, "trained")
    except InvalidArgumentError as e:
        print(saved, "refused:", e)
"""


def test_a_state_loaded_before_the_group_is_up_is_checked_at_the_first_backward():
    """Loaded before init_process_group the hook cannot know this process's rank: it checks the saved one against
    the group (here rank 0 of 1) when the first backward makes its communicator, before any residual is used."""
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-c", _LOAD_BEFORE_INIT], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    lines = p.stdout.splitlines()
    assert lines[0] == "(0, 1) trained", p.stdout
    for line, (r, w) in zip(lines[1:], ((1, 2), (0, 2)), strict=True):
        assert line.startswith(f"({r}, {w}) refused: CompressionHookState.load_state_dict: this state was saved by "
                               f"rank {r} of {w}, and this process is rank 0 of 1"), p.stdout  # fmt: skip
