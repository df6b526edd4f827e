"""Fault injection for the distributed tests (tests/parallel/test_faults.py): one rank of a real gloo job
dies, raises, lingers or sends NaN at a chosen point of a step, and what the other ranks see is recorded.

Only the faulty rank is altered: it runs the workload through :class:`FaultyCommunicator`, a
Communicator around a real :class:`~torsh_kernels.collectives.TorchCommunicator` that counts the
collectives of the armed step and fires the fault at one of them; the surviving ranks run the
library's ordinary path (a process group for the DDP hook and FSDP2's comms, a TorchCommunicator
elsewhere), untouched. Both issue the same collectives on the wire, so the survivors meet exactly what
they would meet if a real peer failed there.

Phases are derived from the run: a clean run counts the armed step's collectives (``n``); the phases
are then ``before#k`` (the faulty rank stops before issuing collective ``k``), ``done#k`` (right after
collective ``k`` completed on it, before the caller goes on: between two rounds, or in the decode after
the last one) for ``k < n``, and ``after`` (once its step returned: the survivors then fail in the next
step). NaN has its own phases: ``input`` (the faulty rank's gradient or input holds a NaN) and
``send#k`` for every collective whose payload is floating point (the payload turns NaN on the wire).

Scenarios start from a fork server (``run_local(start_method="forkserver")``: about 0.1 s a launch)
and several run at once: most of their time is spent waiting for a timeout, not computing. The server
imports this module with ``TORSH_FAULTS_WARM=1`` (set by :func:`run_scenario` when it starts the server;
in the test suite ``tests/conftest.py`` sets it and names this module in ``TORSH_RUN_LOCAL_PRELOAD`` for the
one server every distributed test forks from), which runs every kernel and optimizer of the workloads once
there (:func:`_warm`), so the ranks forked from it load nothing.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime
import hashlib
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from torsh_kernels.collectives import TorchCommunicator, run_local
from torsh_kernels.compression import PowerSGD, TopK, compressed_all_reduce
from torsh_kernels.errors import RankFailedError, TorshKernelsError
from torsh_kernels.parallel import (
    CompressionHookState,
    ExpertParallelMoE,
    GradientSynchronizer,
    OffloadedOptimizer,
    apply_quantized_comm,
    compression_hook,
)
from torsh_kernels.parallel.fsdp import RESIDUAL

KINDS = ("die", "raise", "linger", "nan")
SETUP_TIMEOUT = 60.0
"""The default group's timeout in a scenario: it only carries the setup (a slow start is no fault)."""


class InjectedFault(Exception):
    """The exception a "raise" fault throws on the faulty rank: user code failing between collectives
    (deliberately not a torsh error)."""


@dataclasses.dataclass(frozen=True)
class Fault:
    kind: str
    """One of KINDS, or "none" for the clean run that counts the collectives."""
    phase: str = ""
    """before#k, done#k, after (die, raise, linger); input, send#k (nan)."""
    rank: int = 1
    """The faulty rank."""


def phases(kind: str, collectives: list[tuple[str, bool]]) -> list[str]:
    """Every phase of a step that issues ``collectives`` ((name, floating-point payload) each, in order)."""
    n = len(collectives)
    if kind == "nan":
        return ["input"] + [f"send#{k}" for k, (_, fl) in enumerate(collectives) if fl]
    return [p for k in range(n) for p in (f"before#{k}", f"done#{k}")] + ["after"]


