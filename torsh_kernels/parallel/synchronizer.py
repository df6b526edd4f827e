"""Gradient synchronisation without DDP: the same bucketing, compression and pipelining as the DDP hook,
for training loops that drive their own backward and optimizer.

::

    sync = GradientSynchronizer(model, comm, bucket_mb=25, compressor=PowerSGD(rank=4))
    for x, y in data:
        loss_fn(model(x), y).backward()   # buckets start reducing as their gradients are ready
        sync.sync_gradients()             # the rest start; every gradient now holds the average
        opt.step()
        sync.zero_grad()

Buckets. Parameters are taken in the order their gradients are usually ready (the reverse of
``model.parameters()``, as DDP does; ``order="size"`` takes the largest first instead) and packed into
buckets of at most ``bucket_mb`` MiB (one dtype per bucket; a larger parameter gets a bucket of its
own). The first bucket is capped at ``first_bucket_mb`` (1 MiB, DDP's rule) so communication starts
early in the backward pass. ``set_bucketing(False)`` gives every parameter its own bucket.

Overlap. With ``overlap=True`` a post-accumulate-grad hook on each parameter marks it ready; a bucket
starts when all its parameters are ready and every bucket before it has started (every rank starts the
buckets in the same order, so their collectives match), and its rounds run while backward goes on.
``sync_gradients()`` starts what has not started (all of it with ``overlap=False``) and waits.
Accumulate over several backward passes inside ``with sync.no_sync():``.

Unused parameters. A parameter without a gradient at ``sync_gradients()`` contributes zeros (no rank
waits for it, nothing hangs) and is reported in ``get_sync_stats()["unused_parameters"]``. With
``find_unused_parameters=True`` the ranks also agree (one small all-reduce per step) on which
parameters no rank used; those keep ``grad=None`` like DDP, the others receive the average.

Sparse gradients. The weights of ``nn.Embedding`` / ``nn.EmbeddingBag`` with ``sparse=True`` get sparse
gradients: as in DDP, each such parameter has a bucket of its own, averaged uncompressed
(:func:`~torsh_kernels.collectives.all_reduce_sparse`; ``"sparse": True`` in its bucket statistics).

Non-finite gradients: ``nonfinite=`` as for :class:`~torsh_kernels.parallel.CompressionHookState`; a step
undone under ``"propagate"`` shows as ``"nonfinite": True`` in ``sync_gradients()``'s statistics.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from .. import live
from ..collectives.agreement import agree_on
from ..collectives.coalesce import Coalescer
from ..collectives.communicator import Communicator, as_communicator, is_dtensor
from ..collectives.sparse import all_reduce_sparse, sparse_nbytes
from ..compression import Compressor
from ..errors import ArgumentTypeError, DeviceMismatchError, InvalidArgumentError
from .auto_follow import FollowSpec
from .buckets import BucketSpec
from .engine import BucketCompressor
from .hook_stats import bucket_span, totals
from .live_step import StepMeter, end_step
from .pipeline import ReductionPipeline
from .sync_stats import GradientConsistency, SyncStats

__all__ = ["GradientConsistency", "GradientSynchronizer", "SyncStats"]

ORDERS = ("ready", "size")


@dataclass(slots=True)
class _Bucket:
    index: int
    params: list[int]
    """Positions in the synchronizer's parameter list."""
    numel: int
    dtype: torch.dtype
    sparse: bool = False
    """One parameter whose gradients are sparse (an embedding with ``sparse=True``)."""


class _GradHookHandle:
    __slots__ = ("_fn", "_fns")

    def __init__(self, fns: list, fn) -> None:
        self._fns, self._fn = fns, fn

    def remove(self) -> None:
        if self._fn in self._fns:
            self._fns.remove(self._fn)


