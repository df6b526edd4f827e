"""OffloadedOptimizer is all or nothing across ranks: when its step fails on one rank (the wrapped optimizer
raising there only), every rank rolls the step back, the failed rank raises its own error and the others a
``RankFailedError`` naming it. On FSDP2's shards (DTensor parameters: on by default) and on DDP's replicas
(``group=`` given), 2 gloo ranks: after the failed step every rank's parameters are those before it; a
checkpoint saved then with torch.distributed.checkpoint and resumed in fresh processes trains on exactly as a
run that never failed. A rank that dies or stalls past ``timeout`` ends the step typed on the others, rolled
back. Plain tensors without ``group=`` issue no collective."""

from __future__ import annotations

import os
import time
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.helpers import count_calls
from torsh_kernels.collectives import TorchCommunicator, run_local
from torsh_kernels.errors import (
    ArgumentTypeError,
    CollectiveError,
    CollectiveTimeoutError,
    InvalidArgumentError,
    RankFailedError,
)
from torsh_kernels.parallel import OffloadedOptimizer

GOOD, FAILED, AFTER = 3, 3, 3  # steps 0-2 succeed, step 3 fails on rank 1, then steps 3-5
LR = 1e-2


class Injected(RuntimeError):
    pass


class FailingAdamW(torch.optim.AdamW):
    """AdamW that, after updating its chunk, raises (``fault="raise"``), exits the process ("die") or sleeps
    ``stall`` seconds once per arming ("stall": on the step's first chunk only; one per chunk made the stalled
    rank's step take chunks x stall, 20 s for the 4 chunks of the DDP case); armed on one rank only."""

    fault: str | None = None
    stall = 0.0

    def step(self, closure=None):
        out = super().step(closure)
        if FailingAdamW.fault == "raise":
            raise Injected("the wrapped optimizer failed on this rank")
        if FailingAdamW.fault == "die":
            os._exit(3)
        if FailingAdamW.fault == "stall":
            FailingAdamW.fault = "stalled"
            time.sleep(FailingAdamW.stall)
        return out


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(24, 61), nn.ReLU(), nn.Linear(61, 33), nn.ReLU(), nn.Linear(33, 5))


def _shard(model: nn.Module, mesh) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _full(model: nn.Module) -> torch.Tensor:
    """Every parameter, whole (FSDP2: gathered from every rank's shard), flat."""
    return torch.cat([(p.full_tensor() if hasattr(p, "full_tensor") else p.detach()).reshape(-1)
                      for p in model.parameters()])  # fmt: skip


def _shards(model: nn.Module) -> list[torch.Tensor]:
    """This rank's part of each parameter (FSDP2: its shard), copied: compared without a collective."""
    return [(p.to_local() if hasattr(p, "to_local") else p).detach().clone() for p in model.parameters()]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _backward(model: nn.Module, s: int, me: int) -> None:
    target = torch.randn(24, 5, generator=torch.Generator().manual_seed(99))
    x = torch.randn(16, 24, generator=torch.Generator().manual_seed(1000 * s + me))
    nn.functional.mse_loss(model(x), torch.tanh(x @ target)).backward()


def _train(model: nn.Module, opt, steps, me: int) -> None:
    for s in steps:
        _backward(model, s, me)
        opt.step()
        opt.zero_grad()


def _failing_step(model: nn.Module, opt, me: int, fail_on: int) -> dict:
    """Step ``GOOD`` with the wrapped optimizer raising on rank ``fail_on``: what each rank raised, and whether
    its parameters (all ranks', gathered) are those before the step."""
    before = _full(model)
    shards = _shards(model)
    _backward(model, GOOD, me)
    FailingAdamW.fault = "raise" if me == fail_on else None
    err = None
    try:
        opt.step()
    except Exception as e:
        err = e
    finally:
        FailingAdamW.fault = None
    opt.zero_grad()
    return {
        "error": None if err is None else type(err).__name__,
        "message": "" if err is None else str(err),
        "failures": dict(getattr(err, "failures", {}) or {}),
        "rolled_back": torch.equal(_full(model), before),
        "local_rolled_back": _same(_shards(model), shards),
    }


def _setup(kind: str, comm, timeout: float | None = None):
    """(model, optimizer) of one rank: FSDP2 shards on a 1-D mesh ("fsdp2": the agreement is on by default), or
    DDP replicas ("ddp": DDP's group given)."""
    kw = {} if timeout is None else {"timeout": timeout}  # None: the process group's (run_local's op_timeout)
    if kind == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh

        model = _shard(_model(), init_device_mesh("cpu", (comm.world_size,)))
    else:
        model = nn.parallel.DistributedDataParallel(_model())
        kw.setdefault("group", dist.group.WORLD)
    opt = OffloadedOptimizer(model.parameters(), FailingAdamW, "bf16", lr=LR, chunk_mb=0.004, **kw)
    return model, opt


