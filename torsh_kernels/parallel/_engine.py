"""What the DDP hook and the gradient synchronizer share: which tensors of a bucket are compressed, the
per-tensor (or per-bucket) compressor states, and the pipeline that keeps several buckets' reductions
in flight while issuing their collectives in the same order on every rank.

Ordering. Every rank sees the buckets in the same order (DDP reduces buckets in index order; the
synchronizer launches them in index order too). When bucket ``i`` starts, its first round is issued,
then every older reduction still in flight advances by exactly one round, oldest first: a wait for
the round it has in flight, then the next round is issued. The sequence of collectives is therefore a
function of the bucket sequence and the compressors' round structure alone, never of timing. With
PowerSGD this puts bucket ``i``'s P all-reduce on the wire while bucket ``i - 1``'s Q is computed
and sent, instead of serialising P and Q for every bucket; the last bucket drains the pipeline.

One-round buckets. A bucket whose reductions each have a single round (uncompressed, the casts, top-k,
gathered int8/int4) issues all its collectives when it starts; nothing is issued for it later, so when
its decode runs cannot change the order of anyone's collectives. Such buckets are never waited for when
a newer bucket starts: the DDP hook returns the collective's future with the decode chained to it
(:meth:`~torsh_kernels.compression.CompressedReduction.future`), and the pipeline finishes them when it
drains, or earlier if their collectives have already completed (a poll, never a wait). Only buckets
with several rounds (PowerSGD's P then Q, sign's two phases, quantize's shared scale) are stepped.

Elementwise compressors (the casts, ``compressor.elementwise``) see a bucket as one flat tensor, however
many gradients it holds and whatever the policy: one fused cast (with the 1/world_size prescale) and one
all-reduce per bucket.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import itertools
import math
from collections import deque
from collections.abc import Callable, Sequence

import torch

from .. import _trace
from ..collectives.communicator import Communicator
from ..compression import (
    QUANTIZE_MODES,
    CompressedReduction,
    CompressionState,
    Compressor,
    NoCompression,
)
from ..compression.allreduce import issue
from ..errors import ArgumentTypeError, InvalidArgumentError, LayoutMismatchError, NonFiniteError
from ..ops import COMPRESS_DTYPES, count_nonfinite, flatten, unflatten
from .auto import AUTO, AutoSelector

POLICIES = ("layerwise", "bucket")
NONFINITE = ("auto", "propagate", "raise")
"""What the bucket layer does with NaN/Inf gradients (see :class:`BucketCompressor`)."""
AUTO_START_ITER = 2
"""``compressor="auto"``'s default warm-up: DDP rebuilds its buckets after the first iteration, so the
second one shows the layout the job keeps; the choice is made as the third begins."""


class ReductionPipeline:
    """Buckets' reductions in flight, advanced in a rank-independent order (see the module docstring)."""

    __slots__ = ("_inflight",)

    def __init__(self) -> None:
        self._inflight: deque[tuple[list[CompressedReduction], Callable[[], None] | None, object]] = deque()

    def __len__(self) -> int:
        return len(self._inflight)

    def submit(self, reductions: list[CompressedReduction], on_done: Callable[[], None] | None = None,
               span=None) -> None:  # fmt: skip
        """Add a started bucket; every older bucket in flight with more rounds to issue then advances by
        one round. Older one-round buckets are finished only if their collectives have completed (their
        decode issues nothing, so this poll cannot change the order of collectives). ``span``: the
        bucket's timeline interval (from :func:`bucket_span`), ended when the bucket is done."""
        if self._inflight:
            for rs, _, _ in self._inflight:
                for r in rs:
                    if not r.done and (not r.single_round or r.ready()):
                        r.step()
        self._inflight.append((reductions, on_done, span))
        self._reap()

    def multi_round(self) -> bool:
        """Whether a bucket in flight still has rounds to issue. The same on every rank at the same point of
        the bucket sequence: a multi-round reduction finishes only in ``step()``, which the pipeline calls
        in a rank-independent order (one-round buckets, polled by timing, issue nothing)."""
        for rs, _, _ in self._inflight:
            for r in rs:
                if not r.done and not r.single_round:
                    return True
        return False

    def drain(self, batch: Callable[[], contextlib.AbstractContextManager] | None = None) -> None:
        """Advance every bucket, oldest first, round by round, until all are done. ``batch``: a
        ``Coalescer.batch`` under which each pass runs, so the rounds one pass issues go out together."""
        while self._inflight:
            with batch() if batch is not None and self.multi_round() else contextlib.nullcontext():
                for rs, _, _ in list(self._inflight):
                    for r in rs:
                        r.step()
            self._reap()

    def _reap(self) -> None:
        while self._inflight and all(r.done for r in self._inflight[0][0]):
            _, on_done, span = self._inflight.popleft()
            if on_done is not None:
                on_done()
            if span is not None:
                span.end()


