"""The ``Communicator`` over a ``torch.distributed`` process group: :class:`TorchCommunicator`, and
:func:`as_communicator`, which turns what APIs accept as a group (a communicator, a ``ProcessGroup``, a
``DeviceMesh``, ``(mesh, dim)``) into a communicator.

The protocol itself (what every call takes, returns and checks), :class:`CommunicatorBase` and the group
helpers are defined in :mod:`.protocol` and importable from here as well.

What one rank cannot check alone is whether its peers issue the same collective with the same sizes.
``TorchCommunicator(..., check_consistency=True)`` (or ``TORSH_KERNELS_CHECK_COLLECTIVES=1``) adds a
small all-gather of each call's signature (sequence number, operation, element count, dtype) before it
and raises :class:`~torsh_kernels.errors.CollectiveMismatchError` naming the ranks that disagree: a
debugging aid, off by default because it doubles the number of messages.
"""

from __future__ import annotations

import datetime
import threading
import zlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from .. import recording
from ..checks import check_timeout, env_flag

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
from ..errors import (
    ArgumentTypeError,
    CollectiveError,
    CollectiveMismatchError,
    InvalidArgumentError,
)
from .protocol import (
    REDUCE_OPS,
    Communicator,
    CommunicatorBase,
    Handle,
    is_communicator,
    is_mesh,
    is_mesh_dim,
    resolve_group,
)
from .protocol import CompletedHandle as CompletedHandle  # (defined in .protocol, importable from here as before)
from .protocol import is_dtensor as is_dtensor
from .protocol import is_timeout as is_timeout
from .protocol import reject_dtensor as reject_dtensor
from .traffic import Traffic

__all__ = ["REDUCE_OPS", "Communicator", "CommunicatorBase", "Handle", "TorchCommunicator", "as_communicator"]

# dtypes each backend can reduce (gloo has no int16; NCCL has no int16 and no bool)
_GLOO_REDUCE = {torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
                torch.int32, torch.int64}  # fmt: skip
_NCCL_REDUCE = _GLOO_REDUCE

_ALLREDUCE_OPTS: dict[str, dist.AllreduceOptions] = {}


def _allreduce_options(op: str) -> dist.AllreduceOptions:
    """The (never mutated) options of an all-reduce with this op, made once."""
    o = _ALLREDUCE_OPTS.get(op)
    if o is None:
        o = dist.AllreduceOptions()
        o.reduceOp = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
                      "product": dist.ReduceOp.PRODUCT, "avg": dist.ReduceOp.SUM}[op]  # fmt: skip
        _ALLREDUCE_OPTS[op] = o
    return o


_OP_IDS = {"all_reduce": 1, "all_gather": 2, "reduce_scatter": 3, "broadcast": 4, "all_to_all": 5, "barrier": 6}


class TorchHandle:
    """A torch ``Work`` plus what to do once it completes (a copy back, a division for ``avg``)."""

    __slots__ = ("_comm", "_done", "_fut", "_span", "_then", "_what", "_works", "error")

    def __init__(self, comm: TorchCommunicator, works: list, what: str, then: Callable[[], None] | None = None,
                 span=None):  # fmt: skip
        self._comm = comm
        self._works = works
        self._what = what
        self._then = then
        self._done = False
        self._fut = None
        self._span = span  # the timeline's interval of this collective, when a recorder is active
        self.error: CollectiveError | None = None
        """The typed error the work failed with, once it failed. torch's futures turn an exception raised
        in a callback into a ``RuntimeError`` ("Got the following error when running the callback: ..."),
        so code that waits on :meth:`future` recovers the ``CollectiveError`` here."""

    def future(self) -> torch.futures.Future | None:
        """A ``torch.futures.Future`` that completes (with None) once the work is done and its follow-up
        (``avg``'s division) has run, failing with ``CollectiveError`` if the work failed; for chaining
        with ``.then`` instead of blocking in ``wait()`` (DDP comm hooks). None where there is none: the
        work has no future, or a wait timeout is set (only ``wait()`` honours it). ``wait()`` remains
        valid afterwards and waits on this future."""
        if self._fut is not None:
            return self._fut
        c = self._comm
        if c._wait_timeout is not None:
            return None
        try:
            futs = [w.get_future() for w in self._works if w is not None]
        except Exception:  # e.g. point-to-point works on some backends
            return None
        fut = futs[0] if len(futs) == 1 else torch.futures.collect_all(futs)

        def finish(f: torch.futures.Future) -> None:
            try:
                v = f.value()
                if len(futs) != 1:
                    for x in v:
                        x.value()
            except Exception as e:
                if self._span is not None:
                    self._span.end(error=f"{type(e).__name__}")
                self.error = c._failure(self._what, e)
                raise self.error from e
            self._done = True
            if self._then is not None:
                self._then()

        self._fut = fut.then(finish)
        return self._fut

    def wait(self) -> None:
        if self._done:
            return
        if self._fut is not None:
            self._fut.wait()
            return
        c = self._comm
        try:
            for w in self._works:
                if w is None:
                    continue
                if c._wait_timeout is not None:
                    w.wait(c._wait_timeout)
                else:
                    w.wait()
        except CollectiveError:
            raise
        except Exception as e:  # gloo / NCCL report peer loss and timeouts as RuntimeError (or subclasses)
            if self._span is not None:
                self._span.end(error=f"{type(e).__name__}")
            self.error = c._failure(self._what, e)
            raise self.error from e
        self._done = True
        if self._span is not None:
            self._span.end()  # no-op where the backend's completion callback ended it already
        if self._then is not None:
            self._then()

    def is_completed(self) -> bool:
        return self._done or all(w is None or w.is_completed() for w in self._works)


