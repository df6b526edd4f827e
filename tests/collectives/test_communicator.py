"""TorchCommunicator on real processes (gloo over loopback, file store), world sizes 2, 3 and 4.

Every rank draws every rank's input from a generator seeded with (case, rank), so each rank can compute
the single-process reference of a collective locally and compare. The workers assert; a failed assert
on any rank makes run_local raise RankFailedError with that rank's traceback.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from torsh_kernels.collectives import TorchCommunicator, run_local
from torsh_kernels.errors import (
    ArgumentTypeError,
    CollectiveError,
    CollectiveMismatchError,
    DeviceMismatchError,
    DTypeError,
    InvalidArgumentError,
    RankFailedError,
    ShapeError,
)

SIZES = (1, 7, 1001)


def _data(case: int, rank: int, shape, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(case * 7919 + rank)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-50, 50, shape, generator=g, dtype=dtype)


def _close(a, b, msg=""):
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m: f"{msg}: {m}")


def _collectives_worker(comm: TorchCommunicator, seed: int) -> int:
    """Every collective against its single-process reference, on the communicator's device (so the same
    worker runs any transport: tests/collectives/test_cupy_nccl_gpu.py runs it on NCCL through CuPy)."""
    ws, me, dev = comm.world_size, comm.rank, comm.device

    def data(case, rank, shape, dtype=torch.float32):
        return _data(case, rank, shape, dtype).to(dev)

    checks = 0
    case = seed
    # all_reduce: every op, float and int, odd sizes, sync and async
    for n in SIZES:
        for dtype in (torch.float32, torch.int32, torch.float64):
            for op in ("sum", "avg", "max", "min", "product"):
                if op == "avg" and not dtype.is_floating_point:
                    continue
                case += 1
                xs = [data(case, r, (n,), dtype) for r in range(ws)]
                if op == "product":
                    xs = [x.sign() + (x == 0) if not dtype.is_floating_point else 1 + 0.01 * x for x in xs]
                stack = torch.stack(xs)
                ref = {
                    "sum": stack.sum(0),
                    "avg": stack.double().mean(0).to(dtype) if dtype.is_floating_point else None,
                    "max": stack.amax(0),
                    "min": stack.amin(0),
                    "product": stack.prod(0),
                }[op].to(dtype)
                t = xs[me].clone()
                if n == 7:
                    h = comm.all_reduce(t, op, async_op=True)
                    h.wait()
                    assert h.is_completed()
                else:
                    assert comm.all_reduce(t, op) is None
                _close(t, ref, f"all_reduce {op} {dtype} n={n}")
                checks += 1
    # all_gather into one tensor (2-D rows) and into a list
    for n in SIZES:
        case += 1
        xs = [data(case, r, (n, 3)) for r in range(ws)]
        out = torch.full((ws * n, 3), float("nan"), device=dev)
        comm.all_gather(out, xs[me])
        _close(out, torch.cat(xs), "all_gather tensor")
        outs = [torch.full((n, 3), float("nan"), device=dev) for _ in range(ws)]
        comm.all_gather(outs, xs[me], async_op=True).wait()
        for r in range(ws):
            _close(outs[r], xs[r], "all_gather list")
        checks += 2
    # reduce_scatter: rows [rank * n, (rank + 1) * n)
    for n in SIZES:
        for op in ("sum", "max", "avg"):
            case += 1
            xs = [data(case, r, (ws * n,)) for r in range(ws)]
            out = torch.full((n,), float("nan"), device=dev)
            comm.reduce_scatter(out, xs[me], op)
            stack = torch.stack(xs)
            full = {"sum": stack.sum(0), "max": stack.amax(0), "avg": stack.double().mean(0).float()}[op]
            _close(out, full[me * n : (me + 1) * n], f"reduce_scatter {op}")
            checks += 1
    # broadcast from every source
    for src in range(ws):
        case += 1
        x = data(case, src, (1001,))
        t = x.clone() if me == src else torch.full((1001,), float("nan"), device=dev)
        comm.broadcast(t, src)
        _close(t, x, "broadcast")
        checks += 1
    # all_to_all, even and uneven splits (some empty), 2-D rows
    case += 1
    g = torch.Generator().manual_seed(case)
    splits = torch.randint(0, 5, (ws, ws), generator=g)  # splits[s, d]: rows s sends to d
    splits[0, ws - 1] = 0
    xs = [data(case, s, (int(splits[s].sum()), 2)) for s in range(ws)]
    out = torch.full((int(splits[:, me].sum()), 2), float("nan"), device=dev)
    comm.all_to_all(out, xs[me], splits[:, me].tolist(), splits[me].tolist())
    parts = [xs[s][int(splits[s, :me].sum()) : int(splits[s, : me + 1].sum())] for s in range(ws)]
    _close(out, torch.cat(parts), "all_to_all uneven")
    case += 1
    xs = [data(case, s, (ws * 3,)) for s in range(ws)]
    out = torch.empty(ws * 3, device=dev)
    comm.all_to_all(out, xs[me], async_op=True).wait()
    _close(out, torch.cat([xs[s][me * 3 : me * 3 + 3] for s in range(ws)]), "all_to_all even")
    checks += 2
    # send / recv around the ring, async sends (no peer at world size 1)
    case += 1
    if ws > 1:
        nxt, prv = (me + 1) % ws, (me - 1) % ws
        x = data(case, me, (1001,))
        got = torch.full((1001,), float("nan"), device=dev)
        h = comm.send(x, nxt, async_op=True)
        comm.recv(got, prv)
        h.wait()
        _close(got, data(case, prv, (1001,)), "send/recv")
        checks += 1
    comm.barrier()
    # subgroups: split into evens and odds, all-reduce inside each
    groups = [g for g in (list(range(0, ws, 2)), list(range(1, ws, 2))) if g]
    sub = comm.split(groups)
    mine = groups[me % 2]
    assert sub.world_size == len(mine) and sub.rank == mine.index(me)
    assert sub.global_ranks == mine
    case += 1
    t = data(case, me, (1001,))
    sub.all_reduce(t)
    _close(t, sum(data(case, r, (1001,)) for r in mine), "subgroup all_reduce")
    if sub.world_size > 1:
        x = data(case, me, (5,))
        got = torch.empty(5, device=dev)
        peer = (sub.rank + 1) % sub.world_size
        h = sub.send(x, peer, async_op=True)
        sub.recv(got, (sub.rank - 1) % sub.world_size)
        h.wait()
        _close(got, data(case, mine[(sub.rank - 1) % sub.world_size], (5,)), "subgroup send/recv (group ranks)")
    checks += 1
    return checks


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_collectives_match_single_process_reference(world_size):
    counts = run_local(_collectives_worker, world_size, 1000 + world_size, op_timeout=60)
    # every check ran on every rank (world size 1 has no peer to send to)
    assert counts == [61 + world_size - (world_size == 1)] * world_size


def _validation_worker(comm: TorchCommunicator) -> list[str]:
    """Each bad call must raise its typed error before anything goes on the network: a good collective
    after them still lines up on both ranks."""
    t = torch.ones(6)
    buf = torch.empty(12)
    raised = []
    bad_calls = [
        (ArgumentTypeError, lambda: comm.all_reduce([1.0, 2.0])),
        (DeviceMismatchError, lambda: comm.all_reduce(torch.ones(6, device="meta"))),
        (ShapeError, lambda: comm.all_reduce(torch.ones(4, 6).t())),
        (DTypeError, lambda: comm.all_reduce(torch.ones(6, dtype=torch.int16))),
        (DTypeError, lambda: comm.all_reduce(torch.ones(6, dtype=torch.int32), "avg")),
        (InvalidArgumentError, lambda: comm.all_reduce(t, "median")),
        (ShapeError, lambda: comm.all_gather(torch.empty(11), t)),
        (DTypeError, lambda: comm.all_gather(torch.empty(12, dtype=torch.float64), t)),
        (ShapeError, lambda: comm.all_gather([torch.empty(6)], t)),
        (InvalidArgumentError, lambda: comm.all_gather(buf, buf[:6])),
        (ShapeError, lambda: comm.reduce_scatter(torch.empty(4), t)),
        (ShapeError, lambda: comm.all_to_all(torch.empty(6), torch.ones(5))),
        (ShapeError, lambda: comm.all_to_all(torch.empty(6), t, [3, 3], [2, 2])),
        (InvalidArgumentError, lambda: comm.all_to_all(torch.empty(6), t, [3, 3], [6])),
        (ShapeError, lambda: comm.all_to_all(torch.empty(6, 2), t)),
        (InvalidArgumentError, lambda: comm.broadcast(t, 2)),
        (InvalidArgumentError, lambda: comm.send(t, comm.rank)),
        (InvalidArgumentError, lambda: comm.recv(t, -1)),
        (InvalidArgumentError, lambda: comm.split([[0], [0, 1]])),
        (ArgumentTypeError, lambda: comm.split([])),
    ]
    for i, (err, call) in enumerate(bad_calls):
        try:
            call()
        except err as e:
            assert str(e), "error without a message"
            raised.append(type(e).__name__)
        else:
            raise AssertionError(f"bad call #{i}: no {err.__name__} raised")
    x = torch.full((3,), float(comm.rank + 1))
    comm.all_reduce(x)  # still in step with the peer
    assert x.tolist() == [3.0, 3.0, 3.0]
    return raised


def test_bad_arguments_raise_typed_errors_before_the_network():
    raised = run_local(_validation_worker, 2, op_timeout=10)
    assert raised[0] == raised[1] and len(raised[0]) == 20


def _mismatch_worker(comm: TorchCommunicator) -> str:
    checked = TorchCommunicator(comm.group, timeout=10, check_consistency=True)
    try:
        checked.all_reduce(torch.ones(5 + comm.rank))  # rank 1 passes 6 elements
    except CollectiveMismatchError as e:
        return str(e)
    return "no error"


def test_consistency_check_names_the_disagreeing_ranks():
    msgs = run_local(_mismatch_worker, 2, op_timeout=10)
    for m in msgs:
        assert "rank 0: call #1 all_reduce of 5 elements" in m and "rank 1: call #1 all_reduce of 6 elements" in m


def _dying_worker(comm: TorchCommunicator, how: str) -> tuple[str, float]:
    if comm.rank == 1:
        if how == "exit":
            os._exit(3)
        raise ValueError("rank 1 gives up")
    t0 = time.monotonic()
    try:
        comm.all_reduce(torch.ones(1000))
        comm.all_reduce(torch.ones(1000))
    except CollectiveError as e:
        return str(e), time.monotonic() - t0
    return "completed", time.monotonic() - t0


@pytest.mark.parametrize("how", ["exit", "raise"])
def test_a_failed_rank_makes_the_others_fail_within_the_timeout(how):
    op_timeout = 4.0
    t0 = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        run_local(_dying_worker, 3, how, op_timeout=op_timeout, timeout=120)
    elapsed = time.monotonic() - t0
    err = info.value
    assert set(err.failures) == {1}
    if how == "exit":
        assert "exited with code 3" in err.failures[1]
    else:
        assert "ValueError: rank 1 gives up" in err.failures[1] and "Traceback" in str(err)
    for r in (0, 2):
        msg, waited = err.values[r]
        assert f"all_reduce failed on rank {r} of 3" in msg, msg
        assert waited < op_timeout + 10
    assert elapsed < 60


def _sum_rank(comm):
    return comm.rank


def test_run_local_argument_errors():
    with pytest.raises(InvalidArgumentError):
        run_local(_sum_rank, 0)
    with pytest.raises(InvalidArgumentError):
        run_local(_sum_rank, 2, backend="mpi")
    with pytest.raises(InvalidArgumentError, match="start_method"):
        run_local(_sum_rank, 2, start_method="fork")
    from torsh_kernels.collectives.launch import set_defaults

    with pytest.raises(InvalidArgumentError, match="start_method"):
        set_defaults(start_method="fork")
    with pytest.raises(InvalidArgumentError, match="preload"):
        set_defaults(preload="tests.faults")  # a string, not a list of names


def _leaves_early_or_late(comm, pid_file):
    """Rank 0 returns at once; rank 1 looks, 1.5 s later, whether rank 0's process is still running."""
    if comm.rank == 0:
        with open(pid_file + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.replace(pid_file + ".tmp", pid_file)
        return "returned"
    while not os.path.exists(pid_file):
        time.sleep(0.01)
    time.sleep(1.5)
    with open(pid_file) as f:
        pid = int(f.read())
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "rank 0 gone"
    return "rank 0 running" if state != "Z" else "rank 0 exited"


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads process states from /proc")
@pytest.mark.parametrize("method", [pytest.param("spawn", marks=pytest.mark.slow), "forkserver"])
def test_a_rank_that_returns_early_stays_until_every_rank_has_returned(tmp_path, method):
    """A rank that runs no collective must not exit (closing its gloo sockets) while a peer is still busy:
    a slower peer still connecting its mesh in init_process_group failed with "Connection closed by peer"
    (seen in CI about once in 150 launches of 4 ranks under load)."""
    out = run_local(_leaves_early_or_late, 2, str(tmp_path / "pid"), start_method=method, op_timeout=30)
    assert out == ["returned", "rank 0 running"]


def _env_seen(comm, names):
    return [os.environ.get(n) for n in names]


@pytest.mark.parametrize("method", [pytest.param("spawn", marks=pytest.mark.slow), "forkserver"])
def test_run_local_ranks_see_the_callers_environment_as_it_is_now(monkeypatch, method):
    """Both start methods hand each rank the caller's current environment; a fork server started before a
    TORSH_ variable changed is not used for that launch (the ranks then start fresh, with the new value)."""
    from torsh_kernels.collectives import launch

    run_local(_sum_rank, 2, start_method=method)  # (the fork server, if any, is started by now)
    monkeypatch.setenv("TORSH_TEST_ONLY_PLAIN_VAR_X", "1")  # an import-time prefix: not the server's value
    monkeypatch.setenv("SOME_RUNTIME_ONLY_VAR", "abc")
    names = ["TORSH_TEST_ONLY_PLAIN_VAR_X", "SOME_RUNTIME_ONLY_VAR"]
    for seen in run_local(_env_seen, 2, names, start_method=method):
        assert seen == ["1", "abc"]
    if method == "forkserver":
        assert not launch.preload_forkserver(None, _env_seen)  # differs from the server's: spawn was used
        monkeypatch.delenv("TORSH_TEST_ONLY_PLAIN_VAR_X")
        if launch.server_env_matches():
            monkeypatch.setenv("SOME_RUNTIME_ONLY_VAR", "def")  # not an import-time prefix: the forks get it
            for seen in run_local(_env_seen, 2, names, start_method=method):
                assert seen == [None, "def"]


def test_gloo_timeouts_are_collective_timeout_errors():
    """gloo reports an expired timeout as a plain RuntimeError; the communicator's error says timeout by its
    class (the messages are gloo's own, from the fault suite's runs)."""
    from torsh_kernels.collectives.communicator import is_timeout

    assert is_timeout(RuntimeError("Operation timed out!"))
    assert is_timeout(RuntimeError("[../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 2000ms for recv "
                                   "operation to complete"))  # fmt: skip
    assert is_timeout(TimeoutError("x"))
    assert not is_timeout(RuntimeError("[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1"))


def test_communicator_needs_an_initialised_process_group():
    with pytest.raises(InvalidArgumentError, match="init_process_group"):
        TorchCommunicator()


def _traffic_worker(comm: TorchCommunicator) -> tuple[int, int, int]:
    c = TorchCommunicator(check_consistency=False)  # the check's own all-gathers would be counted too
    ws, me = c.world_size, c.rank
    c.all_reduce(torch.ones(300))  # 1200 B
    c.all_gather(torch.empty(ws * 10), torch.ones(10))  # 40 B
    c.reduce_scatter(torch.empty(10), torch.ones(ws * 10))  # 120 B at 3 ranks
    c.all_to_all(torch.empty(ws * 10), torch.ones(ws * 10))  # 120 B
    c.broadcast(torch.ones(7), 0)  # 28 B from the root
    h = c.send(torch.ones(5), (me + 1) % ws, async_op=True)  # 20 B
    c.recv(torch.empty(5), (me - 1) % ws)
    h.wait()
    t = c.traffic
    return t.collectives, t.payload_bytes, t.wire_bytes


def test_traffic_counts_every_collective_by_the_ring_formulas():
    """comm.traffic at 3 ranks, against figures worked out by hand: all-reduce 2(W-1)/W of 1200 B = 1600,
    all-gather (W-1) x 40 = 80, reduce-scatter and all-to-all (W-1)/W x 120 = 80 each, broadcast 28 on the
    root only, send 20, a receive nothing."""
    out = run_local(_traffic_worker, 3, op_timeout=60)
    assert out[0] == (7, 1200 + 40 + 120 + 120 + 28 + 20, 1600 + 80 + 80 + 80 + 28 + 20)
    assert out[1] == out[2] == (7, 1200 + 40 + 120 + 120 + 20, 1600 + 80 + 80 + 80 + 20)