def _fail_and_save(comm, kind: str, path: str) -> dict:
    """Steps 0-2, step 3 failing on rank 1, a DCP checkpoint; then (as a user retrying) steps 3-5 in this
    process, against a run that never failed."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    warnings.simplefilter("ignore", FutureWarning)
    me = comm.rank
    model, opt = _setup(kind, comm)
    _train(model, opt, range(GOOD), me)
    out = _failing_step(model, opt, me, fail_on=1)
    full = _full(model)
    replicas = [torch.empty_like(full) for _ in range(comm.world_size)]
    dist.all_gather(replicas, full)
    out["replicas_equal"] = all(torch.equal(r, full) for r in replicas)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    _train(model, opt, range(GOOD, GOOD + AFTER), me)
    ref, ref_opt = _setup(kind, comm)
    _train(ref, ref_opt, range(GOOD + AFTER), me)
    out["retried_equal"] = torch.equal(_full(model), _full(ref))
    return out


def _resume(comm, kind: str, path: str) -> dict:
    """Fresh processes: the checkpoint resumed and trained on (steps 3-5) against a run that never failed."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    warnings.simplefilter("ignore", FutureWarning)
    me = comm.rank
    model, opt = _setup(kind, comm)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    _train(model, opt, range(GOOD, GOOD + AFTER), me)
    ref, ref_opt = _setup(kind, comm)
    start = _full(ref)
    _train(ref, ref_opt, range(GOOD + AFTER), me)
    a, b = _full(model), _full(ref)
    return {"deviation": ((a - b).abs().max() / (b - start).abs().max()).item(), "equal": torch.equal(a, b)}


@pytest.mark.parametrize("kind", ["fsdp2", "ddp"])
def test_a_step_failing_on_one_rank_is_rolled_back_on_every_rank_and_resumes_exactly(tmp_path, kind):
    path = str(tmp_path / "ckpt")
    out = run_local(_fail_and_save, 2, kind, path, op_timeout=120)
    assert [o["error"] for o in out] == ["RankFailedError", "Injected"], [o["message"] for o in out]
    assert out[0]["failures"] == {1: "Injected: the wrapped optimizer failed on this rank"}
    assert "rank 1 failed" in out[0]["message"] and "ranks 0, 1" in out[0]["message"]
    for o in out:
        assert o["rolled_back"] and o["local_rolled_back"] and o["replicas_equal"], out
        assert o["retried_equal"]
    resumed = run_local(_resume, 2, kind, path, op_timeout=120)
    for r in resumed:  # the same operations in the same order: equal, not only close
        assert r["deviation"] < 1e-6 and r["equal"], resumed


def _hsdp(comm) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    warnings.simplefilter("ignore", FutureWarning)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    # FSDP2's native HSDP: each parameter sharded over "shard", replicated over "replicate"
    model = _shard(_model(), mesh)
    opt = OffloadedOptimizer(model.parameters(), FailingAdamW, "bf16", lr=LR, chunk_mb=0.004)
    _train(model, opt, range(GOOD), comm.rank)
    out = _failing_step(model, opt, comm.rank, fail_on=2)
    out["exchanges"] = len(opt._agreement.comms)
    return out


def test_an_hsdp_mesh_agrees_over_both_of_its_dimensions():
    """4 ranks on a 2x2 mesh: rank 2's failure reaches its replica (rank 0) and the other shard's ranks."""
    out = run_local(_hsdp, 4, op_timeout=120)
    assert [o["error"] for o in out] == ["RankFailedError", "RankFailedError", "Injected", "RankFailedError"]
    for o in out:
        assert o["rolled_back"] and o["local_rolled_back"] and o["exchanges"] == 2, out
        named = {2: "Injected: the wrapped optimizer failed on this rank"}
        assert o["failures"] == ({} if o["error"] == "Injected" else named)


# -- a rank that dies or stalls ------------------------------------------------------------------------------


