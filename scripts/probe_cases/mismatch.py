"""Distributed mismatches: ranks whose compressed all-reduces, bucket layers (the synchronizer, its engine, the
DDP hook), FSDP2 comms or expert-parallel MoE layers differ in one way.

Each case is a real job of two gloo ranks (``run_local``) in which rank 1 differs from rank 0 in one setting.
What is sought is a ``CollectiveMismatchError`` on every rank, before anything mismatched goes on the wire
(the signature exchange, ``torsh_kernels.collectives.agreement``). The case's ``run()`` maps the job's
outcome onto the probe's: it raises ``CollectiveMismatchError`` (rank 0's message) when every rank raised
it (typed_error); returns the ranks' results when any rank raised nothing (silent_acceptance); aborts its
own worker when a rank was killed by a signal, as gloo kills a rank on a mismatched collective (crash);
sleeps past its timeout when the job ran out of time (hang); and raises a ``RuntimeError`` when a rank
raised anything else (other_exception). Two matching jobs (``expect="ok"``) check that agreeing ranks are
not refused and get the right result.

The ranks run ``_rank`` from this module imported under its package name (``probe_cases.mismatch``), which
spawned processes can import (the probe loads catalogues under another name).
"""

from __future__ import annotations

import functools
import os
import time

import torch

from probe_cases import Case

JOB_TIMEOUT = 90.0
"""Seconds a job may take (two fresh processes import torch: most of it is start-up)."""


# -- what each rank does -------------------------------------------------------------------------------------


def _car(comm, odd, *, make, shape=(300,), dtype=torch.float32, mode="auto", link=None, states=None, count=1):
    """A compressed all-reduce: ``make(odd)`` the compressor, ``shape``/``dtype``/``count`` the tensors (each
    possibly a function of ``odd``)."""
    from torsh_kernels.compression import compressed_all_reduce

    def pick(v):
        return v(odd) if callable(v) else v

    c = make(odd)
    g = torch.Generator().manual_seed(comm.rank)
    xs = [torch.randn(pick(shape), generator=g).to(pick(dtype)) for _ in range(pick(count))]
    fresh = [c.new_state(seed=comm.rank) if c is not None else None for _ in xs]
    st = pick(states) if states is not None else fresh
    compressed_all_reduce(xs if len(xs) > 1 else xs[0], comm, c, st if len(xs) > 1 else st[0],
                          quantize_mode=pick(mode), link=pick(link))  # fmt: skip


def _used_powersgd_state(odd):
    from torsh_kernels.compression import PowerSGD, roundtrip

    st = PowerSGD(1).new_state()
    if odd:  # a state one step old (say, from a checkpoint) against a fresh one
        roundtrip(PowerSGD(1), torch.randn(30, 20), st)
    return [st]


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.ReLU(), torch.nn.Linear(24, 3))


def _sync(comm, odd, *, model=None, **kw):
    """One step of a GradientSynchronizer (``kw`` and ``model`` possibly functions of ``odd``)."""
    from torsh_kernels.parallel import GradientSynchronizer

    net = (model or (lambda o: _mlp()))(odd)
    args = {"min_numel": 16, **{k: v(odd) if callable(v) else v for k, v in kw.items()}}
    sync = GradientSynchronizer(net, comm, overlap=False, **args)
    net(torch.randn(4, 12, dtype=next(net.parameters()).dtype)).sum().backward()
    sync.sync_gradients()
    return torch.cat([p.grad.reshape(-1) for p in net.parameters()]).sum().item()


def _engine(comm, odd, *, grads):
    from torsh_kernels.compression import TopK
    from torsh_kernels.parallel.engine import BucketCompressor

    eng = BucketCompressor(TopK(0.1), min_numel=16)
    gs = grads(odd)
    for r in eng.start(gs, list(range(len(gs))), comm)[0]:
        r.wait()


def _hook(comm, odd, *, make):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from torsh_kernels.parallel import CompressionHookState, compression_hook

    ddp = DDP(_mlp())
    ddp.register_comm_hook(CompressionHookState(compressor=make(odd), min_numel=16), compression_hook)
    ddp(torch.randn(4, 12)).sum().backward()