def representative(ps: list[str]) -> list[str]:
    """First, middle and last phase."""
    if len(ps) <= 3:
        return list(ps)
    return [ps[0], ps[len(ps) // 2], ps[-1]]


# -- the faulty rank ----------------------------------------------------------------------------------------


class Injector:
    """Counts the armed step's collectives on the faulty rank and fires the fault at its phase."""

    def __init__(self, fault: Fault, timeout: float, folder: str, world: int) -> None:
        self.fault, self.timeout, self.folder, self.world = fault, timeout, folder, world
        self.armed = False
        self.count = 0
        self.log: list[tuple[str, bool]] = []
        self.fired = False

    def before(self, name: str, sends: list[torch.Tensor]) -> int:
        if not self.armed:
            return -1
        k = self.count
        self.count += 1
        self.log.append((name, any(t.is_floating_point() and t.numel() for t in sends)))
        ph = self.fault.phase
        if ph == f"before#{k}":
            self.fire()
        elif ph == f"send#{k}" and self.fault.kind == "nan":
            self.stamp()
            with torch.no_grad():
                for t in sends:
                    if t.is_floating_point() and t.numel():
                        t.view(-1)[t.numel() // 2] = float("nan")
        return k

    def done(self, k: int) -> None:
        if k >= 0 and self.fault.phase == f"done#{k}":
            self.fire()

    def after_step(self) -> None:
        if self.fault.phase == "after":
            self.fire()

    def stamp(self) -> None:
        """The fault's wall-clock time, for the survivors' time to error."""
        self.fired = True
        path = os.path.join(self.folder, "fault")
        with open(path + ".tmp", "w") as f:
            f.write(repr(time.time()))
        os.replace(path + ".tmp", path)

    def fire(self) -> None:
        kind = self.fault.kind
        if kind not in ("die", "raise", "linger"):
            return
        self.stamp()
        if kind == "die":
            os.kill(os.getpid(), signal.SIGKILL)
        if kind == "raise":
            raise InjectedFault(f"injected at {self.fault.phase}")
        # linger: no progress until every survivor has its error (bounded), then go on with the step
        wait_for_survivors(self.folder, self.world, self.fault.rank, 3 * self.timeout + 10)


def wait_for_survivors(folder: str, world: int, faulty: int, limit: float) -> None:
    end = time.monotonic() + limit
    while time.monotonic() < end:
        if all(os.path.exists(os.path.join(folder, f"done{r}")) for r in range(world) if r != faulty):
            return
        time.sleep(0.02)


class _Handle:
    __slots__ = ("_fired", "_h", "_inj", "_k")

    def __init__(self, h, inj: Injector, k: int) -> None:
        self._h, self._inj, self._k, self._fired = h, inj, k, False

    def _done(self) -> None:
        if not self._fired:
            self._fired = True
            self._inj.done(self._k)

    def wait(self) -> None:
        if self._h is not None:
            self._h.wait()
        self._done()

    def is_completed(self) -> bool:
        return self._h is None or self._h.is_completed()

    def future(self):
        get = getattr(self._h, "future", None)
        f = get() if get is not None else None
        if f is None:
            return None

        def then(fut):
            fut.value()
            self._done()

        return f.then(then)


class FaultyCommunicator:
    """A Communicator around ``inner`` that reports each collective to ``inj`` (see the module docstring)."""

    def __init__(self, inner: TorchCommunicator, inj: Injector) -> None:
        self.inner, self.inj = inner, inj

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    @property
    def rank(self) -> int:
        return self.inner.rank

    @property
    def world_size(self) -> int:
        return self.inner.world_size

    @property
    def device(self) -> torch.device:
        return self.inner.device

    @property
    def backend(self) -> str:
        return self.inner.backend

    def _go(self, name: str, sends: list[torch.Tensor], call, async_op: bool):
        k = self.inj.before(name, sends)
        h = _Handle(call(), self.inj, k)
        if async_op:
            return h
        h.wait()
        return None

    def all_reduce(self, tensor, op="sum", *, async_op=False):
        return self._go("all_reduce", [tensor], lambda: self.inner.all_reduce(tensor, op, async_op=True), async_op)

    def all_gather(self, output, input, *, async_op=False):
        return self._go("all_gather", [input], lambda: self.inner.all_gather(output, input, async_op=True), async_op)

    def reduce_scatter(self, output, input, op="sum", *, async_op=False):
        return self._go("reduce_scatter", [input],
                        lambda: self.inner.reduce_scatter(output, input, op, async_op=True), async_op)  # fmt: skip

    def broadcast(self, tensor, src, *, async_op=False):
        sends = [tensor] if src == self.rank else []
        return self._go("broadcast", sends, lambda: self.inner.broadcast(tensor, src, async_op=True), async_op)

    def all_to_all(self, output, input, output_splits=None, input_splits=None, *, async_op=False):
        return self._go("all_to_all", [input], lambda: self.inner.all_to_all(
            output, input, output_splits, input_splits, async_op=True), async_op)  # fmt: skip

    def send(self, tensor, dst, *, tag=0, async_op=False):
        return self._go("send", [tensor], lambda: self.inner.send(tensor, dst, tag=tag, async_op=True), async_op)

    def recv(self, tensor, src, *, tag=0, async_op=False):
        return self._go("recv", [], lambda: self.inner.recv(tensor, src, tag=tag, async_op=True), async_op)

    def barrier(self) -> None:
        self._go("barrier", [], lambda: self.inner.barrier(), False)

    def split(self, groups):
        return self.inner.split(groups)


# -- workloads ----------------------------------------------------------------------------------------------


def _gen(*key: int) -> torch.Generator:
    return torch.Generator().manual_seed(hash(key) & 0x7FFFFFFF)


def _mlp(hidden_layers: int = 1) -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Linear(24, 40), nn.ReLU()]
    for _ in range(hidden_layers - 1):
        layers += [nn.Linear(40, 40), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(40, 5))


def _batch(step: int, rank: int, poison: bool) -> tuple[torch.Tensor, torch.Tensor]:
    g = _gen(step, rank)
    x, y = torch.randn(8, 24, generator=g), torch.randn(8, 5, generator=g)
    if poison:
        x[3, 5] = float("nan")
    return x, y


class Workload:
    """One kind of step (``step(ctx, s, poison)``) over ``world`` ranks; step ``armed`` is the one faulted."""

    name = ""
    world = 3
    armed = 1
    steps = 3

    def build(self, pg, comm: TorchCommunicator, lib, rank: int, timeout: float) -> dict:
        """The step's objects over ``pg`` (a process group with the short timeout; ``comm`` a communicator
        over it), or over ``lib`` (the faulty rank's FaultyCommunicator) where that is not None."""
        raise NotImplementedError

    def step(self, ctx: dict, s: int, poison: bool) -> None:
        raise NotImplementedError

    def state(self, ctx: dict) -> list[list[torch.Tensor]]:
        """What the user gave, in groups that must each be all-or-nothing: first the parameters and the
        optimizer state (local shards), then any state the workload updates piecewise (FSDP2's
        per-module error-feedback residuals: each module's either before or after the step)."""
        out = [_local(p) for p in ctx["params"]]
        opt = ctx.get("opt")
        if opt is not None:
            out += _tensors(opt.state_dict())
        return [out, *([_local(t) for t in g] for g in ctx.get("pieces", []))]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _tensors(x) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [_local(x)]
    if isinstance(x, dict):
        return [t for k in sorted(x, key=str) for t in _tensors(x[k])]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _tensors(v)]
    return []


class CompressedAllReduce(Workload):
    """a. ``compressed_all_reduce`` of a gradient, then ``param -= 0.1 * average``."""

    def __init__(self, name: str, make, armed: int) -> None:
        self.name, self.make, self.armed = name, make, armed
        self.steps = armed + 2

    def build(self, pg, comm, lib, rank, timeout):
        c = self.make()
        torch.manual_seed(0)
        return {"comm": lib or comm, "c": c, "st": c.new_state(), "params": [torch.randn(33, 20)], "rank": rank}

    def step(self, ctx, s, poison):
        g = torch.randn(33, 20, generator=_gen(s, ctx["rank"]))
        if poison:
            g[4, 7] = float("nan")
        compressed_all_reduce(g, ctx["comm"], ctx["c"], ctx["st"])
        ctx["params"][0].sub_(0.1 * g)


class DDPStep(Workload):
    """b. ``DistributedDataParallel`` with torsh's compression hook, two buckets, the hook's defaults (no
    timeout of its own: the process group's applies)."""

    def __init__(self, name: str, make) -> None:
        self.name, self.make = name, make

    def build(self, pg, comm, lib, rank, timeout):
        model = _mlp(2)
        ddp = DistributedDataParallel(model, process_group=pg, bucket_cap_mb=0.004)  # two buckets from step 1 on
        state = CompressionHookState(lib or pg, self.make(), start_iter=0, min_numel=64)
        ddp.register_comm_hook(state, compression_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        return {"model": ddp, "opt": opt, "params": list(model.parameters()), "rank": rank}

    def step(self, ctx, s, poison):
        x, y = _batch(s, ctx["rank"], poison)
        nn.functional.mse_loss(ctx["model"](x), y).backward()
        ctx["opt"].step()
        ctx["opt"].zero_grad()


class FSDPStep(Workload):
    """c. FSDP2 (``fully_shard`` per layer) with torsh's int8 all-gather and reduce-scatter."""

    name = "fsdp2-int8"

    def build(self, pg, comm, lib, rank, timeout):
        mesh = DeviceMesh.from_group(pg, "cpu")
        model = _mlp()
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        apply_quantized_comm(model, weights="int8", grads="int8", block=32, comm=lib)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        pieces = [[b] for n, b in model.named_buffers() if n.endswith(RESIDUAL)]
        return {"model": model, "opt": opt, "params": list(model.parameters()), "pieces": pieces, "rank": rank}

    step = DDPStep.step


class MoEStep(Workload):
    """d. ``ExpertParallelMoE``: routing, dispatch and combine all_to_all, backward, reduce_gradients."""

    name = "moe-all_to_all"

    def build(self, pg, comm, lib, rank, timeout):
        torch.manual_seed(0)
        layer = ExpertParallelMoE(8, 12, 2 * comm.world_size, 2, lib or comm)
        opt = torch.optim.SGD(layer.parameters(), lr=0.05, momentum=0.9)
        return {"layer": layer, "opt": opt, "params": list(layer.parameters()), "rank": rank}

    def step(self, ctx, s, poison):
        g = _gen(s, ctx["rank"])
        x = torch.randn(7, 8, generator=g)
        if poison:
            x[2, 3] = float("nan")
        layer = ctx["layer"]
        y = layer(x)
        (y.pow(2).mean() + layer.aux_loss).backward()
        layer.reduce_gradients(average=True)
        ctx["opt"].step()
        ctx["opt"].zero_grad()


class OffloadStep(Workload):
    """e. ``GradientSynchronizer`` (two buckets, overlapped with backward) then ``OffloadedOptimizer``
    (AdamW, bf16 state, two chunks)."""

    name = "offload-sync"

    def build(self, pg, comm, lib, rank, timeout):
        model = _mlp()
        sync = GradientSynchronizer(model, lib or comm, bucket_mb=0.002, first_bucket_mb=0.002)
        opt = OffloadedOptimizer(model.parameters(), torch.optim.AdamW, "bf16", lr=1e-2, chunk_mb=0.002)
        return {"model": model, "sync": sync, "opt": opt, "params": list(model.parameters()), "rank": rank}

    def step(self, ctx, s, poison):
        x, y = _batch(s, ctx["rank"], poison)
        nn.functional.mse_loss(ctx["model"](x), y).backward()
        ctx["sync"].sync_gradients()
        ctx["opt"].step()
        ctx["opt"].zero_grad()


def _powersgd():
    return PowerSGD(rank=2)


def _topk():
    return TopK(0.1)


def _uncompressed():
    return None


WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        CompressedAllReduce("allreduce-powersgd", _powersgd, armed=0),  # a fresh state: seed broadcast, P, Q
        CompressedAllReduce("allreduce-topk", _topk, armed=1),
        DDPStep("ddp-powersgd", _powersgd),  # several rounds: the hook waits for them
        DDPStep("ddp-topk", _topk),  # one round: the hook returns the collective's future
        DDPStep("ddp-none", _uncompressed),  # one round, uncompressed: the averages checked at the end
        FSDPStep(),
        MoEStep(),
        OffloadStep(),
    )
}


