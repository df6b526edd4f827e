"""FSDP2's quantized comms when a peer fails, is missing or hands over a damaged checkpoint (real gloo processes).

- A peer that raises and stays alive: with ``apply_quantized_comm(timeout=)`` the survivor's next collective
  (the quantized all-gather, the quantized reduce-scatter, the plain all-gather of non-float shards) fails
  with a typed ``CollectiveError`` within the timeout, not the process group's (minutes).
- ``apply_quantized_comm`` called on one rank only: that rank raises ``CollectiveTimeoutError`` naming the
  other (its exchange would have met FSDP2's own all-gather, and gloo aborts the process on such a pair).
- A residual with NaN in a checkpoint: refused at load (``set_model_state_dict``/``load_state_dict``) on the rank
  whose shard holds it; loaded in place by ``dcp.load`` alone, refused before the first send that uses it.

Each scenario runs on a fresh process group (``DeviceMesh.from_group``), so a collective left waiting by one
cannot meet the next scenario's.
"""

from __future__ import annotations

import datetime
import time
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

from torsh_kernels.collectives import run_local
from torsh_kernels.errors import TorshKernelsError
from torsh_kernels.parallel.fsdp import RESIDUAL, QuantizedAllGather, apply_quantized_comm

TIMEOUT = 2.0
LINGER = 5.0  # the failed peer stays alive this long (past the survivor's timeout), then leaves


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(24, 61), nn.ReLU(), nn.Linear(61, 33), nn.ReLU(), nn.Linear(33, 5))


