"""GradientSynchronizer on real gloo processes: equal to DDP's averaged gradients (uncompressed) and to
DDP with compression_hook (compressed), overlap, unused parameters, consistency check, hooks."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from tests import helpers
from tests.helpers import MLP, assert_named_on_every_rank, count_calls
from torsh_kernels.collectives import run_local
from torsh_kernels.compression import FP8, PowerSGD, TopK
from torsh_kernels.errors import InvalidArgumentError
from torsh_kernels.parallel import CompressionHookState, GradientSynchronizer, compression_hook


def Net() -> MLP:
    return MLP(29, 53, 41, 7, side=True, seed=99)  # the side branch is used only where a rank asks for it


def batch(step: int, rank: int):
    return helpers.batch(step, rank, rows=16, features=29, classes=7, salt=(1000, 1))


def grads(m: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.clone() for n, p in m.named_parameters()}


def _equals_ddp_worker(comm, overlap, compressed):
    ddp_net, net = Net(), Net()
    ddp = DDP(ddp_net, bucket_cap_mb=0.004, find_unused_parameters=True)
    comp = {"topk": TopK(0.05), "fp8": FP8()}[compressed] if compressed else None
    if compressed:
        ddp.register_comm_hook(CompressionHookState(compressor=comp, min_numel=64), compression_hook)
    sync = GradientSynchronizer(net, comm, bucket_mb=0.004, first_bucket_mb=0.002, compressor=comp,
                                overlap=overlap, min_numel=64)  # fmt: skip
    out = []
    for step in range(3):
        x, y = batch(step, comm.rank)
        ddp_net.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        sync.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        stats = sync.sync_gradients()
        want, got = grads(ddp_net), grads(net)
        out.append(max((want[n] - got[n]).abs().max().item() for n in want if want[n] is not None))
        assert sync.check_gradient_consistency().consistent
    info = sync.get_bucket_info()
    return out, stats, [len(b["parameters"]) for b in info], info[0]["mb"]


@pytest.mark.parametrize(
    ("world_size", "overlap", "compressed"),
    [(2, True, False), (2, False, False), (3, True, False), (2, True, "topk"), (3, False, "topk"), (2, True, "fp8")],
)
def test_synchronizer_equals_ddp(world_size, overlap, compressed):
    out = run_local(_equals_ddp_worker, world_size, overlap, compressed, op_timeout=60)
    diffs, stats, sizes, first_mb = out[0]
    # 2 ranks: (a + b) / 2 is exact either way; 3: DDP divides before the sum, we after
    tol = 0.0 if world_size == 2 else 1e-6
    assert max(diffs) <= tol, diffs
    assert len(sizes) > 2 and sum(sizes) == 8
    assert first_mb <= 0.002  # DDP's first-bucket rule, here at 2 KiB
    assert stats["parameters_with_gradients"] == 6  # the side branch was never used
    assert stats["globally_unused_parameters"] == []  # find_unused_parameters is off: reported, zero-filled
    assert sorted(stats["unused_parameters"]) == ["side.bias", "side.weight"]
    assert len(stats["buckets"]) == len(sizes) and all(b["seconds"] >= 0 for b in stats["buckets"])
    if compressed:
        assert stats["payload_bytes"] < stats["bytes_before"]
    else:
        assert stats["payload_bytes"] == stats["bytes_before"]
        # the wire figure counts every collective of the step by collectives.wire_bytes: the buckets'
        # all-reduces (each rounded down on its own), nothing else here (no flags: no stateful compressor)
        per_bucket = [b["bytes_sent"] for b in stats["buckets"]]
        assert stats["bytes_on_wire"] == sum(2 * (world_size - 1) * n // world_size for n in per_bucket)


def _unused_worker(comm):
    net = Net()
    sync = GradientSynchronizer(net, comm, bucket_mb=0.004, find_unused_parameters=True)
    x, y = batch(0, comm.rank)
    # rank 0 uses the side branch, rank 1 does not: nothing hangs, rank 1 receives rank 0's half
    nn.functional.cross_entropy(net(x, side=comm.rank == 0), y).backward()
    side_local = None if net.side.weight.grad is None else net.side.weight.grad.clone()
    stats = sync.sync_gradients()
    side_avg = net.side.weight.grad.clone()
    sync.zero_grad()
    # nobody uses it: it keeps grad=None, as with DDP's find_unused_parameters
    nn.functional.cross_entropy(net(x), y).backward()
    stats2 = sync.sync_gradients()
    return side_local, side_avg, stats["unused_parameters"], stats2["globally_unused_parameters"], net.side.weight.grad


def test_unused_parameters_are_reported_not_hung_on():
    out = run_local(_unused_worker, 2, op_timeout=30)
    (loc0, avg0, unused0, glob0, g0), (loc1, avg1, unused1, glob1, g1) = out
    assert loc1 is None and sorted(unused1) == ["side.bias", "side.weight"] and unused0 == []
    torch.testing.assert_close(avg0, loc0 / 2, rtol=0, atol=0)
    assert torch.equal(avg0, avg1)
    assert sorted(glob0) == sorted(glob1) == ["side.bias", "side.weight"] and g0 is None and g1 is None


def _features_worker(comm):
    net = Net()
    sync = GradientSynchronizer(net, comm, bucket_mb=0.004)
    res = {}
    # a gradient hook sees every gradient before it is synchronised
    seen = []
    h = sync.register_gradient_hook(lambda name, g: (seen.append(name), g * 2)[1])
    x, y = batch(0, comm.rank)
    nn.functional.cross_entropy(net(x), y).backward()
    sync.sync_gradients()
    doubled = net.a.weight.grad.clone()
    h.remove()
    sync.zero_grad()
    assert not sync.has_gradients()
    nn.functional.cross_entropy(net(x), y).backward()
    assert sync.has_gradients()
    sync.sync_gradients()
    res["hook"] = (sorted(seen), torch.equal(doubled, 2 * net.a.weight.grad))
    # accumulation: two backward passes inside no_sync, then one synchronisation
    sync.zero_grad()
    with sync.no_sync():
        nn.functional.cross_entropy(net(x), y).backward()
    nn.functional.cross_entropy(net(x), y).backward()
    sync.sync_gradients()
    res["accumulated"] = torch.allclose(net.a.weight.grad, 2 * doubled / 2)
    # a second backward without sync_gradients is an error, not a silent double count
    sync.zero_grad()
    nn.functional.cross_entropy(net(x), y).backward()
    try:
        nn.functional.cross_entropy(net(x), y).backward()
        res["second"] = "no error"
    except InvalidArgumentError as e:
        res["second"] = "sync_gradients" in str(e)
    sync.zero_grad()
    # one bucket per parameter without bucketing
    sync.set_bucketing(False)
    res["unbucketed"] = len(sync.get_bucket_info())
    nn.functional.cross_entropy(net(x), y).backward()
    sync.sync_gradients()
    # a corrupted gradient on one rank is caught by the consistency check
    if comm.rank == 1:
        net.b.bias.grad[0] += 1
    res["consistency"] = sync.check_gradient_consistency().mismatched
    return res


def test_hooks_accumulation_bucketing_and_consistency():
    out = run_local(_features_worker, 2, op_timeout=30)
    for r in out:
        names = sorted(["a.weight", "a.bias", "b.weight", "b.bias", "c.weight", "c.bias"])
        assert r["hook"] == (names, True)
        assert r["accumulated"] and r["second"] is True
        assert r["unbucketed"] == 8
        assert r["consistency"] == ["b.bias"]


def _broadcast_worker(comm):
    torch.manual_seed(comm.rank)  # different initial weights on each rank
    net = nn.Linear(5, 3)
    GradientSynchronizer(net, comm)
    return net.weight.detach().clone()


def test_parameters_start_equal_and_bad_arguments_raise():
    w0, w1 = run_local(_broadcast_worker, 2, op_timeout=30)
    assert torch.equal(w0, w1)
    assert run_local(_bad_worker, 1, op_timeout=30) == [["bucket_mb", "order", "Module"]]


def _bad_worker(comm):
    out = []
    for kw, word in (({"bucket_mb": 0}, "bucket_mb"), ({"order": "random"}, "order")):
        with pytest.raises(InvalidArgumentError, match=word):
            GradientSynchronizer(nn.Linear(2, 2), comm, **kw)
        out.append(word)
    with pytest.raises(TypeError, match="Module"):
        GradientSynchronizer("model", comm)
    out.append("Module")
    return out


def _coalesced_worker(comm):
    """PowerSGD through the synchronizer, one Linear layer per bucket: the all-reduces it issues per step
    (bucket i's P with bucket i-1's Q) and the averaged gradients against the per-parameter reference
    (each weight through compressed_all_reduce with the state the synchronizer seeds, biases plainly)."""
    from torsh_kernels.collectives.communicator import TorchCommunicator
    from torsh_kernels.compression import compressed_all_reduce

    def net_of():
        torch.manual_seed(7)
        return nn.Sequential(nn.Linear(40, 40), nn.ReLU(), nn.Linear(40, 40), nn.ReLU(), nn.Linear(40, 40))

    comp = PowerSGD(rank=2, start_iter=1)
    net, ref = net_of(), net_of()
    sync = GradientSynchronizer(net, comm, bucket_mb=1640 * 4 / 2**20, first_bucket_mb=1640 * 4 / 2**20,
                                compressor=comp, min_numel=64)  # fmt: skip
    orig = TorchCommunicator.all_reduce
    calls = [0]

    def counting(self, *a, **kw):
        calls[0] += 1
        return orig(self, *a, **kw)

    out, ref_states = [], {}
    for step in range(3):
        x, y = helpers.batch(step, comm.rank, rows=24, features=40, classes=40)
        sync.zero_grad()
        calls[0] = 0
        TorchCommunicator.all_reduce = counting  # buckets start during the backward (overlap=True)
        try:
            nn.functional.cross_entropy(net(x), y).backward()
            sync.sync_gradients()
        finally:
            TorchCommunicator.all_reduce = orig
        ref.zero_grad()
        nn.functional.cross_entropy(ref(x), y).backward()
        for i, p in enumerate(ref.parameters()):
            if sync._engine.eligible(p.grad):
                st = ref_states.setdefault(i, comp.new_state(seed=(comm.rank * 1_000_003 + i) & 0x7FFFFFFF))
                compressed_all_reduce(p.grad, comm, comp, st)
            else:
                compressed_all_reduce(p.grad, comm)
        diff = max((a.grad - b.grad).abs().max().item() for a, b in zip(net.parameters(), ref.parameters()))
        out.append((calls[0], len(sync.buckets), diff))
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_multi_round_buckets_coalesce_their_rounds(world_size):
    # warm-up step: one all-reduce per bucket; then PowerSGD: P of bucket i and Q of bucket i-1 in one
    # all-reduce, so buckets + 1 per step instead of 2 x buckets, with the reference's results
    # (3 ranks: gloo sums a whole bucket and a lone tensor in different orders, so not bit for bit)
    tol = 0.0 if world_size == 2 else 1e-6
    for res in run_local(_coalesced_worker, world_size, op_timeout=60):
        (c0, b0, d0), *later = res
        assert b0 == 3 and c0 == 3 and d0 <= tol
        for c, b, d in later:
            assert c == b + 1, res  # the first compressed step too: its Q seeds go by broadcast
            assert d <= tol, d


def _dense(g):
    return None if g is None else (g.to_dense() if g.layout != torch.strided else g)


def _sparse_worker(comm, overlap, compressed):
    ddp_net, net = helpers.SparseNet(), helpers.SparseNet()
    ddp = DDP(ddp_net, bucket_cap_mb=0.004)
    comp = TopK(0.05) if compressed else None
    if compressed:
        ddp.register_comm_hook(CompressionHookState(compressor=comp, min_numel=64), compression_hook)
    sync = GradientSynchronizer(net, comm, bucket_mb=0.004, compressor=comp, overlap=overlap, min_numel=64)
    out = []
    for step in range(3):
        ids, bag, y = helpers.sparse_batch(step, comm.rank)
        ddp_net.zero_grad()
        nn.functional.cross_entropy(ddp(ids, bag), y).backward()
        sync.zero_grad()
        nn.functional.cross_entropy(net(ids, bag), y).backward()
        stats = sync.sync_gradients()
        layouts = {n: p.grad.layout for n, p in net.named_parameters()}
        want, got = grads(ddp_net), grads(net)
        out.append(max((_dense(want[n]) - _dense(got[n])).abs().max().item() for n in want))
        # the same update as DDP's, applied to both copies, keeps them comparable step after step
        for a, b in zip(ddp_net.parameters(), net.parameters()):
            a.data.add_(_dense(a.grad), alpha=-0.1)
            b.data.add_(_dense(b.grad), alpha=-0.1)
    sparse_buckets = [b for b in stats["buckets"] if b.get("sparse")]
    return out, len(sparse_buckets), layouts, [b["sparse"] for b in sync.get_bucket_info()]


@pytest.mark.parametrize(("overlap", "compressed"), [(True, False), (False, True), (True, True)])
def test_sparse_gradients_are_averaged_uncompressed_as_ddp_does(overlap, compressed):
    out = run_local(_sparse_worker, 2, overlap, compressed, op_timeout=60)
    diffs, n_sparse, layouts, bucket_sparse = out[0]
    assert max(diffs) <= (1e-6 if not compressed else 1e-5), diffs
    assert n_sparse == 2 and bucket_sparse.count(True) == 2
    assert layouts["emb.weight"] == torch.sparse_coo and layouts["bag.weight"] == torch.sparse_coo
    assert out[0][0] == out[1][0]


def _nonfinite_worker(comm):
    scaler = torch.amp.GradScaler("cpu")  # its presence makes nonfinite="auto" propagate
    net = Net()
    sync = GradientSynchronizer(net, comm, bucket_mb=0.004, compressor=TopK(0.05), min_numel=64)
    out = []
    for step in range(4):
        x, y = batch(step, comm.rank)
        if step == 2 and comm.rank == 1:
            x[0, 0] = float("inf")
        before = sync.state_dict()
        sync.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        stats = sync.sync_gradients()
        after = sync.state_dict()
        same = before["iteration"] == after["iteration"] and all(
            torch.equal(before["states"][k]["tensors"]["residual"], after["states"][k]["tensors"]["residual"])
            for k in after["states"]
        ) and before["states"].keys() == after["states"].keys()  # fmt: skip
        finite = all(torch.isfinite(p.grad).all() for p in net.parameters() if p.grad is not None)
        out.append((stats["nonfinite"], same, finite))
    return out, scaler.is_enabled()


def test_nonfinite_gradients_reach_every_rank_and_the_step_is_undone():
    out = run_local(_nonfinite_worker, 2, op_timeout=60)
    assert out[0] == out[1]
    steps, _ = out[0]
    # step 0 makes the states (so they differ from the empty ones before it); step 2 is rank 1's inf
    assert steps == [(False, False, True), (False, False, True), (True, True, False), (False, False, True)]


def test_sync_stats_are_a_dict_that_prints_one_line():
    """sync_gradients() / get_sync_stats() return every figure as before (a dict), printed as one short line
    whatever the number of buckets; GradientConsistency prints its verdict, not the checksum table."""
    import json

    from torsh_kernels.collectives.replica import ReplicaCommunicator
    from torsh_kernels.parallel import GradientConsistency, SyncStats

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(30)])
    sync = GradientSynchronizer(model, ReplicaCommunicator(2), compressor=TopK(0.1, provider="torch"), min_numel=16)
    sync.set_bucketing(False)  # 60 buckets
    assert repr(sync.get_sync_stats()) == "SyncStats(no sync yet, syncs=0)"
    for _ in range(3):
        model(torch.randn(4, 64)).sum().backward()
        st = sync.sync_gradients()
        sync.zero_grad()
    full = sync.get_sync_stats()
    for s in (st, full):
        assert isinstance(s, SyncStats) and isinstance(s, dict)
        assert len(s["buckets"]) == 60 and len(repr(dict(s))) > 3000  # what print() used to show
        r = repr(s)
        assert len(r) <= 320 and "\n" not in r and str(s) == r, r
        ratio = s["bytes_before"] / s["payload_bytes"]
        wire = "wire -" if s["bytes_on_wire"] is None else f"wire {s['bytes_on_wire'] / 2**10:.4g} KiB"
        for fig in ("iteration=3", "parameters=60/60 with gradients", "buckets=60", f"({ratio:.3g}x)", wire,
                    "unused=0", "nonfinite_steps=0"):  # fmt: skip
            assert fig in r, (fig, r)
    assert "syncs=3" in repr(full) and "compressor=TopK(" in repr(full)
    assert json.loads(json.dumps(st)) == dict(st)  # still plain data

    many = [f"layers.{i}.weight" for i in range(500)]
    gc = GradientConsistency(False, many, [[i] * 500 for i in range(4)])
    r = repr(gc)
    assert len(r) <= 150 and "mismatched=500 ['layers.0.weight'" in r and "4 ranks x 500 parameters" in r, r


# -- the signature exchange ------------------------------------------------------------------------------


def _mismatch_worker(comm) -> dict:
    """Every way two ranks' bucket layers can differ, one after another in one job (each exchange raises on
    every rank before the bucket's collectives, so the group stays usable): the synchronizer and the engine
    under it (given buckets directly; the DDP hook's case is in test_hooks.py, whose job has DDP loaded);
    then the exchanges a matching configuration makes."""
    from torsh_kernels.collectives.communicator import TorchCommunicator
    from torsh_kernels.compression import Quantize
    from torsh_kernels.errors import CollectiveMismatchError
    from torsh_kernels.parallel.engine import BucketCompressor

    me = comm.rank
    odd = me == 1

    def mlp():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(12, 24), nn.ReLU(), nn.Linear(24, 3))

    def step(make=mlp, **kw):
        net = make()
        sync = GradientSynchronizer(net, comm, overlap=False, **{"min_numel": 16, **kw})
        net(torch.randn(4, 12, dtype=next(net.parameters()).dtype)).sum().backward()
        return sync.sync_gradients()

    def bucket(grads):
        eng = BucketCompressor(TopK(0.1), min_numel=16)
        for r in eng.start(grads, list(range(len(grads))), comm)[0]:
            r.wait()

    cases = {
        "class": lambda: step(compressor=Quantize(8) if odd else TopK(0.1)),
        "ratio": lambda: step(compressor=TopK(0.2 if odd else 0.1)),
        "rank": lambda: step(compressor=PowerSGD(2 if odd else 1)),
        "block": lambda: step(compressor=Quantize(8, 64 if odd else 256)),
        "policy": lambda: step(compressor=TopK(0.1), policy="bucket" if odd else "layerwise"),
        "start_iter": lambda: step(compressor=TopK(0.1), start_iter=1 if odd else 0),
        "min_numel": lambda: step(compressor=TopK(0.1), min_numel=32 if odd else 16),
        # resolved before the first bucket's non-finite flag, whose presence it decides
        "nonfinite": lambda: step(compressor=TopK(0.1), nonfinite="propagate" if odd else "raise"),
        "shapes": lambda: step(lambda: nn.Linear(24, 12, bias=False) if odd else nn.Linear(12, 24, bias=False)),
        "dtype": lambda: step(lambda: mlp().to(torch.bfloat16) if odd else mlp()),
        "tensors": lambda: bucket([torch.randn(8, 8)] + [torch.randn(3)] * odd),
        "numel": lambda: bucket([torch.randn(8, 9 if odd else 8)]),
    }
    out = {}
    for name, fn in cases.items():
        try:
            fn()
            out[name] = None
        except CollectiveMismatchError as e:
            out[name] = str(e)
    # a matching configuration: one exchange per bucket layout, the first time; none with the switch off
    with count_calls(TorchCommunicator, "all_gather") as calls:
        for check in (None, False):
            net = mlp()
            # uncompressed (the first compression would load the kernels, seconds here; test_hooks.py counts
            # top-k's all-gathers beside the exchanges): the exchanges are the only all-gathers
            sync = GradientSynchronizer(net, comm, overlap=False, bucket_mb=0.001, first_bucket_mb=0.001,
                                        check_signatures=check)  # fmt: skip
            per_step = []
            for _ in range(3):
                n = calls["all_gather"]
                net(torch.randn(4, 12)).sum().backward()
                st = sync.sync_gradients()
                sync.zero_grad()
                per_step.append((calls["all_gather"] - n, st["signature_checks"]))
            out[f"steps {check}"] = (per_step, len(sync.buckets))
    t = torch.full((2,), float(me))
    comm.all_reduce(t)  # the group still works
    out["sum"] = t.tolist()
    return out


def test_ranks_whose_bucket_layers_differ_all_raise_naming_the_difference():
    named = {"class": "compressor: TopK on rank 0, Quantize on rank 1", "ratio": "compressor.ratio: 0.1 on rank 0, 0.2",
             "rank": "compressor.rank: 1 on rank 0, 2 on rank 1", "block": "compressor.block: 256 on rank 0, 64",
             "policy": "policy: layerwise on rank 0, bucket on rank 1", "start_iter": "start_iter: 0 on rank 0, 1",
             "min_numel": "min_numel: 16 on rank 0, 32 on rank 1", "nonfinite": "nonfinite: raise on rank 0, propagate",
             "shapes": "shapes: [(24, 12)] on rank 0, [(12, 24)] on rank 1",
             "dtype": "dtypes: ['float32', 'float32', 'float32', 'float32'] on rank 0, ['bfloat16'",
             "tensors": "tensors: 1 on rank 0, 2 on rank 1", "numel": "numel: 64 on rank 0, 72 on rank 1"}  # fmt: skip
    out = run_local(_mismatch_worker, 2, op_timeout=30)
    assert_named_on_every_rank(out, named)
    for res in out:
        steps, buckets = res["steps None"]
        assert buckets > 1
        # one exchange (an all-gather) per bucket at the first step, none later; none with the switch off
        assert steps == [(buckets, buckets), (0, buckets), (0, buckets)]  # (all-gathers, exchanges so far)
        assert res["steps False"] == ([(0, 0)] * 3, buckets)
        assert res["sum"] == [1.0, 1.0]