class TorchCommunicator(CommunicatorBase):
    """A :class:`Communicator` over a ``torch.distributed`` process group (gloo on CPU, NCCL on GPU).

    ``group`` is any process group (``None``: the default one; subgroups from ``dist.new_group`` work,
    ranks are then group ranks) or a ``DeviceMesh`` with ``dim`` naming the dimension to communicate over
    (``TorchCommunicator(mesh, dim="dp")``; a 1-D mesh needs no ``dim``). ``timeout`` (seconds) bounds
    each wait on gloo, where ``Work.wait`` honours it; the group's own timeout
    (``init_process_group(timeout=...)``) applies as well, and for NCCL it is the only one (the watchdog
    aborts the communicator).
    """

    __slots__ = ("_check", "_group", "_pg", "_seq", "_wait_timeout")

    def __init__(
        self,
        group: dist.ProcessGroup | DeviceMesh | None = None,
        *,
        dim: str | int | None = None,
        timeout: float | None = None,
        check_consistency: bool | None = None,
    ) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise InvalidArgumentError(
                "TorchCommunicator: torch.distributed is not initialised; call "
                "torch.distributed.init_process_group(...) first (torchrun sets the environment it needs), "
                "or launch local ranks with torsh_kernels.collectives.run_local"
            )
        group = resolve_group(group, dim, "TorchCommunicator")
        if timeout is not None:
            timeout = check_timeout(timeout, "TorchCommunicator")
        rank = dist.get_rank(group)
        if rank < 0:
            raise InvalidArgumentError("TorchCommunicator: this process is not a member of the given group")
        self._group = group
        self._traffic = Traffic()
        self._pg = group if group is not None else dist.group.WORLD  # what all_reduce calls directly
        self._rank = rank
        self._world = dist.get_world_size(group)
        self._ranks = dist.get_process_group_ranks(group) if group is not None else list(range(self._world))
        self._backend = str(dist.get_backend(group)).lower()
        self._reduce_dtypes = _NCCL_REDUCE if "nccl" in self._backend else _GLOO_REDUCE
        if "nccl" in self._backend:
            self._device = torch.device("cuda", torch.cuda.current_device())
        else:
            self._device = torch.device("cpu")
        gloo = "gloo" in self._backend
        self._wait_timeout = datetime.timedelta(seconds=timeout) if timeout is not None and gloo else None
        if check_consistency is None:
            check_consistency = env_flag("TORSH_KERNELS_CHECK_COLLECTIVES", False, "TorchCommunicator")
        self._check = bool(check_consistency)
        self._seq = 0

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The wrapped process group (``None``: the default group)."""
        return self._group

    def _torch_op(self, op: str):
        R = dist.ReduceOp
        return {"sum": R.SUM, "max": R.MAX, "min": R.MIN, "product": R.PRODUCT, "avg": R.SUM}[op]

    def _consistent(self, what: str, numel: int, dtype: torch.dtype, extra: int = 0) -> None:
        """With check_consistency: all ranks compare (sequence, op, numel, dtype, extra) before the call."""
        self._seq += 1
        if not self._check:
            return
        fields = [self._seq, _OP_IDS[what], numel, zlib.crc32(str(dtype).encode()), extra]
        sig = torch.tensor(fields, dtype=torch.int64, device=self._device)
        allsig = torch.empty(self._world * sig.numel(), dtype=torch.int64, device=self._device)
        self._run(what + " (consistency check)", lambda: _all_gather_single(allsig, sig, self._group),
                  nbytes=sig.nbytes, op="all_gather")  # fmt: skip
        rows = allsig.view(self._world, -1).tolist()
        if any(r != rows[0] for r in rows):
            names = {v: k for k, v in _OP_IDS.items()}
            desc = "; ".join(
                f"rank {i}: call #{r[0]} {names.get(r[1], r[1])} of {r[2]} elements (extra {r[4]})"
                for i, r in enumerate(rows)
            )
            raise CollectiveMismatchError(f"{what}: ranks issued different collectives at the same point: {desc}")

    def _run(self, what: str, launch: Callable[[], object], then: Callable[[], None] | None = None,
             async_op: bool = False, *, nbytes: int = 0, op: str | None = None) -> TorchHandle | None:  # fmt: skip
        traffic = self._traffic
        traffic.add(op or what, nbytes, self._world)
        timed = traffic.timed
        rec = recording.recorder
        span = None
        if rec is not None:
            cuda = self._device if self._device.type == "cuda" else None
            span = rec.collective(op or what, group=self._ranks, nbytes=nbytes, device=cuda)
        if timed:
            traffic.issued()
        try:
            work = launch()
        except CollectiveError:
            if timed:
                traffic.completed()
            raise
        except Exception as e:
            if timed:
                traffic.completed()
            if span is not None:
                span.end(error=type(e).__name__)
            raise self._failure(what, e) from e
        works = work if isinstance(work, list) else [work]
        if span is not None and self._device.type != "cuda":
            _end_on_completion(works, span)
        if timed:
            _time_on_completion(works, traffic)
        h = TorchHandle(self, works, what, then, span)
        if async_op:
            return h
        h.wait()
        return None

    # -- collectives -------------------------------------------------------------------------------------

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", *, async_op: bool = False) -> Handle | None:
        what = "all_reduce"
        op = self._check_op(op, what)
        t = self._check_tensor(tensor, what, "tensor", reduce=True, op=op)
        self._consistent(what, t.numel(), t.dtype)
        then = (lambda: t.div_(self._world)) if op == "avg" else None
        # the process group's own call (what dist.all_reduce does for a real tensor, minus its wrappers: the
        # tensor is checked above; this is the hot path of the DDP hooks, once per bucket)
        opts = _allreduce_options(op)
        return self._run(what, lambda: self._pg.allreduce([t], opts), then, async_op, nbytes=t.nbytes)

    def all_gather(
        self, output: torch.Tensor | list[torch.Tensor], input: torch.Tensor, *, async_op: bool = False
    ) -> Handle | None:
        what = "all_gather"
        out, x = self._check_all_gather(output, input, what)
        self._consistent(what, x.numel(), x.dtype)
        if isinstance(out, list):
            return self._run(what, lambda: dist.all_gather(out, x, group=self._group, async_op=True), None, async_op,
                             nbytes=x.nbytes)  # fmt: skip
        return self._run(what, lambda: _all_gather_single(out, x, self._group), None, async_op, nbytes=x.nbytes)

    def reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, op: str = "sum", *, async_op: bool = False
    ) -> Handle | None:
        what = "reduce_scatter"
        out, x, op = self._check_reduce_scatter(output, input, op, what)
        self._consistent(what, out.numel(), out.dtype)
        then = (lambda: out.div_(self._world)) if op == "avg" else None
        rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return self._run(
            what, lambda: rs(out.view(-1), x.view(-1), self._torch_op(op), group=self._group, async_op=True), then,
            async_op, nbytes=x.nbytes,
        )  # fmt: skip

    def broadcast(self, tensor: torch.Tensor, src: int, *, async_op: bool = False) -> Handle | None:
        what = "broadcast"
        t = self._check_tensor(tensor, what, "tensor")
        src = self._check_peer(src, what, "src")
        self._consistent(what, t.numel(), t.dtype, src)
        g = self._ranks[src]
        return self._run(what, lambda: dist.broadcast(t, g, group=self._group, async_op=True), None, async_op,
                         nbytes=t.nbytes if src == self._rank else 0)  # fmt: skip

    def all_to_all(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_splits: Sequence[int] | None = None,
        input_splits: Sequence[int] | None = None,
        *,
        async_op: bool = False,
    ) -> Handle | None:
        what = "all_to_all"
        out, x, outs, ins = self._check_all_to_all(output, input, output_splits, input_splits, what)
        self._consistent(what, x.numel() // max(1, x.shape[0]), x.dtype)
        return self._run(
            what,
            lambda: dist.all_to_all_single(out, x, outs, ins, group=self._group, async_op=True),
            None,
            async_op,
            nbytes=x.nbytes,
        )

    def send(self, tensor: torch.Tensor, dst: int, *, tag: int = 0, async_op: bool = False) -> Handle | None:
        what = "send"
        t = self._check_tensor(tensor, what, "tensor")
        dst = self._check_peer(dst, what, "dst")
        g = self._ranks[dst]
        return self._run(what, lambda: dist.isend(t, g, group=self._group, tag=tag), None, async_op, nbytes=t.nbytes)

    def recv(self, tensor: torch.Tensor, src: int, *, tag: int = 0, async_op: bool = False) -> Handle | None:
        what = "recv"
        t = self._check_tensor(tensor, what, "tensor")
        src = self._check_peer(src, what, "source")
        g = self._ranks[src]
        return self._run(what, lambda: dist.irecv(t, g, group=self._group, tag=tag), None, async_op, nbytes=0)

    def barrier(self) -> None:
        self._consistent("barrier", 0, torch.int64)
        # a tiny all-reduce: same semantics as dist.barrier, and it honours the wait timeout on gloo
        t = torch.zeros(1, dtype=torch.int32, device=self._device)
        self._run("barrier", lambda: dist.all_reduce(t, group=self._group, async_op=True), nbytes=4)

    def split(self, groups: Sequence[Sequence[int]]) -> TorchCommunicator:
        """The communicator of the group holding this rank. ``groups`` partitions (or covers part of) this
        communicator's ranks; every member of the returned group must call with the same groups."""
        what = "split"
        mine = self._split_members(groups, what)
        global_ranks = sorted(self._ranks[r] for r in mine)
        timeout = None if self._wait_timeout is None else self._wait_timeout.total_seconds()
        try:
            pg = dist.new_group(global_ranks, use_local_synchronization=True)
        except Exception as e:
            raise self._failure(what, e) from e
        return TorchCommunicator(pg, timeout=timeout, check_consistency=self._check)