def _fsdp_ag(comm, odd, *, make, dtype=torch.float32):
    import torch.distributed as dist

    n, dt = 64, dtype(odd) if callable(dtype) else dtype
    o = torch.zeros(2 * n, dtype=dt)
    o.narrow(0, comm.rank * n, n).copy_(torch.randn(n))
    make(odd)(o, o.narrow(0, comm.rank * n, n), dist.group.WORLD)


def _fsdp_rs(comm, odd, *, make, op=None):
    import torch.distributed as dist

    op = op(odd) if op is not None else dist.ReduceOp.AVG
    make(odd)(torch.zeros(64), torch.randn(128), dist.group.WORLD, op)


def _fsdp_apply(comm, odd, **kw):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from torsh_kernels.parallel import apply_quantized_comm

    model = _mlp()
    mesh = init_device_mesh("cpu", (2,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    apply_quantized_comm(model, **{k: v(odd) for k, v in kw.items()})


def _fsdp_one_rank(comm, odd):
    """apply_quantized_comm on rank 0 only, then a forward on both: rank 0 must name rank 1 (typed), where its
    exchange met rank 1's FSDP2 all-gather and gloo aborted it; rank 1 runs none of torsh's code."""
    import datetime

    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    from torsh_kernels.parallel import apply_quantized_comm

    pg = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=8))  # bounds rank 1's wait in FSDP2's own
    mesh = DeviceMesh.from_group(pg, "cpu")
    model = _mlp()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if not odd:
        apply_quantized_comm(model, weights="int8", grads="int8", timeout=3)
    return model(torch.randn(4, 12)).shape


def _moe(comm, odd, **kw):
    from torsh_kernels.parallel import ExpertParallelMoE

    args = {"hidden": 12, "ffn_hidden": 10, "num_experts": 4, "k": 2, **{k: v(odd) for k, v in kw.items()}}
    layer = ExpertParallelMoE(args.pop("hidden"), args.pop("ffn_hidden"), args.pop("num_experts"), args.pop("k"),
                              comm, **args)  # fmt: skip
    return layer(torch.randn(5, layer.hidden, dtype=layer.w_in.dtype)).shape