def _warm() -> None:
    """Run each kernel and optimizer the workloads use once, so that what loads on first use (Numba's
    cached kernels and SciPy under them, torch._dynamo under the optimizers) is loaded in the fork server,
    before the ranks fork from it, not in every rank. On one thread: a fork must not inherit a started
    OpenMP pool."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _warm_once()
    finally:
        torch.set_num_threads(threads)


def _warm_once() -> None:
    from torsh_kernels.compression import Quantize, roundtrip
    from torsh_kernels.ops import pack, unpack
    from torsh_kernels.parallel import MoELayer

    x = torch.randn(33, 20)
    for c in (PowerSGD(rank=2), TopK(0.1), Quantize(8, block=32)):
        roundtrip(c, x, c.new_state())
    unpack(pack(x, "bf16"))
    unpack(pack(x, "int8"))
    layer = MoELayer(8, 12, 6, 2)
    layer(torch.randn(7, 8)).sum().backward()
    for opt in (torch.optim.SGD(layer.parameters(), lr=0.1, momentum=0.9), torch.optim.AdamW(layer.parameters())):
        opt.step()  # the first optimizer imports torch._dynamo (about a second)


# (not in a rank spawned afresh, a process started with --multiprocessing-fork: a launch that could not fork
# from the warm server loads only what its ranks use)
if os.environ.get("TORSH_FAULTS_WARM") == "1" and "--multiprocessing-fork" not in sys.argv:
    _warm()


# -- one scenario, on every rank ------------------------------------------------------------------------------


def digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha1()
    for t in tensors:
        h.update(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def _finite(tensors: list[torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors if t.is_floating_point())


def worker(comm: TorchCommunicator, wl_name: str, fault: Fault, timeout: float, folder: str) -> dict:
    """One rank of a scenario. ``comm`` (run_local's, over the default group) has a long timeout and only
    brackets the setup; the workload runs on a group whose timeout is ``timeout``."""
    t0, c0 = time.monotonic(), time.process_time()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    wl = WORKLOADS[wl_name]
    me, world = comm.rank, comm.world_size
    pg = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=timeout))
    inj = Injector(fault, timeout, folder, world) if me == fault.rank else None
    lib = FaultyCommunicator(TorchCommunicator(pg, timeout=timeout), inj) if inj is not None else None
    comm.barrier()
    ctx = wl.build(pg, TorchCommunicator(pg, timeout=timeout), lib, me, timeout)
    comm.barrier()  # every rank built its step: from here on only the short timeout applies
    rec: dict = {"rank": me, "hashes": [], "error": None, "finite": True}
    rec["times"] = [("built", time.monotonic() - t0, time.process_time() - c0)]
    s = -1
    try:
        for s in range(wl.steps):
            rec["hashes"].append([digest(g) for g in wl.state(ctx)])
            armed = inj is not None and s == wl.armed
            poison = armed and fault.kind == "nan" and fault.phase == "input"
            if armed:
                inj.armed = True
                if poison:
                    inj.stamp()
            wl.step(ctx, s, poison)
            if armed:
                inj.armed = False
                inj.after_step()
            rec["times"].append((f"step{s}", time.monotonic() - t0, time.process_time() - c0))
    except BaseException as e:
        rec["error"] = _error(e, s)
    st = wl.state(ctx)
    rec["final"] = [digest(g) for g in st]
    rec["finite"] = all(_finite(g) for g in st)
    if inj is not None:
        rec["collectives"] = inj.log
    rec["times"].append(("end", time.monotonic() - t0, time.process_time() - c0))
    open(os.path.join(folder, f"done{me}"), "w").close()
    if inj is not None and fault.kind == "raise":
        wait_for_survivors(folder, world, fault.rank, 3 * timeout + 10)  # alive, but not joining
    return rec


def _error(e: BaseException, step: int) -> dict:
    msg = str(e).strip().splitlines()
    return {
        "type": type(e).__name__,
        "typed": isinstance(e, TorshKernelsError),
        "mro": [k.__name__ for k in type(e).__mro__],
        "message": msg[0][:300] if msg else "",
        "step": step,
        "time": time.time(),
    }


# -- the parent: run scenarios, judge them --------------------------------------------------------------------


@dataclasses.dataclass
class Outcome:
    """What one scenario showed: ``ok`` when every survivor ended with a typed error in time and its state
    is as before or as after the step it failed in."""

    workload: str
    fault: Fault
    ok: bool
    problems: list[str]
    survivors: dict[int, dict]
    faulty: dict | str | None
    wall: float
    to_error: list[float]
    """Seconds from the fault to each survivor's typed error."""
    early: bool = False
    """A survivor failed before the fault fired (a clean collective outlived the short timeout on a loaded
    machine): the scenario proves nothing and is run again."""

    def errors(self) -> str:
        return ",".join(sorted({v["error"]["type"] for v in self.survivors.values() if v.get("error")})) or "none"

    def faulty_error(self) -> str:
        f = self.faulty
        if not isinstance(f, dict):
            return "exited"
        return f["error"]["type"] if f["error"] else "none"

    def line(self) -> str:
        return (
            f"{self.workload:18} {self.fault.kind:6} {self.fault.phase:9} {'ok' if self.ok else 'FAIL':4} "
            f"survivors: {self.errors():40} faulty rank: {self.faulty_error():22} "
            f"{max(self.to_error, default=float('nan')):5.2f} s  " + "; ".join(self.problems)
        )


def run_scenario(wl_name: str, fault: Fault, timeout: float) -> tuple[list, float | None, float]:
    """Every rank's record (a string where a rank gave none: how it exited or that it was terminated), the
    fault's wall-clock time (None if it never fired) and the scenario's wall time."""
    wl = WORKLOADS[wl_name]
    folder = tempfile.mkdtemp(prefix="torsh-fault-")
    os.environ["TORSH_FAULTS_WARM"] = "1"  # read where the fork server imports this module (if this call starts it)
    t0 = time.monotonic()
    try:
        try:
            values = run_local(worker, wl.world, wl_name, fault, timeout, folder, op_timeout=SETUP_TIMEOUT,
                               timeout=3 * timeout + 30, threads=1, start_method="forkserver")  # fmt: skip
        except RankFailedError as e:
            values = [v if v is not None else e.failures.get(r, "no result") for r, v in enumerate(e.values)]
            values += [e.failures.get(r, "no result") for r in range(len(values), wl.world)]
        fault_time = None
        p = os.path.join(folder, "fault")
        if os.path.exists(p):
            with open(p) as f:
                fault_time = float(f.read())
        return values, fault_time, time.monotonic() - t0
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def clean_run(wl_name: str, timeout: float) -> dict:
    """The workload without a fault: the armed step's collectives (on the rank that would be faulty) and
    every rank's state digests before each step and at the end."""
    values, _, _ = run_scenario(wl_name, Fault("none"), timeout)
    bad = [v if not isinstance(v, dict) else v["error"] for v in values if not isinstance(v, dict) or v["error"]]
    if bad:
        raise AssertionError(f"{wl_name}: the run without a fault failed: {bad}")
    return {"collectives": values[1]["collectives"], "hashes": [v["hashes"] + [v["final"]] for v in values]}


def judge(wl_name: str, fault: Fault, clean: dict, values: list, fault_time: float | None, wall: float,
          timeout: float, slack: float) -> Outcome:  # fmt: skip
    problems: list[str] = []
    survivors: dict[int, dict] = {}
    to_error: list[float] = []
    early = False
    if fault_time is None:
        problems.append("the fault never fired")
    for r, v in enumerate(values):
        if r == fault.rank:
            continue
        if not isinstance(v, dict):
            problems.append(f"rank {r} gave no result ({v}): a hang past the deadline, or a crash")
            continue
        survivors[r] = v
        err = v["error"]
        if err is None:
            problems.append(f"rank {r} finished every step without an error")
            continue
        if not err["typed"]:
            problems.append(f"rank {r} got an untyped {err['type']} at step {err['step']}: {err['message']}")
        s = err["step"]
        hashes = clean["hashes"][r]
        if fault_time is None or err["time"] < fault_time:
            early = True
            problems.append(f"rank {r} failed before the fault, at step {s}: {err['type']}: {err['message']}")
        else:
            for g, final in enumerate(v["final"]):
                if final not in (hashes[s][g], hashes[s + 1][g]):
                    what = "its parameters/optimizer state are" if g == 0 else f"its state piece {g} (a residual) is"
                    problems.append(
                        f"rank {r}: after its error at step {s} {what} neither the values before that step nor the "
                        "correct ones after it" + ("" if v["finite"] else " (NaN/Inf in its state)")
                    )
            dt = err["time"] - fault_time
            to_error.append(dt)
            if dt > timeout + slack:
                problems.append(f"rank {r}: typed error {dt:.2f} s after the fault (limit {timeout:g} + {slack:g} s)")
    faulty = values[fault.rank] if fault.rank < len(values) else None
    if fault.kind != "die" and not isinstance(faulty, dict):  # it raised, stalled or sent NaN: it must live on
        problems.append(f"the faulty rank died ({faulty}): an abort inside the backend, a crash")
    return Outcome(wl_name, fault, not problems, problems, survivors, faulty, wall, to_error, early)


def run_matrix(plan: list[tuple[str, Fault]], cleans: dict, timeout: float, slack: float,
               parallel: int = 6) -> list[Outcome]:  # fmt: skip
    """Run the scenarios ``parallel`` at a time (most of a scenario is waiting for a timeout); a scenario
    where a survivor failed before the fault is run once more, alone."""

    def one(w: str, f: Fault) -> Outcome:
        values, fault_time, wall = run_scenario(w, f, timeout)
        return judge(w, f, cleans[w], values, fault_time, wall, timeout, slack)

    with concurrent.futures.ThreadPoolExecutor(parallel) as ex:
        out = list(ex.map(lambda wf: one(*wf), plan))
    return [one(o.workload, o.fault) if o.early else o for o in out]


def plan_for(cleans: dict, full: bool) -> list[tuple[str, Fault]]:
    """Every workload x fault kind x phase (``full``), or x its first, middle and last phase."""
    plan = []
    for w, c in cleans.items():
        for kind in KINDS:
            ps = phases(kind, c["collectives"])
            for p in ps if full else representative(ps):
                plan.append((w, Fault(kind, p)))
    return plan


def summary(outcomes: list[Outcome]) -> str:
    """One line per scenario, then the time to a typed error per fault kind."""
    lines = [o.line() for o in outcomes]
    by_kind: dict[str, list[float]] = {}
    for o in outcomes:
        by_kind.setdefault(o.fault.kind, []).extend(o.to_error)
    for k, v in by_kind.items():
        if v:
            lines.append(f"time to a typed error after a '{k}' fault: median {statistics.median(v):.2f} s, "
                         f"max {max(v):.2f} s ({len(v)} survivors)")  # fmt: skip
    return "\n".join(lines)