def _sharded(pg_timeout: float = 60.0, **kw):
    """A fresh group over every rank, its 1-D mesh, and the model sharded over it."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    pg = dist.new_group(list(range(dist.get_world_size())), timeout=datetime.timedelta(seconds=pg_timeout))
    mesh = DeviceMesh.from_group(pg, "cpu")
    model = _model()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    return pg, model


def _step(model: nn.Module, seed: int, *, backward: bool = True) -> torch.Tensor:
    x = torch.randn(8, 24, generator=torch.Generator().manual_seed(seed))
    loss = model(x).square().mean()
    if backward:
        loss.backward()
    return loss


def _outcome(fn) -> dict:
    """What ``fn()`` did: the error's class, whether it is torsh's, its message, and the seconds it took."""
    t0 = time.perf_counter()
    try:
        fn()
        err = None
    except Exception as e:  # the test asserts on the class
        err = e
    return {
        "error": type(err).__name__ if err is not None else None,
        "typed": isinstance(err, TorshKernelsError),
        "message": str(err) if err is not None else "",
        "seconds": time.perf_counter() - t0,
    }


def _peer_fails_worker(comm, where: str) -> dict:
    """Rank 1 raises (before its collective) and lingers; rank 0 must end typed within the timeout."""
    warnings.simplefilter("ignore", FutureWarning)
    me = comm.rank

    def peer_fails() -> None:
        time.sleep(LINGER)  # alive, not joining: the survivor's collective has no partner
        raise ValueError("the peer's own failure")

    if where == "all_gather":  # the forward's quantized all-gather
        _, model = _sharded()
        apply_quantized_comm(model, weights="int8", grads="int8", timeout=TIMEOUT)
        _step(model, 0)  # a clean step first: both ranks agreed and sent
        return _outcome(peer_fails if me == 1 else lambda: _step(model, 1))
    if where == "reduce_scatter":  # the backward's (FSDP2's own all-gather is not in the way: no reshard)
        _, model = _sharded(reshard_after_forward=False)
        apply_quantized_comm(model, grads="int8", timeout=TIMEOUT)
        _step(model, 0)
        loss = _step(model, 1, backward=False)
        return _outcome(peer_fails if me == 1 else loss.backward)
    # the plain all-gather (non-float shards go through FSDP2's collective, waited for within the timeout)
    pg, _ = _sharded()
    ag = QuantizedAllGather(timeout=TIMEOUT)
    o = torch.zeros(2 * 5, dtype=torch.int32)

    def plain() -> None:
        ag(o, o.narrow(0, me * 5, 5), pg, True).wait()

    plain()  # a clean call first (its signature exchange, then the collective)
    res = _outcome(peer_fails if me == 1 else plain)
    res["plain_calls"] = ag.plain_calls
    return res


@pytest.mark.parametrize("where", ["all_gather", "reduce_scatter", "plain_all_gather"])
def test_a_peer_that_raises_and_lingers_ends_the_survivors_collective_typed_within_the_timeout(where):
    survivor, peer = run_local(_peer_fails_worker, 2, where, op_timeout=60)
    assert survivor["typed"] and survivor["error"] in ("CollectiveError", "CollectiveTimeoutError"), survivor
    # the group's timeout is 60 s: the comm's own (2 s) ended it, well before the peer left (5 s)
    assert survivor["seconds"] < LINGER, survivor
    assert peer["error"] == "ValueError"
    if where == "plain_all_gather":
        assert survivor["plain_calls"] == 2


def _one_rank_installs_worker(comm) -> dict:
    """apply_quantized_comm on rank 0 only; then both ranks run a forward."""
    warnings.simplefilter("ignore", FutureWarning)
    _, model = _sharded(pg_timeout=3 * TIMEOUT)  # bounds rank 1's wait in FSDP2's own all-gather
    if comm.rank == 0:
        res = _outcome(lambda: apply_quantized_comm(model, weights="int8", grads="int8", timeout=TIMEOUT))
        res["installed"] = any(hasattr(m, RESIDUAL) for m in model.modules())
        return res
    return _outcome(lambda: _step(model, 0))


def test_apply_quantized_comm_on_one_rank_only_is_named_instead_of_aborting_in_gloo():
    # before: rank 0's signature exchange met rank 1's parameter all-gather and gloo aborted rank 0 (SIGABRT)
    caller, other = run_local(_one_rank_installs_worker, 2, op_timeout=60)
    assert caller["error"] == "CollectiveTimeoutError", caller
    assert "rank 1 did not reach apply_quantized_comm" in caller["message"], caller["message"]
    assert "rank 0 did" in caller["message"]
    assert caller["seconds"] < 3 * TIMEOUT and not caller["installed"]  # nothing installed, nothing sent
    # rank 1 ran none of torsh's code: its FSDP2 all-gather ends with torch's own error, no abort
    assert other["error"] is not None, other


def _nan_residual_worker(comm, path) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    warnings.simplefilter("ignore", FutureWarning)
    me, out = comm.rank, {}

    def prepared():
        _, model = _sharded()
        apply_quantized_comm(model, grads="int8", timeout=TIMEOUT)
        return model

    model = prepared()
    for s in range(2):
        _step(model, s)
        model.zero_grad()
    bufs = [getattr(m, RESIDUAL) for m in model.modules() if hasattr(m, RESIDUAL)]
    out["residual_nonzero"] = all(b.to_local().abs().sum() > 0 for b in bufs)
    if me == 1:
        bufs[1].to_local()[3] = float("nan")  # one damaged value in one shard
    dcp.save(model.state_dict(), checkpoint_id=path)

    # load through set_model_state_dict (model.load_state_dict): refused at load, on the rank whose shard holds it
    model2 = prepared()
    state = get_model_state_dict(model2)
    dcp.load(state, checkpoint_id=path)  # into the state dict's tensors (model2's own)
    out["set_state_dict"] = _outcome(lambda: set_model_state_dict(model2, state))

    # dcp.load alone (in place, no module hook runs): refused before the first send that uses it
    model3 = prepared()
    _step(model3, 0)  # a clean step: the residuals are in use
    model3.zero_grad()
    dcp.load(model3.state_dict(), checkpoint_id=path)
    out["next_step"] = _outcome(lambda: _step(model3, 5))
    return out


def test_a_residual_with_nan_is_refused_at_load_typed(tmp_path):
    # before: both loads were silent and NaN reached the gradients at the next step
    out = run_local(_nan_residual_worker, 2, str(tmp_path / "ckpt"), op_timeout=60)
    assert all(o["residual_nonzero"] for o in out)
    assert out[0]["set_state_dict"]["error"] is None, out[0]["set_state_dict"]
    damaged = out[1]["set_state_dict"]
    assert damaged["error"] == "NonFiniteError", damaged
    assert "1 NaN/Inf" in damaged["message"] and RESIDUAL in damaged["message"]
    assert out[1]["next_step"]["error"] == "NonFiniteError", out[1]["next_step"]
    assert "loaded from a checkpoint" in out[1]["next_step"]["message"]
    # rank 0 sent and waits for rank 1's chunks, which never come: typed, within the comm's timeout
    assert out[0]["next_step"]["typed"] and out[0]["next_step"]["seconds"] < LINGER, out[0]["next_step"]