def _setups() -> dict:
    from torsh_kernels.collectives import Link
    from torsh_kernels.compression import FP16, PowerSGD, Quantize, Sign, TopK

    def q(odd, a, b):
        return b if odd else a

    return {
        # compressed_all_reduce
        "compressed_all_reduce/compressor_class": functools.partial(_car, make=lambda o: Sign() if o else TopK(0.1)),
        "compressed_all_reduce/topk_ratio": functools.partial(_car, make=lambda o: TopK(q(o, 0.1, 0.2))),
        "compressed_all_reduce/powersgd_rank": functools.partial(_car, make=lambda o: PowerSGD(q(o, 1, 2)),
                                                                 shape=(30, 20)),
        "compressed_all_reduce/quantize_bits": functools.partial(_car, make=lambda o: Quantize(q(o, 8, 4))),
        "compressed_all_reduce/quantize_block": functools.partial(_car, make=lambda o: Quantize(8, q(o, 256, 64))),
        "compressed_all_reduce/quantize_stochastic": functools.partial(_car, make=lambda o: Quantize(8, 256, o)),
        "compressed_all_reduce/cast_class": functools.partial(_car, make=lambda o: FP16() if o else None),
        "compressed_all_reduce/dtype": functools.partial(
            _car, make=lambda o: TopK(0.1), dtype=lambda o: q(o, torch.float32, torch.bfloat16)),
        "compressed_all_reduce/shape": functools.partial(
            _car, make=lambda o: TopK(0.1), shape=lambda o: q(o, (30, 20), (20, 30))),
        "compressed_all_reduce/numel": functools.partial(_car, make=lambda o: TopK(0.1), shape=lambda o: (300 + o,)),
        "compressed_all_reduce/tensor_count": functools.partial(_car, make=lambda o: TopK(0.1), count=lambda o: 2 + o),
        "compressed_all_reduce/quantize_mode": functools.partial(
            _car, make=lambda o: Quantize(8), mode=lambda o: q(o, "all_gather", "shared_scale")),
        "compressed_all_reduce/link": functools.partial(
            _car, make=lambda o: Quantize(8), link=lambda o: Link.gbit(q(o, 1, 100))),
        "compressed_all_reduce/powersgd_state_age": functools.partial(
            _car, make=lambda o: PowerSGD(1), shape=(30, 20), states=_used_powersgd_state),
        # the synchronizer and its bucket engine
        "synchronizer/compressor_class": functools.partial(_sync, compressor=lambda o: Quantize(8) if o else TopK(0.1)),
        "synchronizer/topk_ratio": functools.partial(_sync, compressor=lambda o: TopK(q(o, 0.1, 0.2))),
        "synchronizer/powersgd_rank": functools.partial(_sync, compressor=lambda o: PowerSGD(q(o, 1, 2))),
        "synchronizer/quantize_block": functools.partial(_sync, compressor=lambda o: Quantize(8, q(o, 256, 64))),
        "synchronizer/policy": functools.partial(
            _sync, compressor=TopK(0.1), policy=lambda o: q(o, "layerwise", "bucket")),
        "synchronizer/start_iter": functools.partial(_sync, compressor=TopK(0.1), start_iter=lambda o: q(o, 0, 1)),
        "synchronizer/min_numel": functools.partial(_sync, compressor=TopK(0.1), min_numel=lambda o: q(o, 16, 32)),
        "synchronizer/min_compression_rate": functools.partial(
            _sync, compressor=TopK(0.1), min_compression_rate=lambda o: q(o, 2.0, 3.0)),
        "synchronizer/quantize_mode": functools.partial(
            _sync, compressor=Quantize(8), quantize_mode=lambda o: q(o, "all_gather", "shared_scale")),
        "synchronizer/nonfinite": functools.partial(
            _sync, compressor=TopK(0.1), nonfinite=lambda o: q(o, "raise", "propagate")),
        "synchronizer/auto_candidates": functools.partial(
            _sync, compressor="auto", auto_candidates=lambda o: (None, TopK(0.01)) if o else (None, FP16())),
        "synchronizer/model_shapes": functools.partial(
            _sync, model=lambda o: torch.nn.Linear(*q(o, (12, 24), (24, 12)), bias=False)),
        "synchronizer/model_dtype": functools.partial(
            _sync, model=lambda o: _mlp().to(q(o, torch.float32, torch.bfloat16))),
        "bucket_engine/tensor_count": functools.partial(
            _engine, grads=lambda o: [torch.randn(8, 8)] + [torch.randn(3)] * o),
        "bucket_engine/numel": functools.partial(_engine, grads=lambda o: [torch.randn(8, 8 + o)]),
        "ddp_hook/topk_ratio": functools.partial(_hook, make=lambda o: TopK(q(o, 0.1, 0.2))),
        "ddp_hook/compressor_class": functools.partial(_hook, make=lambda o: PowerSGD(1) if o else TopK(0.1)),
        # FSDP2's quantized comms
        "fsdp/all_gather_bits": functools.partial(_fsdp_ag, make=lambda o: _qag(bits=q(o, 8, 4))),
        "fsdp/all_gather_block": functools.partial(_fsdp_ag, make=lambda o: _qag(block=q(o, 256, 64))),
        "fsdp/all_gather_dtype": functools.partial(_fsdp_ag, make=lambda o: _qag(),
                                                   dtype=lambda o: q(o, torch.float32, torch.bfloat16)),
        "fsdp/reduce_scatter_bits": functools.partial(_fsdp_rs, make=lambda o: _qrs(bits=q(o, 8, 4))),
        "fsdp/reduce_scatter_error_feedback": functools.partial(_fsdp_rs, make=lambda o: _qrs(error_feedback=not o)),
        "fsdp/reduce_scatter_op": functools.partial(_fsdp_rs, make=lambda o: _qrs(), op=_reduce_op),
        "fsdp/apply_grads_format": functools.partial(_fsdp_apply, grads=lambda o: q(o, "int8", "int4")),
        "fsdp/apply_weights": functools.partial(_fsdp_apply, weights=lambda o: q(o, "int8", None)),
        "fsdp/apply_on_one_rank": _fsdp_one_rank,
        # expert-parallel MoE
        "moe/num_experts": functools.partial(_moe, num_experts=lambda o: q(o, 4, 6)),
        "moe/k": functools.partial(_moe, k=lambda o: q(o, 2, 1)),
        "moe/hidden": functools.partial(_moe, hidden=lambda o: q(o, 12, 14)),
        "moe/ffn_hidden": functools.partial(_moe, ffn_hidden=lambda o: q(o, 10, 8)),
        "moe/capacity_factor": functools.partial(_moe, capacity_factor=lambda o: q(o, None, 1.25)),
        "moe/activation": functools.partial(_moe, activation=lambda o: q(o, "swiglu", "gelu")),
        "moe/dtype": functools.partial(_moe, dtype=lambda o: q(o, torch.float32, torch.bfloat16)),
        # agreeing ranks (expect="ok")
        "compressed_all_reduce/matching": functools.partial(_matching_car),
        "synchronizer/matching": functools.partial(_sync, compressor=TopK(0.1)),
    }  # fmt: skip