class GradientSynchronizer:
    """Average a model's gradients over the ranks of ``comm``, bucketed, compressed and overlapped with
    backward.

    Args:
        model: the module whose parameters (those with ``requires_grad``) are synchronised.
        comm: the communicator (e.g. from ``init_from_env()``), or a ``ProcessGroup``, a ``DeviceMesh``
            (``mesh_dim``: the dimension to average over; a 1-D mesh needs none) or ``(mesh, dim)``, made
            into a :class:`~torsh_kernels.collectives.TorchCommunicator`; parameters must be on its device
            type.
        bucket_mb: bucket size cap in MiB.
        compressor: a :class:`~torsh_kernels.compression.Compressor` or its name (``"int8"``, ``"topk:0.01"``;
            None: uncompressed), or ``"auto"``
            (see :class:`~torsh_kernels.parallel.CompressionHookState`; the choice and why in
            ``get_sync_stats()["auto"]``).
        overlap: start buckets from gradient hooks during backward.
        first_bucket_mb: cap of the first bucket (DDP's rule: small, so communication starts early).
        order: ``"ready"`` (reverse registration order, as gradients become ready) or ``"size"``
            (largest first).
        broadcast_parameters: copy rank 0's parameters and buffers to every rank at construction.
        find_unused_parameters: agree across ranks on parameters no rank used (they keep ``grad=None``).
        auto_candidates, auto_follow, bucket (and its fields as keywords), check_signatures, quantize_mode
            (deprecated): as for :class:`~torsh_kernels.parallel.CompressionHookState` (the exchanges are
            counted in ``get_sync_stats()["signature_checks"]``).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        comm: Communicator,
        *,
        bucket_mb: float = 25.0,
        compressor: Compressor | str | None = None,
        auto_candidates: Sequence[Compressor | None] | None = None,
        auto_follow: FollowSpec | bool | None = None,
        overlap: bool = True,
        first_bucket_mb: float = 1.0,
        order: str = "ready",
        broadcast_parameters: bool = True,
        find_unused_parameters: bool = False,
        mesh_dim: str | int | None = None,
        bucket: BucketSpec | None = None,
        check_signatures: bool | None = None,
        quantize_mode: str | None = None,
        **options: object,
    ) -> None:
        what = "GradientSynchronizer"
        if not isinstance(model, torch.nn.Module):
            raise ArgumentTypeError(f"{what}: model must be a torch.nn.Module, got {type(model).__name__}")
        comm = as_communicator(
            comm, what, dim=mesh_dim, needs=("rank", "world_size", "all_reduce", "all_gather", "broadcast")
        )
        for name, v in (("bucket_mb", bucket_mb), ("first_bucket_mb", first_bucket_mb)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise InvalidArgumentError(f"{what}: {name} must be a number > 0, got {v!r}")
        if order not in ORDERS:
            raise InvalidArgumentError(f"{what}: order must be one of {ORDERS}, got {order!r}")
        named = _trainable(model, comm, what)
        self.model = model
        self.comm = comm
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        # as DDP's expect_sparse_gradient: decided from the modules, so every rank agrees whatever it holds
        embeddings = (torch.nn.Embedding, torch.nn.EmbeddingBag)
        sparse_weights = {id(m.weight) for m in model.modules() if isinstance(m, embeddings) and m.sparse}
        self._sparse = [id(p) in sparse_weights for p in self.params]
        self.bucket_mb = float(bucket_mb)
        self.first_bucket_mb = float(first_bucket_mb)
        self.order = order
        self.overlap = bool(overlap)
        self.find_unused_parameters = bool(find_unused_parameters)
        self._engine = BucketCompressor(
            compressor,
            bucket,
            auto_candidates=auto_candidates,
            auto_follow=auto_follow,
            check_signatures=check_signatures,
            quantize_mode=quantize_mode,
            what=what,
            **options,
        )
        self._pipeline = ReductionPipeline()
        self._coalescer = Coalescer(comm)
        self._meter = StepMeter("sync")  # the live metrics' and auto's link following's view of the steps
        self._bucketing = True
        self._grad_fns: list[Callable] = []
        self._hooks: list = []
        self._no_sync = False
        self._syncs = 0
        self._last: dict = {}
        self._check_same_model()
        if broadcast_parameters:
            self._broadcast_state()
        self._build_buckets()
        if self.overlap:
            self._hooks = [p.register_post_accumulate_grad_hook(self._make_hook(i)) for i, p in enumerate(self.params)]
        self._reset_step()

    # -- construction -------------------------------------------------------------------------------

    def _check_same_model(self) -> None:
        """Every rank's model has the same parameters (in order: shapes, dtypes): a signature exchange (one
        small all-gather, whatever ``check_signatures`` says), ``CollectiveMismatchError`` on every rank
        naming what differs otherwise."""
        agree_on(self.comm, "the model's parameters", tensors=self.params, count="parameters",
                 extra=[("sparse", [i for i, s in enumerate(self._sparse) if s])], what="GradientSynchronizer",
                 fix="Build the same model on every rank.")  # fmt: skip

    @torch.no_grad()
    def _broadcast_state(self) -> None:
        tensors = [p.data for p in self.params] + [b for b in self.model.buffers() if b.numel()]
        for t in tensors:
            if t.is_contiguous():
                self.comm.broadcast(t, 0)
            else:
                c = t.contiguous()
                self.comm.broadcast(c, 0)
                t.copy_(c)

    def _build_buckets(self) -> None:
        idx = list(range(len(self.params)))[::-1]
        if self.order == "size":
            idx.sort(key=lambda i: -self.params[i].numel())
        buckets: list[_Bucket] = []
        cur: list[int] = []
        cur_bytes = 0
        cur_dtype = None
        sparse = []
        for i in idx:
            p = self.params[i]
            if self._sparse[i]:
                sparse.append(i)
                continue
            nb = p.numel() * p.element_size()
            cap = (self.first_bucket_mb if not buckets else self.bucket_mb) * 2**20
            if cur and (not self._bucketing or p.dtype != cur_dtype or cur_bytes + nb > cap):
                buckets.append(self._bucket(len(buckets), cur))
                cur, cur_bytes = [], 0
            cur.append(i)
            cur_bytes += nb
            cur_dtype = p.dtype
        if cur:
            buckets.append(self._bucket(len(buckets), cur))
        for i in sparse:  # each in a bucket of its own, after the dense ones (DDP's order differs; any fixed one does)
            buckets.append(self._bucket(len(buckets), [i]))
            buckets[-1].sparse = True
        self.buckets = buckets
        self._bucket_of = {i: b.index for b in buckets for i in b.params}

    def _bucket(self, index: int, params: list[int]) -> _Bucket:
        return _Bucket(index, params, sum(self.params[i].numel() for i in params), self.params[params[0]].dtype)

    # -- per step -----------------------------------------------------------------------------------

    def _reset_step(self) -> None:
        self._ready = [0] * len(self.buckets)
        self._seen: set[int] = set()
        self._launched = 0
        self._t_launch: dict[int, float] = {}
        self._bucket_stats: list[dict] = []
        self._zero_filled: list[int] = []
        self._wire0: int | None = None  # the communicator's wire-byte count when this step's first bucket started

    def _make_hook(self, i: int):
        def hook(p: torch.Tensor) -> None:
            if self._no_sync:
                return
            if i in self._seen:
                raise InvalidArgumentError(
                    f"GradientSynchronizer: parameter {self.names[i]!r} received a second gradient before "
                    "sync_gradients(); call sync_gradients() after each backward, or accumulate inside "
                    "`with sync.no_sync():`"
                )
            self._seen.add(i)
            self._apply_grad_fns(i)
            b = self._bucket_of[i]
            self._ready[b] += 1
            while self._launched < len(self.buckets) and self._ready[self._launched] == len(
                self.buckets[self._launched].params
            ):
                self._launch(self._launched)

        return hook

    def _apply_grad_fns(self, i: int) -> None:
        p = self.params[i]
        for fn in self._grad_fns:
            if p.grad is None:
                break
            g = fn(self.names[i], p.grad)
            if g is not None:
                if not isinstance(g, torch.Tensor) or g.shape != p.shape:
                    raise InvalidArgumentError(
                        f"GradientSynchronizer: a gradient hook returned {type(g).__name__} "
                        f"{getattr(g, 'shape', '')} for {self.names[i]!r}; expected None or a tensor of shape "
                        f"{tuple(p.shape)}"
                    )
                p.grad = g

    def _launch(self, b: int) -> None:
        if self._wire0 is None and (t := getattr(self.comm, "traffic", None)) is not None:
            self._wire0 = t.wire_bytes
        bucket = self.buckets[b]
        if bucket.sparse:
            self._launch_sparse(b, bucket)
            return
        grads = []
        for i in bucket.params:
            p = self.params[i]
            if p.grad is None:
                p.grad = torch.zeros_like(p, memory_format=torch.contiguous_format)
                self._zero_filled.append(i)
            elif p.grad.layout != torch.strided:
                raise InvalidArgumentError(
                    f"GradientSynchronizer: parameter {self.names[i]!r} has a {p.grad.layout} gradient; only the "
                    "weights of nn.Embedding / nn.EmbeddingBag with sparse=True may have sparse gradients"
                )
            elif not p.grad.is_contiguous():
                p.grad = p.grad.contiguous()
            grads.append(p.grad)
        if live.publisher is not None or self._engine.follow is not None:
            self._meter.watch(self._coalescer)
            if self._meter.sampling:
                self._meter.add_gradients(grads)
        self._launched = b + 1
        t0 = time.perf_counter()
        span = bucket_span(b, grads, self._engine.compressor)
        self._engine.prepare(grads, bucket.params, self._coalescer)  # a new layout: agree on it first
        nonfinite = self._engine.screen(grads, self._coalescer)
        # as in the DDP hook: while older buckets have rounds to issue, this bucket's first round and theirs
        # go out as one all-reduce (decided alike on every rank, see parallel/engine.py)
        if self._pipeline.multi_round():
            with self._coalescer.batch():
                self._start(b, bucket, grads, t0, span, nonfinite)
        else:
            self._start(b, bucket, grads, t0, span, nonfinite)

    def _launch_sparse(self, b: int, bucket: _Bucket) -> None:
        """A sparse gradient's bucket: averaged uncompressed, at once (its result's size depends on every rank)."""
        i = bucket.params[0]
        p = self.params[i]
        g = p.grad
        if g is None:
            g = torch.sparse_coo_tensor(torch.empty((1, 0), dtype=torch.int64, device=p.device),
                                        p.new_empty((0, *p.shape[1:])), p.shape)  # fmt: skip
            self._zero_filled.append(i)
        elif g.layout != torch.sparse_coo:
            raise InvalidArgumentError(
                f"GradientSynchronizer: parameter {self.names[i]!r} belongs to a sparse embedding but has a "
                f"{g.layout} gradient; every rank must give it sparse gradients"
            )
        self._launched = b + 1
        t0 = time.perf_counter()
        p.grad, sent = all_reduce_sparse(self._coalescer, g)
        took, nbytes = time.perf_counter() - t0, sparse_nbytes(g)
        self._bucket_stats.append(
            {"bucket": b, "params": 1, "mb": nbytes / 2**20, "seconds": took, "bytes_sent": sent,
             "compress_s": 0.0, "wait_s": took, "sparse": True, "bytes_before": nbytes}
        )  # fmt: skip

    def _start(self, b: int, bucket, grads: list[torch.Tensor], t0: float, span, nonfinite: bool) -> None:
        reductions, finish = self._engine.start(grads, bucket.params, self._coalescer, nonfinite=nonfinite)

        def done() -> None:
            if finish is not None:
                finish()
            self._bucket_stats.append(
                {
                    "bucket": b,
                    "params": len(bucket.params),
                    "mb": bucket.numel * grads[0].element_size() / 2**20,
                    "seconds": time.perf_counter() - t0,
                    **totals(reductions),
                }
            )

        self._pipeline.submit(reductions, done, span)

    def wait(self) -> None:
        """Complete every bucket already started (their gradients then hold the average)."""
        self._pipeline.drain(self._coalescer.batch)

    def sync_gradients(self) -> SyncStats:
        """Start every bucket not yet started, wait for all, and leave the averaged gradients in
        ``p.grad``. Returns this step's statistics (as in :meth:`get_sync_stats`; a dict that prints as
        one line)."""
        if self._no_sync:
            raise InvalidArgumentError("GradientSynchronizer.sync_gradients: called inside no_sync()")
        t0 = time.perf_counter()
        try:
            if not self.overlap:
                for i in range(len(self.params)):
                    self._apply_grad_fns(i)
            while self._launched < len(self.buckets):
                self._launch(self._launched)
            self._pipeline.drain(self._coalescer.batch)
            self._engine.check_averages()
            globally_unused: list[int] = []
            if self.find_unused_parameters:
                used = torch.ones(len(self.params), dtype=torch.int32, device=self.comm.device)
                if self._zero_filled:
                    used[torch.tensor(self._zero_filled, device=self.comm.device)] = 0
                self.comm.all_reduce(used, "sum")
                globally_unused = [i for i in self._zero_filled if int(used[i]) == 0]
                for i in globally_unused:
                    self.params[i].grad = None
        except BaseException:
            self._pipeline = ReductionPipeline()
            self._reset_step()
            self._engine.abandon_iteration()
            raise
        undone = self._engine.end_iteration()
        self._syncs += 1
        filled = set(self._zero_filled)
        with_grad = [i for i in range(len(self.params)) if i not in filled]  # this rank's own gradients
        unused = [self.names[i] for i in self._zero_filled]
        if unused and self._syncs == 1:
            warnings.warn(
                f"GradientSynchronizer: {len(unused)} parameter(s) had no gradient on rank {self.comm.rank} "
                f"(first: {unused[0]!r}); they were synchronised as zeros. See get_sync_stats()['unused_parameters']",
                stacklevel=2,
            )
        self._last = {
            "parameters_with_gradients": len(with_grad),
            "parameters": len(self.params),
            "total_mb": sum(self.params[i].numel() * self.params[i].element_size() for i in with_grad) / 2**20,
            "buckets": sorted(self._bucket_stats, key=lambda d: d["bucket"]),
            "payload_bytes": sum(d["bytes_sent"] for d in self._bucket_stats),
            # every collective of the step (payload rounds, flags, the unused-parameter count), by the one
            # definition of wire bytes (collectives.wire_bytes) that the timeline and `torsh report` use
            "bytes_on_wire": self.comm.traffic.wire_bytes - self._wire0 if self._wire0 is not None else None,
            "bytes_before": sum(b.numel * self.params[b.params[0]].element_size() for b in self.buckets if not b.sparse)
            + sum(d["bytes_before"] for d in self._bucket_stats if d.get("sparse")),
            "seconds_after_backward": time.perf_counter() - t0,
            "unused_parameters": unused,
            "globally_unused_parameters": [self.names[i] for i in globally_unused],
            "iteration": self._engine.iteration,
            "nonfinite": undone,
            "nonfinite_steps": self._engine.nonfinite_steps,
            "signature_checks": self._engine.signature_checks,
            "signature_s": self._engine.signature_s,
        }
        sent = self._last["payload_bytes"]
        self._last["compression_ratio"] = self._last["bytes_before"] / sent if sent else 1.0
        if live.publisher is not None or self._engine.follow is not None or self._meter.watched:
            stats = self._bucket_stats  # the live record, and auto's check (every rank calls sync_gradients alike)
            end_step(self._meter, self._engine, self._coalescer, step=self._syncs - 1,
                     comm_s=sum(d["wait_s"] for d in stats), compress_s=sum(d["compress_s"] for d in stats),
                     payload_bytes=self._last["bytes_before"], sent_bytes=self._last["payload_bytes"],
                     undone=undone)  # fmt: skip
        self._reset_step()
        return SyncStats(self._last)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients over several backward passes without starting any bucket."""
        prev = self._no_sync
        self._no_sync = True
        try:
            yield
        finally:
            self._no_sync = prev

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients (after the optimizer step) and the per-step bookkeeping."""
        if len(self._pipeline):
            self._pipeline.drain(self._coalescer.batch)
        for p in self.params:
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()
        self._reset_step()

    def has_gradients(self) -> bool:
        """Whether any parameter holds a gradient."""
        return any(p.grad is not None for p in self.params)

    # -- information --------------------------------------------------------------------------------

    @property
    def bucket(self) -> BucketSpec:
        """The bucket settings, ``start_iter`` and ``min_compression_rate`` resolved."""
        return self._engine.spec

    def get_sync_stats(self) -> SyncStats:
        """Statistics of the last ``sync_gradients()``: parameters with gradients, total MB, per-bucket
        times and bytes, unused parameters; plus totals. A dict (:class:`SyncStats`) that prints as one line.

        Bytes: ``bytes_before`` (the gradients), ``payload_bytes`` (what the buckets' collectives took as
        input; ``compression_ratio`` is ``bytes_before / payload_bytes``) and ``bytes_on_wire``: the
        communicator's ``traffic.wire_bytes`` from the first bucket's start to the end of the step, by
        :func:`~torsh_kernels.collectives.wire_bytes` as the timeline counts it. That is every collective
        issued on the communicator meanwhile: the synchronizer's own (payload rounds, non-finite flags, the
        unused-parameter count) and any other code's on the same communicator during backward (give the
        synchronizer a communicator of its own, ``comm.split([range(comm.world_size)])``, to count its
        traffic alone). None with a communicator that keeps no ``traffic`` counters."""
        auto = self._engine.auto
        decision = auto.decision.as_dict() if auto is not None and auto.decision is not None else None
        if decision is not None and self._engine.replans:
            decision["replans"] = list(self._engine.replans)
        return SyncStats(self._last, syncs=self._syncs, compressor=repr(self._engine.compressor), auto=decision)

    def get_bucket_info(self) -> list[dict]:
        """One entry per bucket: index, parameter names, elements, MB, dtype, which parameters the
        compressor touches and which go in the plain all-reduce."""
        info = []
        for b in self.buckets:
            names = [self.names[i] for i in b.params]
            comp = [] if b.sparse else [self.names[i] for i in b.params if self._engine.eligible(self.params[i])]
            comp_set = set(comp)
            info.append(
                {
                    "index": b.index,
                    "parameters": names,
                    "numel": b.numel,
                    "mb": b.numel * self.params[b.params[0]].element_size() / 2**20,
                    "dtype": str(b.dtype).replace("torch.", ""),
                    "compressed": comp,
                    "uncompressed": [n for n in names if n not in comp_set],
                    "sparse": b.sparse,
                }
            )
        return info

    def set_bucketing(self, enabled: bool) -> None:
        """Bucket parameters together (True, default) or give each its own bucket (False). Only between
        steps, on every rank alike."""
        if self._launched or len(self._pipeline):
            raise InvalidArgumentError(
                "GradientSynchronizer.set_bucketing: a step is in progress; call it between steps"
            )
        self._bucketing = bool(enabled)
        self._build_buckets()
        self._reset_step()

    def register_gradient_hook(self, fn: Callable[[str, torch.Tensor], torch.Tensor | None]):
        """Call ``fn(name, grad)`` on each gradient before it is synchronised (when it is ready with
        ``overlap=True``, else at ``sync_gradients()``); a returned tensor replaces the gradient.
        Returns a handle with ``remove()``."""
        if not callable(fn):
            raise ArgumentTypeError(f"register_gradient_hook: expected a callable, got {type(fn).__name__}")
        self._grad_fns.append(fn)
        return _GradHookHandle(self._grad_fns, fn)

    @torch.no_grad()
    def check_gradient_consistency(self, *, raise_on_mismatch: bool = False) -> GradientConsistency:
        """Compare a checksum of every rank's (synchronised) gradients: after ``sync_gradients()`` they
        must be bit-identical on every rank. A collective: call it on every rank."""
        sums = torch.full((len(self.params),), -1, dtype=torch.int64)
        for i, p in enumerate(self.params):
            if p.grad is not None:
                g = p.grad.detach().contiguous().view(-1)
                bits = g.view(torch.int32 if g.element_size() == 4 else torch.int16 if g.element_size() == 2 else
                              torch.int64)  # fmt: skip
                w = torch.arange(1, bits.numel() + 1, device=bits.device, dtype=torch.int64)
                sums[i] = int(((bits.to(torch.int64) * w) % 2_147_483_647).sum()) & 0x7FFFFFFFFFFFFFFF
        ws = self.comm.world_size
        mine = sums.to(self.comm.device)
        out = torch.empty(ws * len(self.params), dtype=torch.int64, device=self.comm.device)
        self.comm.all_gather(out, mine)
        table = out.view(ws, -1).cpu().tolist()
        bad = [self.names[i] for i in range(len(self.params)) if len({row[i] for row in table}) > 1]
        result = GradientConsistency(not bad, bad, table)
        if bad and raise_on_mismatch:
            raise InvalidArgumentError(
                f"GradientSynchronizer: gradients differ between ranks for {len(bad)} parameter(s): {bad[:5]}"
            )
        return result

    def state_dict(self) -> dict:
        """The compressor states (residuals, PowerSGD's Q) and the iteration count, for checkpoints."""
        return self._engine.state_dict((self.comm.rank, self.comm.world_size))

    def load_state_dict(self, sd: dict) -> None:
        """Restore from :meth:`state_dict`; a state saved by another rank (or world size) is refused."""
        self._engine.load_state_dict(sd, "GradientSynchronizer", (self.comm.rank, self.comm.world_size))

    def remove_hooks(self) -> None:
        """Detach the gradient hooks from the model's parameters."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def __repr__(self) -> str:
        return (
            f"GradientSynchronizer(params={len(self.params)}, buckets={len(self.buckets)}, "
            f"compressor={self._engine.compressor!r}, overlap={self.overlap})"
        )


def _trainable(model: torch.nn.Module, comm: Communicator, what: str) -> list[tuple[str, torch.nn.Parameter]]:
    """The model's (name, parameter) pairs that require gradients, checked: not sharded, at least one, on the
    communicator's device type, floating point; a typed error otherwise."""
    sharded = next((n for n, p in model.named_parameters() if is_dtensor(p)), None)
    if sharded is not None:
        raise InvalidArgumentError(
            f"{what}: parameter {sharded!r} is a DTensor: this model is sharded (FSDP2's fully_shard, or tensor "
            "parallelism), and FSDP2 reduces its gradients itself (a reduce-scatter per layer). The synchronizer "
            "averages replicated parameters, as DDP does; for compressed gradients under FSDP2 use "
            "torsh_kernels.parallel.apply_quantized_comm, for a model not sharded pass it before fully_shard"
        )
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not named:
        raise InvalidArgumentError(f"{what}: the model has no parameters that require gradients")
    dev = comm.device
    for n, p in named:
        if p.device.type != dev.type:
            raise DeviceMismatchError(
                f"{what}: parameter {n!r} is on {p.device}, the communicator moves tensors on {dev}; "
                "move the model first"
            )
        if not p.is_floating_point():
            raise InvalidArgumentError(f"{what}: parameter {n!r} has dtype {p.dtype}; gradients must be floating")
    return named
