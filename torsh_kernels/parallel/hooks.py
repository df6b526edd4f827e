"""DDP communication hooks that compress gradients with any :mod:`torsh_kernels.compression` compressor.

::

    from torch.nn.parallel import DistributedDataParallel as DDP
    from torsh_kernels.compression import PowerSGD
    from torsh_kernels.parallel import CompressionHookState, compression_hook

    ddp = DDP(model)
    state = CompressionHookState(compressor=PowerSGD(rank=4), start_iter=10)
    ddp.register_comm_hook(state, compression_hook)

What a bucket goes through (``compression_hook(state, bucket)``):

- before ``start_iter`` iterations (warm-up): one plain all-reduce of the bucket, as DDP would do;
- afterwards, each gradient of the bucket is either compressed (2+ dims, at least ``min_numel``
  elements, compression rate at least ``min_compression_rate``) or sent as it is; the uncompressed ones
  travel in the compressed tensors' first collective where the compressor allows it (top-k's all-gather,
  PowerSGD's P all-reduce: ``Compressor.carries_plain``), else in one batched all-reduce of their own
  (the fused flatten/unflatten ops where they are not already contiguous);
- ``policy="layerwise"`` (default) compresses each eligible gradient on its own, with its own state
  (PowerSGD: one P and one Q per matrix, as PyTorch's ``powerSGD_hook``), the payloads of a round
  sharing one collective where the compressor allows it; ``policy="bucket"`` compresses the bucket's
  eligible gradients as one flat tensor (PowerSGD then behaves like ``batched_powerSGD_hook``);
- elementwise compressors (FP16, BF16) cast the whole bucket, 1-D tensors included, in one fused pass
  with the 1/world_size prescale, and send it in one all-reduce, as PyTorch's ``fp16_compress_hook``;
- a bucket whose reduction has one round (warm-up, uncompressed, the casts, top-k, gathered int8/int4)
  is issued and the hook returns at once: the future it returns is the collective's own, with the
  decode chained to it (``work.get_future().then(decode)``), so the hook does not wait for it; the last
  bucket's call waits for the iteration's one-round buckets (DDP would wait for them right after it),
  so that a failed collective or decode is raised there as its typed error (DDP itself turns a future's
  error into a bare ``RuntimeError``);
- buckets with several rounds (PowerSGD's P then Q, sign's two phases, quantize's shared scale) are
  pipelined in a rank-independent order (see :mod:`.engine`), so several buckets work on gloo and NCCL
  alike; PowerSGD's P all-reduce of one bucket overlaps the Q round of the previous one. The hook waits
  for older buckets' rounds there, and the last bucket drains the pipeline.

States are kept per parameter (layerwise) or per group of parameters (bucket), keyed by the order in
which the hook first sees the parameters, so they survive DDP's bucket rebuild after the first
iteration (with ``policy="bucket"`` the residuals are carried over element for element when the
groups change; PowerSGD's Q and the sign server residual then restart). ``state_dict()`` holds the
residuals, PowerSGD's Q memory and the iteration count; a fresh process that loads it and continues
reproduces the uninterrupted run exactly (``policy="layerwise"``: the grouping does not depend on the
bucket layout, which a fresh DDP rebuilds).

Non-finite gradients (``nonfinite=``): PyTorch's AMP ``GradScaler`` relies on NaN/Inf passing through
the all-reduce so that it skips the step. Under ``"propagate"`` (the default while an enabled GradScaler
exists) a bucket holding NaN/Inf on any rank is averaged uncompressed, so every rank receives it, and
the iteration is undone in the hook's state (residuals, PowerSGD's Q, step and iteration counts as
before it); under ``"raise"`` (the default otherwise) the compressor raises
:class:`~torsh_kernels.errors.NonFiniteError` before its state changes, on the rank whose gradients hold
NaN/Inf (its peers then fail with ``CollectiveError``, or ``CollectiveTimeoutError`` while it stays alive
without joining); the uncompressed buckets' averages (warm-up, ``compressor=None``) are summed by their
decode and checked by the last bucket's call, and PowerSGD's all-reduced P and Q after their round, so
those raise ``NonFiniteError`` on every rank alike.

Sparse gradients (``nn.Embedding(sparse=True)``, which DDP puts in buckets of their own) are averaged
uncompressed, as DDP does (``stats.sparse_buckets`` counts them).

Two call forms: DDP's C++ reducer passes a ``GradBucket`` (also under ``torch.compile`` with
``optimize_ddp``'s default mode); its python reducer (compiled autograd with
``optimize_ddp="python_reducer"``) passes ``(param.grad, param)`` and ignores the result, so the hook
then averages that gradient in place before returning, one parameter at a time (see
:func:`compression_hook`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ..checks import check_timeout
from ..collectives.coalesce import Coalescer
from ..collectives.communicator import TorchCommunicator, is_communicator, resolve_group
from ..compression import Compressor
from ..errors import ArgumentTypeError, InvalidArgumentError
from .auto_follow import FollowSpec
from .buckets import BucketSpec
from .engine import BucketCompressor
from .engine_state import check_owner
from .hook_engine import HookRun
from .hook_stats import HookStats

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["CompressionHookState", "HookStats", "compression_hook"]


class CompressionHookState:
    """State of :func:`compression_hook`: tunables, per-parameter compressor states, statistics.

    Args:
        process_group: the group DDP reduces over (None: the default group), or a ``DeviceMesh`` whose
            dimension ``mesh_dim`` (a name or index; not needed for a 1-D mesh) gives it, or any
            :class:`~torsh_kernels.collectives.Communicator` of the same ranks to carry the hook's traffic
            instead (``CupyNcclCommunicator``, ``RdmaCommunicator``, from ``make_communicator``); it must
            hold DDP's ranks in DDP's order.
        mesh_dim: see ``process_group``.
        compressor: any :class:`~torsh_kernels.compression.Compressor` or its name (``"int8"``, ``"topk:0.01"``,
            ``"powersgd:4"``: :mod:`torsh_kernels.compression.names`; None: uncompressed), or ``"auto"``:
            plain all-reduces for ``start_iter`` iterations (default 2), then the candidate that the
            measured link and the candidates' measured cost on this job's buckets make cheapest, the
            same on every rank (:mod:`torsh_kernels.parallel.auto`; the choice and why in
            ``stats.auto``).
        auto_candidates: with ``compressor="auto"``, the compressors (or names) to choose among (None or
            ``"none"`` in it: uncompressed); default: uncompressed, fp16, bf16, top-k 1%, int8, int4, sign,
            PowerSGD rank 4.
        auto_follow: with ``compressor="auto"``, whether (and when) it looks at its choice again while the job
            runs: None or True (default): :class:`~torsh_kernels.parallel.FollowSpec`'s defaults (a check every
            4 steps, one all-reduce of 16 bytes; a re-plan, on every rank at the same step, when the link rate
            or the compression time moved more than 2x in 2 checks in a row); a ``FollowSpec``; False: choose
            once (:mod:`torsh_kernels.parallel.auto_follow`; the re-plans in ``stats.auto["replans"]``).
        bucket: a :class:`~torsh_kernels.parallel.BucketSpec`: which gradients are compressed, from which
            iteration, what a NaN/Inf gradient does (``start_iter``, ``min_compression_rate``,
            ``min_numel``, ``policy``, ``nonfinite``); None: its defaults. Its fields may also be given
            here as keywords (``CompressionHookState(pg, PowerSGD(), start_iter=10)``), which refine
            ``bucket``. With ``nonfinite="propagate"`` and a stateful compressor each bucket costs one more
            all-reduce of a flag, and each compressor state one copy per step; ``"auto"`` (default) resolves
            at the first bucket, so create a ``torch.amp.GradScaler`` before the first backward, on every
            rank alike.
        timeout: seconds a collective may take before it fails with ``CollectiveError``.
        check_signatures: before the first collective of each new bucket layout (and after a compressor
            change or ``load_state_dict``), exchange with the other ranks what it is about to send (the
            compressor's class and settings, these settings, the bucket's shapes, the iteration count):
            one small all-gather, after which every rank raises ``CollectiveMismatchError`` naming what
            differs if anything does, instead of one rank aborting in gloo (see
            :mod:`torsh_kernels.collectives.agreement` for what it cannot catch). None (default): on
            unless ``TORSH_KERNELS_CHECK_SIGNATURES=0``.
        quantize_mode: deprecated: ``Quantize(scheme=...)`` (the scheme is the compressor's own setting).
    """

    __slots__ = ("_comm", "_engine", "_given", "_keys", "_run", "_saved_by", "_timeout", "process_group", "stats")

    def __init__(
        self,
        process_group: dist.ProcessGroup | DeviceMesh | None = None,
        compressor: Compressor | str | None = None,
        *,
        mesh_dim: str | int | None = None,
        auto_candidates: Sequence[Compressor | None] | None = None,
        auto_follow: FollowSpec | bool | None = None,
        bucket: BucketSpec | None = None,
        timeout: float | None = None,
        check_signatures: bool | None = None,
        quantize_mode: str | None = None,
        **options: object,
    ) -> None:
        if timeout is not None:  # checked now, not when the first backward makes the communicator
            timeout = check_timeout(timeout, "CompressionHookState")
        self._given = None  # a Communicator the caller gave instead of a group
        if is_communicator(process_group, ("all_reduce", "all_gather", "world_size")):
            if mesh_dim is not None:
                raise InvalidArgumentError(
                    "CompressionHookState: mesh_dim applies to a DeviceMesh, not to a communicator"
                )
            self._given, process_group = process_group, None
        self.process_group = resolve_group(process_group, mesh_dim, "CompressionHookState")
        self._engine = BucketCompressor(
            compressor,
            bucket,
            auto_candidates=auto_candidates,
            auto_follow=auto_follow,
            check_signatures=check_signatures,
            quantize_mode=quantize_mode,
            what="CompressionHookState",
            **options,
        )
        self._timeout = timeout
        self._comm: Coalescer | None = None
        self._keys: dict[int, int] = {}
        self._saved_by: dict | None = None  # a loaded state's rank and world size, until the group is known
        self.stats = HookStats()
        self._run = HookRun(self._engine, self.stats)  # the bucket path and the iteration in flight

    # tunables, read-only after construction (the per-tensor states depend on them)
    @property
    def compressor(self) -> Compressor:
        return self._engine.compressor

    @property
    def bucket(self) -> BucketSpec:
        """The bucket settings, ``start_iter`` and ``min_compression_rate`` resolved."""
        return self._engine.spec

    @property
    def start_iter(self) -> int:
        return self._engine.spec.start_iter

    @property
    def min_compression_rate(self) -> float:
        return self._engine.spec.min_compression_rate

    @property
    def min_numel(self) -> int:
        return self._engine.spec.min_numel

    @property
    def policy(self) -> str:
        return self._engine.spec.policy

    @property
    def nonfinite(self) -> str:
        """The non-finite policy as given ("auto", "propagate" or "raise")."""
        return self._engine.spec.nonfinite

    @property
    def iteration(self) -> int:
        """Iterations completed (DDP backward passes whose last bucket was reduced)."""
        self._run.close_parameter_iteration()
        return self._engine.iteration

    def _communicator(self) -> Coalescer:
        if self._comm is None:
            inner = self._given or TorchCommunicator(self.process_group, timeout=self._timeout)
            if self._saved_by is not None:  # loaded before the group was up: whose it is is checked now
                check_owner(self._saved_by, (inner.rank, inner.world_size), "CompressionHookState.load_state_dict")
            self._comm = Coalescer(inner)
        return self._comm

    def _key(self, p: torch.Tensor) -> int:
        k = self._keys.get(id(p))
        if k is None:
            k = self._keys[id(p)] = len(self._keys)
        return k

    # -- checkpoints ----------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Iteration count and every compressor state (error-feedback residuals, PowerSGD's Q memory,
        step counts, seeds), cloned; for ``torch.save`` beside the model and optimizer."""
        self._run.close_parameter_iteration()
        return self._engine.state_dict(self._owner())

    def load_state_dict(self, sd: dict) -> None:
        """Restore from ``state_dict()``; the hook then continues where the saved run left off. A state saved by
        another rank (or world size) is refused: each rank's residuals are its own (where no process group is
        up yet, at the first backward, before they are used)."""
        owner = self._owner()
        self._engine.load_state_dict(sd, "CompressionHookState", owner)
        self._saved_by = None
        if owner is None and "rank" in sd:
            self._saved_by = {"rank": sd["rank"], "world_size": sd["world_size"]}

    def _owner(self) -> tuple[int, int] | None:
        """(rank, world size) of this process in the hook's group; None where no group is up yet."""
        comm = self._comm.inner if self._comm is not None else self._given
        if comm is not None:
            return comm.rank, comm.world_size
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(self.process_group), dist.get_world_size(self.process_group)
        return None

    def __getstate__(self) -> dict:
        # the process group, the communicator and the parameter identities belong to this process
        return {"engine": self._engine, "timeout": self._timeout, "stats": self.stats, "saved_by": self._saved_by}

    def __setstate__(self, d: dict) -> None:
        self.process_group = None
        self._given = None
        self._engine = d["engine"]
        self._timeout = d["timeout"]
        self._saved_by = d.get("saved_by")
        self.stats = d["stats"]
        self._comm = None
        self._keys = {}
        self._run = HookRun(self._engine, self.stats)

    def __repr__(self) -> str:
        e = self._engine
        return (
            f"CompressionHookState(compressor={e.compressor!r}, bucket={e.spec!r}, iteration={e.iteration}, "
            f"states={len(e.states)})"
        )


def compression_hook(
    state: CompressionHookState, bucket: dist.GradBucket | tuple[torch.Tensor, torch.Tensor]
) -> torch.futures.Future[torch.Tensor] | torch.Tensor:
    """DDP communication hook: average ``bucket`` over the process group through ``state.compressor``.
    Register with ``ddp.register_comm_hook(state, compression_hook)``.

    DDP calls it with a ``GradBucket`` (its C++ reducer, also under ``torch.compile`` with
    ``optimize_ddp``'s default mode), or with ``(param.grad, param)`` under compiled autograd with
    ``torch._dynamo.config.optimize_ddp = "python_reducer"``: the gradient is then averaged in place before
    the hook returns (that reducer ignores what a hook returns and has no end-of-backward callback), one
    parameter at a time, each with its own compressor state as under ``policy="layerwise"``; the
    hook runs eagerly there (``torch.compiler.disable``). Either way the bucket is handed to the engine's
    side in one call (:class:`~torsh_kernels.parallel.hook_engine.HookRun`), which never calls back here."""
    if not isinstance(state, CompressionHookState):
        raise ArgumentTypeError(
            f"compression_hook: state must be a CompressionHookState, got {type(state).__name__}; "
            "register with ddp.register_comm_hook(CompressionHookState(...), compression_hook)"
        )
    if isinstance(bucket, tuple):
        return _eager(_parameter_hook)(state, bucket)
    keys = [state._key(p) for p in bucket.parameters()]
    comm = state._communicator()
    return state._run.bucket(comm, bucket.buffer(), bucket.gradients, keys, bucket.index(), bucket.is_last())


@functools.cache
def _eager(fn):
    """``fn`` as a ``torch.compiler.disable`` region, made on first use: the decorator imports torch._dynamo
    (and Triton with it), which importing the package must not; the per-parameter call form only occurs
    under compiled autograd, where dynamo is loaded anyway."""
    return torch.compiler.disable(fn)


def _parameter_hook(state: CompressionHookState, pair: tuple) -> torch.Tensor:
    """``compression_hook(state, (param.grad, param))``: DDP's python reducer (compiled autograd) calls it
    once per gradient and ignores the result, so the average is complete in ``param.grad`` on return.

    An iteration is one backward pass (autograd's graph task), whatever parameters it reaches: it is
    closed when a gradient of the next pass arrives, or when ``state_dict()`` or ``iteration`` is read
    between passes; the compressor states, warm-up and statistics then advance as with buckets (an
    iteration that held NaN/Inf is undone then, before anything of the next one)."""
    if len(pair) != 2 or not isinstance(pair[0], torch.Tensor) or not isinstance(pair[1], torch.Tensor):
        raise ArgumentTypeError(
            "compression_hook: expected a GradBucket or a (gradient, parameter) pair of tensors, got a tuple of "
            f"{[type(x).__name__ for x in pair]}"
        )
    grad, param = pair
    key = state._key(param)
    return state._run.parameter(state._communicator(), grad, param, key)


# DDP checks the hook's annotations by identity (the bucket's and the return's); with postponed evaluation
# they would be strings
compression_hook.__annotations__ = {
    "state": CompressionHookState,
    "bucket": dist.GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}