def _qag(**kw):
    from torsh_kernels.parallel import QuantizedAllGather

    return QuantizedAllGather(**kw)


def _qrs(**kw):
    from torsh_kernels.parallel import QuantizedReduceScatter

    return QuantizedReduceScatter(**kw)


def _reduce_op(odd):
    import torch.distributed as dist

    return dist.ReduceOp.SUM if odd else dist.ReduceOp.AVG


def _matching_car(comm, odd):
    from torsh_kernels.compression import TopK, compressed_all_reduce

    c = TopK(1.0)  # every element sent: the exact average
    st = c.new_state(seed=comm.rank)
    out = []
    for step in range(3):
        x = torch.full((50,), float(comm.rank + step))
        compressed_all_reduce(x, comm, c, st)
        out.append(x.tolist())
    return out


def _rank(comm, kind: str):
    """One rank of a job: ("ok", what the setup returned), or (the exception's class name, its message)."""
    try:
        value = _setups()[kind](comm, comm.rank == 1)
    except BaseException as e:
        return type(e).__name__, str(e)
    return "ok", value


# -- the cases ----------------------------------------------------------------------------------------------


def _job(kind: str) -> list:
    """The two-rank job of ``kind``, its outcome mapped onto the probe's (see the module docstring)."""
    import probe_cases.mismatch as me  # this file under its package name: the spawned ranks import it so
    from torsh_kernels.collectives import run_local
    from torsh_kernels.errors import CollectiveMismatchError, CollectiveTimeoutError, RankFailedError

    try:
        outs = run_local(me._rank, 2, kind, op_timeout=20, timeout=JOB_TIMEOUT - 10, threads=1)
    except RankFailedError as e:
        fails = " | ".join(e.failures.values())
        if "exited with code -" in fails:
            os.abort()  # a rank was killed by a signal (gloo's abort on a mismatched collective): a crash
        if "did not finish" in fails:
            time.sleep(JOB_TIMEOUT + 60)  # the job ran out of time: this case hangs
        raise RuntimeError(f"a rank failed outside the setup: {fails}") from None
    kinds = [o[0] for o in outs]
    if all(k == "CollectiveMismatchError" for k in kinds):
        raise CollectiveMismatchError(outs[0][1])
    if kind == "fsdp/apply_on_one_rank" and kinds[0] == "CollectiveTimeoutError" and kinds[1] != "ok":
        # the rank that called it names the other; the other ran only torch (its error is torch's)
        raise CollectiveTimeoutError(outs[0][1])
    if "ok" in kinds:
        return outs  # some rank went through: for a mismatch, a silent acceptance
    raise RuntimeError(f"the ranks raised {[f'{k}: {m[:200]}' for k, m in outs]}")


def _same_on_every_rank(outs) -> bool:
    return all(o[0] == "ok" for o in outs) and all(o[1] == outs[0][1] for o in outs)


def _exact_average(outs) -> bool:
    """The matching compressed all-reduce (top-k of every element): the average of rank r's r + step."""
    return _same_on_every_rank(outs) and outs[0][1] == [[0.5 + s] * 50 for s in range(3)]


def _cases() -> list[Case]:
    cases = []
    for kind in _setups():
        if kind.endswith("/matching"):
            check = _same_on_every_rank
            if kind.startswith("compressed_all_reduce"):
                check = _exact_average
            cases.append(Case(f"mismatch/{kind}", functools.partial(_job, kind), expect="ok", check=check,
                              timeout=JOB_TIMEOUT))  # fmt: skip
        else:
            cases.append(Case(f"mismatch/{kind}", functools.partial(_job, kind), timeout=JOB_TIMEOUT))
    return cases


CASES = _cases()