def _end_on_completion(works: list, span) -> None:
    """End the timeline span when the backend completes the work (gloo runs a future's callbacks on its
    own thread as the work finishes); where a work has no future, ``wait()`` ends the span instead."""
    try:
        futs = [w.get_future() for w in works if w is not None]
    except Exception:  # e.g. point-to-point works on some backends
        return
    if not futs:
        span.end()
        return
    left = [len(futs)]
    lock = threading.Lock()

    def done(_f) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            span.end()

    for f in futs:
        f.add_done_callback(done)


def _time_on_completion(works: list, traffic) -> None:
    """Tell ``traffic`` when the last of ``works`` completes (at once where a work has no future)."""
    try:
        futs = [w.get_future() for w in works if w is not None]
    except Exception:
        futs = []
    if not futs:
        traffic.completed()
        return
    f = futs[0] if len(futs) == 1 else torch.futures.collect_all(futs)
    f.add_done_callback(traffic.completed)


def _all_gather_single(out: torch.Tensor, x: torch.Tensor, group):
    ag = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return ag(out.view(-1), x.view(-1), group=group, async_op=True)


def as_communicator(
    comm: object, what: str, *, dim: str | int | None = None, needs: Sequence[str] = (), timeout: float | None = None
) -> Communicator:
    """``comm`` as a :class:`Communicator`, for APIs that take one: a Communicator is returned as it is; a
    ``ProcessGroup``, a ``DeviceMesh`` (``dim``: the dimension to communicate over, may be omitted for a
    1-D mesh) or a ``(mesh, dim)`` pair becomes a :class:`TorchCommunicator` over that group, with
    ``timeout`` (seconds each wait may take; a Communicator passed keeps its own). ``needs``: the methods a
    Communicator must have here (checked, with a typed error naming what may be passed)."""
    if comm.__class__ is TorchCommunicator and dim is None:
        return comm
    if isinstance(comm, dist.ProcessGroup) or is_mesh(comm) or is_mesh_dim(comm):
        return TorchCommunicator(resolve_group(comm, dim, what), timeout=timeout)
    if is_communicator(comm, needs):
        if dim is not None:
            raise InvalidArgumentError(
                f"{what}: a mesh dimension ({dim!r}) applies to a DeviceMesh, not to a communicator"
            )
        return comm
    raise ArgumentTypeError(
        f"{what}: comm must be a Communicator (e.g. TorchCommunicator()), a ProcessGroup, a DeviceMesh or (mesh, dim), "
        f"got {type(comm).__name__}"
    )