def fault_scenario(comm, kind: str, fault: str, timeout: float) -> dict:
    """Steps 0-2, then step 3 with rank 1's wrapped optimizer raising, dying or stalling ``timeout`` + 3 s
    (``fault``) mid-step; what this rank raised, how long its step took, whether its part of the parameters is
    as before the step, and, where its exchange did not complete, what ``step()`` and ``state_dict()`` say
    then. Also run by ``scripts/probe_cases/faults.py``."""
    me = comm.rank
    model, opt = _setup(kind, comm, timeout)
    _train(model, opt, range(GOOD), me)
    before = _shards(model)
    _backward(model, GOOD, me)
    FailingAdamW.fault, FailingAdamW.stall = (fault if me == 1 else None), timeout + 3.0
    t0, err = time.monotonic(), None
    try:
        opt.step()
    except Exception as e:
        err = e
    finally:
        FailingAdamW.fault = None
    out = {"error": type(err).__name__ if err else None, "message": str(err) if err else "",
           "failures": dict(getattr(err, "failures", {}) or {}), "took": time.monotonic() - t0,
           "rolled_back": _same(_shards(model), before)}  # fmt: skip
    if isinstance(err, CollectiveError) and not isinstance(err, RankFailedError):
        for name, call in (("step", opt.step), ("state_dict", opt.state_dict)):  # refused until restored
            try:
                call()
                out[name] = None
            except CollectiveError as e:
                out[name] = str(e)
    if fault == "stall":
        comm.barrier()  # rank 0 stays until rank 1 made its exchange (which rank 0 gave up on)
    return out


@pytest.mark.parametrize("kind", ["fsdp2", "ddp"])
@pytest.mark.parametrize("fault", ["die", "stall"])
def test_a_rank_that_dies_or_stalls_mid_step_ends_the_step_typed_and_rolled_back(kind, fault):
    if fault == "die":
        with pytest.raises(RankFailedError) as info:
            run_local(fault_scenario, 2, kind, fault, 2.0, op_timeout=30)
        out = info.value.values[0]
        assert out["error"] == "CollectiveError" and out["took"] < 10, out
    else:
        out = run_local(fault_scenario, 2, kind, fault, 2.0, op_timeout=30)[0]
        assert out["error"] == "CollectiveTimeoutError" and 1.5 < out["took"] < 6, out
    assert out["rolled_back"], out
    assert "did not complete on rank 0" in out["message"] and "restore every rank" in out["message"].lower()
    # the peer may have committed (a stalled one that joins later finds rank 0's contribution): no going on
    assert out["step"] == out["message"] and out["state_dict"] == out["message"]


# -- when there is no agreement -----------------------------------------------------------------------------


def _plain(comm) -> dict:
    """Plain tensors and no group: no collective; each rank atomic on its own (the failing rank rolls back,
    the other steps)."""
    me = comm.rank
    model = _model()
    opt = OffloadedOptimizer(model.parameters(), FailingAdamW, "bf16", lr=LR, chunk_mb=0.004)
    off = OffloadedOptimizer(_model().parameters(), lr=LR, group=False)
    _train(model, opt, range(GOOD), me)
    with count_calls(TorchCommunicator, "all_reduce", "all_gather") as calls:
        out = _failing_step(model, opt, me, fail_on=1)
    out["collectives"] = dict(calls)
    out["agreements"] = [opt._agreement is None, off._agreement is None]
    return out


def test_plain_tensors_without_a_group_issue_no_collective():
    out = run_local(_plain, 2, op_timeout=60)
    assert [o["error"] for o in out] == [None, "Injected"]
    assert [o["local_rolled_back"] for o in out] == [False, True]  # rank 0 stepped: nothing asked it to agree
    for o in out:
        assert o["collectives"] == {"all_reduce": 0, "all_gather": 0} and o["agreements"] == [True, True]


def test_single_process_needs_no_process_group_and_bad_groups_are_typed():
    ps = [nn.Parameter(torch.randn(3, 4))]
    for group in ("auto", False):
        opt = OffloadedOptimizer(ps, lr=LR, group=group)
        ps[0].grad = torch.ones(3, 4)
        before = ps[0].detach().clone()
        opt.step()
        assert not torch.equal(ps[0].detach(), before)
    for group, exc in ((None, InvalidArgumentError), (True, InvalidArgumentError), ("world", InvalidArgumentError),
                       (3, ArgumentTypeError)):  # fmt: skip
        with pytest.raises(exc, match="group"):
            OffloadedOptimizer(ps, lr=LR, group=group)
    for timeout in (0, -1.0, float("nan"), float("inf"), 1e300):
        with pytest.raises(InvalidArgumentError, match="timeout"):
            OffloadedOptimizer(ps, lr=LR, timeout=timeout)
    with pytest.raises(ArgumentTypeError, match="timeout"):
        OffloadedOptimizer(ps, lr=LR, timeout=True)
    assert issubclass(CollectiveTimeoutError, CollectiveError)