def bucket_span(index: int, grads: Sequence[torch.Tensor], compressor: Compressor):
    """A timeline interval for one bucket, from now until its reductions are done (None without a recorder)."""
    rec = _trace.recorder
    if rec is None:
        return None
    nbytes = sum(g.nbytes for g in grads)
    name = compressor.name
    dev = grads[0].device if grads else None
    return rec.begin(f"bucket {index}", "bucket", {"bucket": index, "bytes": nbytes, "tensors": len(grads),
                                                   "compressor": name}, lane="bucket", device=dev)  # fmt: skip


def totals(reductions: Sequence[CompressedReduction]) -> dict[str, float]:
    """What a bucket's reductions cost: bytes this rank sent, compute and wait seconds."""
    return {
        "bytes_sent": sum(r.bytes_sent for r in reductions),
        "compress_s": sum(r.compute_s for r in reductions),
        "wait_s": sum(r.wait_s for r in reductions),
    }


def _contiguous_span(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether the tensors lie back to back in memory, in order (views of one flat buffer)."""
    for a, b in itertools.pairwise(tensors):
        if b.data_ptr() != a.data_ptr() + a.numel() * a.element_size() or a.dtype != b.dtype:
            return False
    return all(t.is_contiguous() for t in tensors)


def _as_one(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """A flat view covering ``tensors`` when they lie back to back, else None."""
    if not _contiguous_span(tensors):
        return None
    first = tensors[0]
    total = sum(t.numel() for t in tensors)
    return torch.as_strided(first, (total,), (1,), first.storage_offset())


@dataclasses.dataclass(slots=True)
class _BucketPlan:
    """What one bucket layout gets, worked out once (shapes checked, eligibility, round structure) and
    reused every step."""

    compressed: list[list[int]]
    """Groups of tensor positions compressed together (one group per tensor: layerwise)."""
    plain: list[int]
    """Positions sent uncompressed, in one batched all-reduce."""
    single_round: bool = True
    """Every reduction of the bucket has one round (see the module docstring)."""
    state_keys: list[tuple[int, ...]] = dataclasses.field(default_factory=list)
    """The compressor state of each compressed group."""
    states: list[CompressionState] | None = None
    """Those states, looked up once (reset when the states change)."""
    work: CompressionState = dataclasses.field(default_factory=CompressionState)
    """The state a stateless compressor (a cast) gets for this bucket: it keeps the wire buffer."""
    carry: bool | None = None
    """The plain tensors ride in the compressed tensors' first collective (decided at the first step)."""


GATHER_PLAIN_BYTES = 64 << 10
"""Uncompressed tensors ride in an all-gather (top-k's) only while the extra bytes every rank receives
over a plain all-reduce of them, about ``(world_size - 2) * their bytes``, stay below this: about a
collective's latency on a 10 Gbit/s link, the cost of the all-reduce the ride saves. An all-reduce (PowerSGD's
P) carries them at no extra cost at any world size."""


def _carries(c: Compressor, plan: _BucketPlan, plain: list[torch.Tensor], world_size: int) -> bool:
    if not (plan.compressed and c.carries_plain and len({t.dtype for t in plain}) == 1):
        return False
    if c.is_linear or world_size <= 2:
        return True
    return (world_size - 2) * sum(t.numel() * t.element_size() for t in plain) <= GATHER_PLAIN_BYTES


class BucketCompressor:
    """Compresses buckets of gradients through one compressor: which tensors are compressed, the state
    of each compressed tensor (``policy="layerwise"``) or group (``"bucket"``), warm-up, statistics.

    Tensors are identified by integer keys the caller assigns (parameter ordinals), so states survive
    a change of bucket layout (DDP rebuilds its buckets after the first iteration)."""

    __slots__ = (
        "_auto_rate",
        "_created",
        "_mode",
        "_plain_c",
        "_plans",
        "_saved",
        "_skip",
        "_snapshots",
        "_stateless",
        "_sums",
        "_unchecked",
        "_used",
        "auto",
        "compressor",
        "iteration",
        "min_compression_rate",
        "min_numel",
        "nonfinite",
        "nonfinite_steps",
        "policy",
        "quantize_mode",
        "shapes",
        "start_iter",
        "states",
    )

    def __init__(
        self,
        compressor: Compressor | None,
        *,
        start_iter: int | None = None,
        min_compression_rate: float | None = None,
        min_numel: int = 1024,
        policy: str = "layerwise",
        quantize_mode: str = "auto",
        auto_candidates: Sequence[Compressor | None] | None = None,
        nonfinite: str = "auto",
        what: str = "BucketCompressor",
    ) -> None:
        auto = isinstance(compressor, str)
        if auto and compressor != AUTO:
            raise ArgumentTypeError(f"{what}: compressor must be a Compressor, None or 'auto', got {compressor!r}")
        if auto_candidates is not None and not auto:
            raise InvalidArgumentError(
                f"{what}: auto_candidates is for compressor='auto', got compressor={compressor!r}"
            )
        if auto or compressor is None:
            compressor = NoCompression()  # 'auto': uncompressed until the choice is made
        if not isinstance(compressor, Compressor):
            raise ArgumentTypeError(
                f"{what}: compressor must be a Compressor, None or 'auto', got {type(compressor).__name__}"
            )
        self._auto_rate = min_compression_rate
        default_start, default_rate = compressor.warmup()
        if auto and start_iter is None:
            start_iter = AUTO_START_ITER
        if start_iter is None:
            start_iter = default_start
        if isinstance(start_iter, bool) or not isinstance(start_iter, int) or start_iter < 0:
            raise InvalidArgumentError(f"{what}: start_iter must be an int >= 0, got {start_iter!r}")
        if min_compression_rate is None:
            min_compression_rate = default_rate
        if not isinstance(min_compression_rate, (int, float)) or min_compression_rate < 0:
            raise InvalidArgumentError(f"{what}: min_compression_rate must be >= 0, got {min_compression_rate!r}")
        if isinstance(min_numel, bool) or not isinstance(min_numel, int) or min_numel < 0:
            raise InvalidArgumentError(f"{what}: min_numel must be an int >= 0, got {min_numel!r}")
        if policy not in POLICIES:
            raise InvalidArgumentError(f"{what}: policy must be one of {POLICIES}, got {policy!r}")
        if quantize_mode not in QUANTIZE_MODES:
            raise InvalidArgumentError(f"{what}: quantize_mode must be one of {QUANTIZE_MODES}, got {quantize_mode!r}")
        if nonfinite not in NONFINITE:
            raise InvalidArgumentError(f"{what}: nonfinite must be one of {NONFINITE}, got {nonfinite!r}")
        # the warm-up and the size rule are decided here, per tensor; the compressor must not repeat them
        self.compressor = compressor.per_tensor(min_compression_rate)
        self._unchecked = _unchecked(self.compressor)
        self.nonfinite = nonfinite
        self._mode = None if nonfinite == "auto" else nonfinite  # "auto" is resolved at the first bucket
        self.nonfinite_steps = 0
        self._skip = False  # a bucket of this iteration held NaN/Inf on some rank ("propagate")
        self._snapshots: dict[tuple[int, ...], tuple[int, int, dict[str, torch.Tensor]]] = {}
        self._saved: set[tuple[int, ...]] = set()  # states saved this iteration
        self._created: set[tuple[int, ...]] = set()  # states first made this iteration
        self.start_iter = start_iter
        self.min_compression_rate = float(min_compression_rate)
        self.min_numel = min_numel
        self.policy = policy
        self.quantize_mode = quantize_mode
        self.iteration = 0
        self.states: dict[tuple[int, ...], CompressionState] = {}
        self.shapes: dict[int, tuple[int, ...]] = {}
        self._plans: dict[tuple, _BucketPlan] = {}
        self._used: set[tuple[int, ...]] = set()
        self._plain_c = NoCompression(check_finite=False)
        self._sums: list = []  # this iteration's uncompressed averages and their sums, checked at its end
        self._stateless = CompressionState()  # the state handed to stateless compressors (casts, plain)
        # the pending or made compressor="auto" choice (None for a fixed compressor)
        self.auto = AutoSelector(self._candidate_engine, auto_candidates) if auto else None

    # -- compressor="auto" ------------------------------------------------------------------------------

    def _candidate_engine(self, c: Compressor | None) -> BucketCompressor:
        """The engine a candidate of ``auto`` would run in: this one's size rules, no warm-up."""
        return BucketCompressor(c, start_iter=0, min_compression_rate=self._auto_rate, min_numel=self.min_numel,
                                policy=self.policy, quantize_mode=self.quantize_mode,
                                nonfinite=self.mode())  # fmt: skip

    def _apply_auto(self, compressor: Compressor | None) -> None:
        rate = self._auto_rate
        if rate is None:
            rate = compressor.warmup()[1] if compressor is not None else self.min_compression_rate
        self.min_compression_rate = float(rate)
        self.set_compressor(compressor)
        if compressor is not None:  # a candidate with a warm-up of its own (PowerSGD(start_iter=...)) keeps it
            self.start_iter = max(self.start_iter, compressor.warmup()[0])

    def _auto_turn(self, grads, keys: Sequence[int], comm: Communicator, flat: torch.Tensor | None):
        """While ``auto`` has not chosen: note the bucket during the warm-up, or choose (the first bucket
        of iteration ``start_iter`` on every rank, when no collective of the job is in flight) once a whole
        iteration has been seen. Returns the gradients if it had to fetch them."""
        if self.iteration >= self.start_iter and self.auto.ready:
            self._apply_auto(self.auto.decide(comm).compressor)
            return grads
        if callable(grads):
            grads = grads()
        grads = list(grads)
        self.auto.observe(grads, keys, packed=flat is not None or _as_one(grads) is not None)
        return grads

    def set_compressor(self, compressor: Compressor | None) -> None:
        """Switch to another compressor between iterations, on every rank alike (``compressor="auto"``
        does at the end of the warm-up). The compressor states and cached bucket plans are dropped; the
        warm-up length and size rules stay as constructed."""
        if compressor is None:
            compressor = NoCompression()
        if not isinstance(compressor, Compressor):
            raise ArgumentTypeError(f"set_compressor: expected a Compressor or None, got {type(compressor).__name__}")
        self.compressor = compressor.per_tensor(self.min_compression_rate)
        self._unchecked = _unchecked(self.compressor)
        self.states = {}
        self._plans = {}
        self._used = set()
        self._snapshots = {}

    # -- which tensors ------------------------------------------------------------------------------

    def eligible(self, t: torch.Tensor) -> bool:
        """Whether the compressor touches this tensor: 2+ dims, at least ``min_numel`` elements, and a
        compression rate (bytes in / bytes on the wire) of at least ``min_compression_rate``. An
        elementwise compressor (a cast) touches every tensor: it casts the whole bucket."""
        c = self.compressor
        if c.identity:
            return False
        if getattr(c, "elementwise", False):
            return True
        if t.dim() < 2 or t.numel() < max(1, self.min_numel):
            return False
        wire = c.payload_nbytes(tuple(t.shape), t.dtype)
        return wire > 0 and t.numel() * t.element_size() / wire >= self.min_compression_rate

    def _plan(self, grads: Sequence[torch.Tensor], keys: Sequence[int], comm: Communicator) -> _BucketPlan:
        # keys name parameters, whose shapes do not change: the shapes are checked when the plan is made
        sig = (tuple(keys), grads[0].dtype if grads else None, comm.world_size)  # as in start()
        plan = self._plans.get(sig)
        if plan is None:
            plan = self._plans[sig] = self._make_plan(grads, keys, comm)
        return plan

    def _make_plan(self, grads: Sequence[torch.Tensor], keys: Sequence[int], comm: Communicator) -> _BucketPlan:
        what = "BucketCompressor"
        self.check_shapes(grads, keys)
        dev = comm.device
        for i, t in enumerate(grads):
            if t.dtype not in COMPRESS_DTYPES:
                raise InvalidArgumentError(
                    f"{what}: gradient {i} dtype {t.dtype}; expected float32, float16 or bfloat16"
                )
            if t.device.type != dev.type:
                raise InvalidArgumentError(f"{what}: gradient {i} is on {t.device}, the communicator on {dev}")
        c = self.compressor
        if c.identity or getattr(c, "elementwise", False):
            return _BucketPlan([], [])
        comp = [i for i, g in enumerate(grads) if self.eligible(g)]
        plain = sorted(set(range(len(grads))) - set(comp))
        if self.policy == "layerwise":
            groups = [[i] for i in comp]
            shapes = [tuple(grads[i].shape) for i in comp]
        else:
            groups = [comp] if comp else []
            shapes = [(sum(grads[i].numel() for i in comp),)] if comp else []
        single = True
        for shape in shapes:
            schemes = c.schemes(shape, grads[0].dtype, comm.world_size)
            if self.quantize_mode in schemes:
                schemes = {self.quantize_mode: schemes[self.quantize_mode]}
            single = single and all(len(rounds) == 1 for rounds in schemes.values())
        state_keys = [tuple(keys[i] for i in g) for g in groups]
        return _BucketPlan(groups, plain, single, state_keys)

    def check_shapes(self, grads: Sequence[torch.Tensor], keys: Sequence[int]) -> None:
        for k, g in zip(keys, grads):
            shape = tuple(g.shape)
            known = self.shapes.setdefault(k, shape)
            if known != shape:
                raise LayoutMismatchError(
                    f"tensor {k} has shape {shape}, the compression state was built for {known}; "
                    "load a state saved from the same model"
                )

    # -- non-finite gradients -------------------------------------------------------------------------

    def mode(self) -> str:
        """The non-finite policy in force: "propagate" or "raise". ``"auto"`` is resolved at the first call
        (the first bucket): "propagate" if this process holds an enabled GradScaler, else "raise". Every
        rank must resolve alike (a GradScaler on every rank or on none; else pass the policy): the ranks
        would otherwise issue different collectives. Resolving it costs no collective, so the first bucket
        issues what every other bucket issues."""
        if self._mode is None:
            self._mode = "propagate" if grad_scaler_in_use() else "raise"
        return self._mode

    def screen(self, tensors: Sequence[torch.Tensor], comm: Communicator) -> bool:
        """Whether a bucket about to be reduced holds NaN/Inf on any rank. Under "propagate" with a stateful
        compressor: a count on this rank, then one all-reduce of a flag that every rank waits for (the
        same collective on every rank for every bucket, so the order of collectives does not change), before
        any state is touched. That wait also waits for the collectives already in flight (they complete
        in order), so under "propagate" a stateful compressor's buckets no longer overlap each other's
        communication. Otherwise False without communicating: under "raise" the compressors' own check
        raises (a compressor's on the rank whose input holds NaN/Inf, its peers then fail in the
        collective it does not join; uncompressed buckets on every rank, from :meth:`check_averages`);
        under "propagate" a stateless compressor (uncompressed, the casts) passes NaN/Inf through
        unchecked.
        Call it before :meth:`start` for every bucket: with ``compressor="auto"`` the choice is made here
        when it is due, so that the bucket is screened for the chosen compressor."""
        mode = self.mode()
        if self.auto is not None and self.auto.decision is None and self.iteration >= self.start_iter \
                and self.auto.ready:  # fmt: skip
            self._apply_auto(self.auto.decide(comm).compressor)
        if not self.compressor.stateful or mode != "propagate":
            return False
        bad = torch.zeros(1, dtype=torch.int64, device=comm.device)
        for t in tensors:
            bad += count_nonfinite(t.reshape(-1))  # (its cheap all-finite check reads a host value per tensor)
        flag = (bad > 0).to(torch.float32)
        comm.all_reduce(flag, "max")
        return bool(flag.item())

    def _save(self, key: tuple[int, ...], st: CompressionState) -> None:
        """Under "propagate": keep what a compress step changes in ``st`` (once per iteration), so that
        an iteration where some bucket held NaN/Inf can be undone."""
        if key in self._saved:
            return
        self._saved.add(key)
        old = self._snapshots.get(key)
        keep = {}
        for name, t in st.tensors.items():
            b = old[2].get(name) if old is not None else None
            if b is not None and b.shape == t.shape and b.dtype == t.dtype and b.device == t.device:
                keep[name] = b.copy_(t)
            else:
                keep[name] = t.clone()
        self._snapshots[key] = (st.step, st.seed, keep)

    def _restore(self) -> None:
        """Put every state touched this iteration back as it was before it (the step is skipped)."""
        for key in self._created:
            self.states.pop(key, None)
        for key in self._saved - self._created:
            st = self.states.get(key)
            step, seed, saved = self._snapshots[key]
            if st is None:
                continue
            st.step, st.seed = step, seed
            for name in [n for n in st.tensors if n not in saved]:
                del st.tensors[name]
            for name, b in saved.items():
                t = st.tensors.get(name)
                if t is not None and t.shape == b.shape and t.dtype == b.dtype and t.device == b.device:
                    t.copy_(b)
                else:
                    st.tensors[name] = b.clone()
        if self._created:
            for plan in self._plans.values():  # they may hold the dropped states
                plan.states = None

    # -- states ---------------------------------------------------------------------------------------

    def _state(self, key: tuple[int, ...], rank: int) -> CompressionState:
        st = self.states.get(key)
        if st is None:
            st = self.compressor.new_state(seed=(rank * 1_000_003 + key[0]) & 0x7FFFFFFF)
            if len(key) > 1 or any(len(k) > 1 for k in self.states):
                self._carry_residuals(key, st)
            self.states[key] = st
            self._created.add(key)
        self._used.add(key)
        return st

    def _numel(self, k: int) -> int:
        return math.prod(self.shapes[k])

    def _carry_residuals(self, key: tuple[int, ...], st: CompressionState) -> None:
        """A new group (the bucket layout changed): carry each member's error-feedback residual over from
        the group that held it, element for element. Other state (PowerSGD's Q, the sign server
        residual) starts afresh."""
        pieces = []
        for old_key, old in self.states.items():
            r = old.tensors.get("residual")
            if r is None or not set(old_key) & set(key):
                continue
            off = 0
            for k in old_key:
                n = self._numel(k)
                if k in key:
                    pieces.append((k, r[off : off + n]))
                off += n
        if not pieces:
            return
        found = dict(pieces)
        dev = pieces[0][1].device
        parts = []
        for k in key:
            p = found.get(k)
            parts.append(p if p is not None else torch.zeros(self._numel(k), dtype=torch.float32, device=dev))
        st.tensors["residual"] = torch.cat(parts)

    # -- one bucket -----------------------------------------------------------------------------------

    def start(
        self, grads: Sequence[torch.Tensor], keys: Sequence[int], comm: Communicator, *,
        flat: torch.Tensor | None = None, nonfinite: bool = False,
    ) -> tuple[list[CompressedReduction], Callable[[], None] | None]:  # fmt: skip
        """Start averaging one bucket's gradients (in place). Returns the reductions to pipeline and a
        function to call when they are done (copies back from temporary flat buffers), or None.
        ``flat``: a contiguous buffer the gradients are views of, in order (DDP's ``bucket.buffer()``),
        reduced as one tensor where the whole bucket travels alike (uncompressed, or a cast); ``grads``
        may then be a function returning them, called only when needed (the first time a layout is seen,
        or when the bucket is compressed tensor by tensor). Each
        reduction's ``single_round`` says whether its decode may run from its collective's callback.
        ``nonfinite``: :meth:`screen` found NaN/Inf in this bucket on some rank: it is averaged uncompressed
        (so every rank receives the NaN/Inf) and the iteration is undone when it ends."""
        if nonfinite:
            self._skip = True
            if callable(grads) and flat is None:
                grads = grads()
            return [self._whole([] if flat is not None else list(grads), flat, comm, self._plain_c)], None
        propagate = self.mode() == "propagate"
        if self.auto is not None and self.auto.decision is None:
            grads = self._auto_turn(grads, keys, comm, flat)
        c = self._unchecked if propagate else self.compressor
        if flat is not None:  # the whole bucket may travel as it is: no need to look at its gradients
            plan = self._plans.get((tuple(keys), flat.dtype, comm.world_size))
            if plan is not None and (self.iteration < self.start_iter or c.identity):
                return [self._plain([], flat, comm, propagate)], None
            if plan is not None and not plan.compressed and not plan.plain:
                return [self._whole([], flat, comm, c, plan.work)], None
        if callable(grads):
            grads = grads()
        if not isinstance(grads, list):
            grads = list(grads)
        plan = self._plan(grads, keys, comm)
        if self.iteration < self.start_iter or c.identity:
            return [self._plain(grads, flat, comm, propagate)], None
        if not plan.compressed and not plan.plain:  # elementwise: the bucket as one tensor
            return [self._whole(grads, flat, comm, c, plan.work)], None
        reductions: list[CompressedReduction] = []
        finish = None
        plain: list[torch.Tensor] = [grads[i] for i in plan.plain]
        if plain:
            if plan.carry is None:
                plan.carry = _carries(c, plan, plain, comm.world_size)
            if not plan.carry:
                reductions.append(self._plain(plain, None, comm, propagate))
                plain = []
        states = plan.states
        if states is None:
            states = plan.states = [self._state(k, comm.rank) for k in plan.state_keys]
        self._used.update(plan.state_keys)
        if propagate and c.stateful:
            for k, st in zip(plan.state_keys, states):
                self._save(k, st)
        if self.policy == "layerwise":
            if states:
                tensors = [grads[g[0]] for g in plan.compressed]
                reductions.append(issue(tensors, states, comm, c, quantize_mode=self.quantize_mode,
                                        single_round=plan.single_round, plain=plain))  # fmt: skip
        elif plan.compressed:
            members = [grads[i] for i in plan.compressed[0]]
            one = _as_one(members)
            if one is None:
                one, layout = flatten(members)

                def finish() -> None:
                    unflatten(one, layout, members)

            reductions.append(issue([one], states, comm, c, quantize_mode=self.quantize_mode,
                                    single_round=plan.single_round, plain=plain))  # fmt: skip
        return reductions, finish

    def _plain(self, grads: list[torch.Tensor], flat: torch.Tensor | None, comm: Communicator,
               propagate: bool) -> CompressedReduction:  # fmt: skip
        """An uncompressed reduction (as :meth:`_whole`). Under "propagate" NaN/Inf pass through (the
        GradScaler skips the step). Under "raise" the decode (the division by the world size, in the
        collective's completion callback for a one-round bucket) also sums each average, for
        :meth:`check_averages`: no host read there, so nothing waits for the collective."""
        if propagate:
            return self._whole(grads, flat, comm, self._plain_c)
        if flat is None:
            flat = grads[0].view(-1) if len(grads) == 1 and grads[0].is_contiguous() else _as_one(grads)
        tensors = [t for t in (grads if flat is None else [flat]) if t.numel()]
        if not tensors:
            return self._whole(grads, flat, comm, self._plain_c)
        gen, alg = self._plain_c.reduce(tensors, [self._stateless] * len(tensors), comm)
        return CompressedReduction(tensors, _summing(gen, tensors, self._sums), "none", alg, single_round=True)

    def check_averages(self) -> None:
        """Under "raise", once every bucket of the iteration is done: ``NonFiniteError`` if an uncompressed
        average holds NaN/Inf. Every rank holds the same averages, so every rank raises alike (a rank that
        checked its own input instead would raise alone and leave its peers waiting for its collective).
        One host read per iteration, at its end, of the sums the decodes took; the exact count only when
        one is not finite."""
        sums, self._sums = self._sums, []
        if not sums or math.isfinite(torch.stack([t for t, _ in sums]).sum().item()):
            return
        bad = sum(int(count_nonfinite(t.reshape(-1))) for _, t in sums)  # none: the sum itself overflowed
        if bad:
            raise NonFiniteError(
                f"{bad} non-finite gradient element(s) (NaN/Inf) in this iteration's uncompressed average, sent by "
                "some rank; every rank raises this (nonfinite='raise'), the averages are in the gradients: skip "
                "the step. A GradScaler with nonfinite='propagate' skips such steps on every rank instead"
            )

    def _whole(self, grads: list[torch.Tensor], flat: torch.Tensor | None, comm: Communicator,
               c: Compressor, st: CompressionState | None = None) -> CompressedReduction:  # fmt: skip
        """One single-round reduction of all ``grads`` through a stateless compressor (uncompressed or a
        cast): of ``flat`` or the span the tensors cover when they lie back to back, else of the list
        (the compressor's rounds flatten it in one fused pass)."""
        if flat is None:
            flat = grads[0].view(-1) if len(grads) == 1 and grads[0].is_contiguous() else _as_one(grads)
        tensors = grads if flat is None else [flat]
        st = st or self._stateless
        return issue(tensors, [st] * len(tensors), comm, c, single_round=True)

    def end_iteration(self) -> bool:
        """Count a finished iteration; forget groups the current bucket layout no longer uses. An iteration
        where some bucket held NaN/Inf ("propagate") is undone instead: every state as before it, the
        iteration not counted. Returns whether it was undone."""
        if self._skip:
            self._restore()
            self._skip = False
            self._saved, self._created, self._used = set(), set(), set()
            self.nonfinite_steps += 1
            return True
        self._saved, self._created, self._sums = set(), set(), []
        if self.auto is not None and self.auto.decision is None:
            self.auto.end_iteration()
        if self._used:
            used = self._used
            for k in [k for k in self.states if k not in used]:
                del self.states[k]
            # plans of layouts gone (DDP's rebuild) would hold forgotten states
            for sig in [s for s, p in self._plans.items() if p.states and not used.issuperset(p.state_keys)]:
                del self._plans[sig]
        self._used = set()
        self.iteration += 1
        return False

    def abandon_iteration(self) -> None:
        """Forget what this iteration noted (a collective or a compressor failed mid-iteration): the next
        one saves its states afresh."""
        self._saved, self._created, self._skip = set(), set(), False
        self._sums = []

    # -- checkpoints ----------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {
            "iteration": self.iteration,
            "policy": self.policy,
            "compressor": repr(self.compressor),
            "shapes": dict(self.shapes),
            "states": {k: s.state_dict() for k, s in self.states.items()},
            "auto": self.auto.decision.as_dict() if self.auto is not None and self.auto.decision else None,
        }

    def load_state_dict(self, sd: dict, what: str) -> None:
        need = {"iteration", "policy", "shapes", "states"}
        if not isinstance(sd, dict) or not need <= sd.keys():
            raise InvalidArgumentError(f"{what}.load_state_dict: expected a dict from state_dict() with keys {need}")
        if sd["policy"] != self.policy:
            raise InvalidArgumentError(
                f"{what}.load_state_dict: the checkpoint was saved with policy={sd['policy']!r}, this state "
                f"uses {self.policy!r}; construct the state with the same policy"
            )
        if sd.get("auto") is not None:
            if self.auto is None:
                raise InvalidArgumentError(
                    f"{what}.load_state_dict: the checkpoint was saved with compressor='auto' (which chose "
                    f"{sd['auto']['choice']}); construct this state with compressor='auto' too"
                )
            self._apply_auto(self.auto.restore(sd["auto"], what))  # the saved choice, not a new measurement
        if sd.get("compressor", repr(self.compressor)) != repr(self.compressor):
            raise InvalidArgumentError(
                f"{what}.load_state_dict: the checkpoint was saved with {sd['compressor']}, this state uses "
                f"{self.compressor!r}"
            )
        states = {}
        for k, v in sd["states"].items():
            st = self.compressor.new_state()
            st.load_state_dict(v)
            states[tuple(k)] = st
        self.iteration = int(sd["iteration"])
        self.shapes = {int(k): tuple(v) for k, v in sd["shapes"].items()}
        self.states = states
        self._plans = {}
        self._used = set()
        self._snapshots, self._saved, self._created, self._skip = {}, set(), set(), False


def _summing(gen, tensors: list[torch.Tensor], sink: list):
    """``gen``'s rounds, then (average, its sum in fp32) of each tensor appended to ``sink`` (a list append:
    safe from the backend's completion thread)."""
    yield from gen
    for t in tensors:
        sink.append((t.sum(dtype=torch.float32).reshape(1), t))


def _unchecked(c: Compressor) -> Compressor:
    """``c`` without its NaN/Inf check (under "propagate" the bucket layer has screened the input)."""
    if getattr(c, "check_finite", False):
        return dataclasses.replace(c, check_finite=False)
    return c


def grad_scaler_in_use() -> bool:
    """Whether this process holds an enabled ``torch.amp.GradScaler`` (or a subclass's instance): what
    ``nonfinite="auto"`` resolves to "propagate" by. One look at the objects that refer to the scaler
    classes (their instances), made once per hook state or synchronizer."""
    base = torch.amp.GradScaler
    classes, todo = [], [base]
    while todo:
        k = todo.pop()
        classes.append(k)
        todo.extend(k.__subclasses__())
    return any(isinstance(o, base) and o.is_enabled() for o in gc.get_referrers(*classes))
