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

Agreement. The first time a bucket layout is seen (and again after ``set_compressor``, ``compressor="auto"``'s
choice or ``load_state_dict``), its plan is made and the ranks exchange its signature before any of its
collectives (:func:`~torsh_kernels.collectives.agreement.agree`: one all-gather of a fixed size): the
compressor's signature, the bucket settings' (:class:`~torsh_kernels.parallel.BucketSpec`, its non-finite
policy resolved), auto's candidates and choice), the bucket (its
parameters, tensor count, element count, shapes, dtypes), the iteration count and the step counts of its
states. If any rank's differ, every rank raises :class:`~torsh_kernels.errors.CollectiveMismatchError`
naming each difference; nothing of the bucket was sent. Later steps on that layout exchange nothing.
:meth:`BucketCompressor.prepare` does it, called before :meth:`~BucketCompressor.screen` so that the
first exchange precedes the non-finite flag and auto's measurements, whose presence it agrees on.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

import torch

from ..collectives.agreement import agree_on, enabled
from ..collectives.communicator import Communicator
from ..compression import (
    CompressedReduction,
    CompressionState,
    Compressor,
    NoCompression,
)
from ..compression.allreduce import issue
from ..compression.names import as_compressor
from ..compression.quantize import apply_quantize_mode
from ..errors import ArgumentTypeError, InvalidArgumentError, LayoutMismatchError, NonFiniteError
from ..ops import COMPRESS_DTYPES, count_nonfinite, flatten, unflatten
from .auto import AutoSelector, default_candidates
from .auto_follow import FollowSpec, LinkFollower, follow_spec, hand_over, take_handover
from .buckets import BucketPlan, BucketSpec, carries_plain, flat_view
from .engine_state import checked_state, restore, snapshot
from .pipeline import grad_scaler_in_use, summing, unchecked


class BucketCompressor:
    """Compresses buckets of gradients through one compressor: which tensors are compressed, the state
    of each compressed tensor (``policy="layerwise"``) or group (``"bucket"``), warm-up, statistics.

    Tensors are identified by integer keys the caller assigns (parameter ordinals), so states survive
    a change of bucket layout (DDP rebuilds its buckets after the first iteration)."""

    __slots__ = (
        "_created",
        "_given",
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
        "_what",
        "auto",
        "check_signatures",
        "compressor",
        "follow",
        "handover",
        "iteration",
        "nonfinite_steps",
        "replans",
        "shapes",
        "signature_checks",
        "signature_s",
        "spec",
        "states",
        "taken",
    )

    def __init__(
        self,
        compressor: Compressor | str | None,
        spec: BucketSpec | None = None,
        *,
        auto_candidates: Sequence[Compressor | None] | None = None,
        auto_follow: FollowSpec | bool | None = None,
        check_signatures: bool | None = None,
        quantize_mode: str | None = None,
        what: str = "BucketCompressor",
        **options: object,
    ) -> None:
        """``spec`` with ``options`` (:class:`~torsh_kernels.parallel.BucketSpec`'s fields as keywords)
        applied: the bucket settings; ``quantize_mode``: deprecated (``Quantize(scheme=...)``)."""
        spec = BucketSpec.build(spec, options, what, "bucket")
        compressor = as_compressor(compressor, f"{what}: compressor", allow_auto=True)  # a name, or 'auto'
        auto = isinstance(compressor, str)
        if auto_candidates is not None and isinstance(auto_candidates, (list, tuple)):
            auto_candidates = [None if c == "none" else as_compressor(c, f"{what}: auto_candidates")
                               for c in auto_candidates]  # fmt: skip
        if auto_candidates is not None and not auto:
            raise InvalidArgumentError(
                f"{what}: auto_candidates is for compressor='auto', got compressor={compressor!r}"
            )
        if auto_follow is not None and not auto:
            raise InvalidArgumentError(f"{what}: auto_follow is for compressor='auto', got compressor={compressor!r}")
        follow = follow_spec(auto_follow, what) if auto else None
        if quantize_mode is not None:  # deprecated: the scheme is Quantize's own setting
            if auto:
                auto_candidates = [apply_quantize_mode(c, quantize_mode, what) for c in
                                   (default_candidates() if auto_candidates is None else auto_candidates)]  # fmt: skip
            else:
                compressor = apply_quantize_mode(compressor, quantize_mode, what)
        if auto or compressor is None:
            compressor = NoCompression()  # 'auto': uncompressed until the choice is made
        if not isinstance(compressor, Compressor):
            raise ArgumentTypeError(
                f"{what}: compressor must be a Compressor, a compressor's name (e.g. 'int8', 'topk:0.01'), None or "
                f"'auto', got {type(compressor).__name__}"
            )
        self._given = spec  # as given (None: the compressor's own warm-up), for auto's candidates
        self.spec = spec.resolved(compressor.warmup(), auto)
        """The bucket settings, ``start_iter`` and ``min_compression_rate`` resolved."""
        self.check_signatures = enabled(check_signatures, what)
        """Exchange each new bucket layout's signature with the other ranks (see the module docstring)."""
        self.signature_checks = 0
        """Signature exchanges made so far (one per new bucket layout or compressor configuration)."""
        self.signature_s = 0.0
        """Seconds they took (this rank, wall clock)."""
        self._what = what
        # the warm-up and the size rule are decided here, per tensor; the compressor must not repeat them
        self.compressor = compressor.per_tensor(self.spec.min_compression_rate)
        self._unchecked = unchecked(self.compressor)
        self._mode = None if self.spec.nonfinite == "auto" else self.spec.nonfinite  # "auto": at the first bucket
        self.nonfinite_steps = 0
        self._skip = False  # a bucket of this iteration held NaN/Inf on some rank ("propagate")
        self._snapshots: dict[tuple[int, ...], tuple[int, int, dict[str, torch.Tensor]]] = {}
        self._saved: set[tuple[int, ...]] = set()  # states saved this iteration
        self._created: set[tuple[int, ...]] = set()  # states first made this iteration
        self.iteration = 0
        self.states: dict[tuple[int, ...], CompressionState] = {}
        self.shapes: dict[int, tuple[int, ...]] = {}
        self._plans: dict[tuple, BucketPlan] = {}
        self._used: set[tuple[int, ...]] = set()
        self._plain_c = NoCompression(check_finite=False)
        self._sums: list = []  # this iteration's uncompressed averages and their sums, checked at its end
        self._stateless = CompressionState()  # the state handed to stateless compressors (casts, plain)
        # the pending or made compressor="auto" choice (None for a fixed compressor)
        self.auto = AutoSelector(self._candidate_engine, auto_candidates) if auto else None
        # compressor="auto" that follows the link (auto_follow.py): its measurements, its re-plans, and the
        # residuals handed over from a compressor it switched away from until each parameter's gradient takes it
        self.follow = LinkFollower(follow) if follow is not None else None
        self.replans: list[dict] = []
        self.handover: dict[int, torch.Tensor] = {}
        self.taken: set[int] = set()

    # -- compressor="auto" ------------------------------------------------------------------------------

    def _candidate_engine(self, c: Compressor | None) -> BucketCompressor:
        """The engine a candidate of ``auto`` would run in: this one's size rules, no warm-up."""
        spec = self._given.replace(start_iter=0, nonfinite=self.mode())
        return BucketCompressor(c, spec, check_signatures=False)

    def _apply_auto(self, compressor: Compressor | None) -> None:
        rate = self._given.min_compression_rate
        if rate is None:
            rate = compressor.warmup()[1] if compressor is not None else self.spec.min_compression_rate
        start = self.spec.start_iter
        if compressor is not None:  # a candidate with a warm-up of its own (PowerSGD(start_iter=...)) keeps it
            start = max(start, compressor.warmup()[0])
        self.spec = self.spec.replace(min_compression_rate=float(rate), start_iter=start)
        self.set_compressor(compressor)

    def _auto_turn(self, grads, keys: Sequence[int], comm: Communicator, flat: torch.Tensor | None):
        """While ``auto`` has not chosen: note the bucket during the warm-up, or choose (the first bucket
        of iteration ``start_iter`` on every rank, when no collective of the job is in flight) once a whole
        iteration has been seen. Returns the gradients if it had to fetch them."""
        if self.iteration >= self.spec.start_iter and self.auto.ready:
            self._apply_auto(self.auto.decide(comm).compressor)
            return grads
        if callable(grads):
            grads = grads()
        grads = list(grads)
        self.auto.observe(grads, keys, packed=flat is not None or flat_view(grads) is not None)
        return grads

    def set_compressor(self, compressor: Compressor | str | None) -> None:
        """Switch to another compressor between iterations, on every rank alike (``compressor="auto"``
        does at the end of the warm-up, and when it follows the link). The compressor states and cached
        bucket plans are dropped, except each parameter's error-feedback residual: the gradient mass not sent
        yet is added to that parameter's next gradient, whatever the new compressor (so nothing is lost;
        :func:`~.auto_follow.hand_over`). The warm-up length and size rules stay as constructed."""
        compressor = as_compressor(compressor, "set_compressor")
        if compressor is None:
            compressor = NoCompression()
        if not isinstance(compressor, Compressor):
            raise ArgumentTypeError(
                f"set_compressor: expected a Compressor, a compressor's name or None, got {type(compressor).__name__}"
            )
        hand_over(self)
        self.compressor = compressor.per_tensor(self.spec.min_compression_rate)
        self._unchecked = unchecked(self.compressor)
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
        if t.dim() < 2 or t.numel() < max(1, self.spec.min_numel):
            return False
        wire = c.payload_nbytes(tuple(t.shape), t.dtype)
        return wire > 0 and t.numel() * t.element_size() / wire >= self.spec.min_compression_rate

    def prepare(self, grads, keys: Sequence[int], comm: Communicator, *, flat: torch.Tensor | None = None):
        """Call before a bucket's first collective (before :meth:`screen`): the first time its layout is
        seen, make its plan and agree on it with the other ranks (see the module docstring). ``grads``,
        ``keys`` and ``flat`` as for :meth:`start` (``grads`` may be a function returning them); returns
        the gradients if they had to be fetched, else ``grads`` as given. Costs one dictionary look-up
        once the layout is known."""
        if flat is not None and (tuple(keys), flat.dtype, comm.world_size) in self._plans:
            return grads
        if callable(grads):
            grads = grads()
        if not isinstance(grads, list):
            grads = list(grads)
        self._plan(grads, keys, comm)
        return grads

    def _plan(self, grads: Sequence[torch.Tensor], keys: Sequence[int], comm: Communicator) -> BucketPlan:
        # keys name parameters, whose shapes do not change: the shapes are checked when the plan is made
        sig = (tuple(keys), grads[0].dtype if grads else None, comm.world_size)  # as in start()
        plan = self._plans.get(sig)
        if plan is None:
            plan = self._make_plan(grads, keys, comm)
            if self.check_signatures:
                self._agree(plan, grads, keys, comm)
            self._plans[sig] = plan
        return plan

    def _agree(self, plan: BucketPlan, grads: Sequence[torch.Tensor], keys: Sequence[int], comm: Communicator) -> None:
        """The signature exchange of a new bucket layout (see the module docstring)."""
        auto = self.auto
        extra = [
            ("auto", None if auto is None else (repr(auto), auto.decision.choice if auto.decision else None)),
            ("parameters", list(keys)),
            ("iteration", self.iteration),
            ("state steps", [st.step if (st := self.states.get(k)) is not None else None for k in plan.state_keys]),
        ]
        t0 = time.perf_counter()
        try:
            agree_on(comm, "a bucket's reduction", specs={"compressor": self.compressor,
                     "bucket": self.spec.replace(nonfinite=self.mode())}, tensors=grads, extra=extra, what=self._what,
                     fix="Construct it alike on every rank (the same compressor and settings) over the same model, "
                     "and load the same checkpoint on every rank.")  # fmt: skip
        finally:
            self.signature_checks += 1
            self.signature_s += time.perf_counter() - t0

    def _make_plan(self, grads: Sequence[torch.Tensor], keys: Sequence[int], comm: Communicator) -> BucketPlan:
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
            return BucketPlan([], [])
        comp = [i for i, g in enumerate(grads) if self.eligible(g)]
        plain = sorted(set(range(len(grads))) - set(comp))
        if self.spec.policy == "layerwise":
            groups = [[i] for i in comp]
            shapes = [tuple(grads[i].shape) for i in comp]
        else:
            groups = [comp] if comp else []
            shapes = [(sum(grads[i].numel() for i in comp),)] if comp else []
        single = True
        for shape in shapes:
            schemes = c.schemes(shape, grads[0].dtype, comm.world_size)
            single = single and all(len(rounds) == 1 for rounds in schemes.values())
        state_keys = [tuple(keys[i] for i in g) for g in groups]
        return BucketPlan(groups, plain, single, state_keys)

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
        if self.auto is not None and self.auto.decision is None and self.iteration >= self.spec.start_iter \
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
        self._snapshots[key] = snapshot(st, self._snapshots.get(key))

    def _restore(self) -> None:
        """Put every state touched this iteration back as it was before it (the step is skipped)."""
        for key in self._created:
            self.states.pop(key, None)
        for key in self._saved - self._created:
            st = self.states.get(key)
            if st is not None:
                restore(st, self._snapshots[key])
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
            if flat is None or (tuple(keys), flat.dtype, comm.world_size) not in self._plans:
                grads = self.prepare(grads, keys, comm, flat=flat)  # (the hook and the synchronizer did)
            return [self._whole([] if flat is not None else list(grads), flat, comm, self._plain_c)], None
        propagate = self.mode() == "propagate"
        if self.auto is not None and self.auto.decision is None:
            grads = self._auto_turn(grads, keys, comm, flat)
        elif self.follow is not None and not self.auto.ready:  # a choice from a checkpoint: note the buckets
            grads = list(grads() if callable(grads) else grads)  # a re-plan measures the candidates on
            self.auto.observe(grads, keys, packed=flat is not None or flat_view(grads) is not None)
        if self.handover:
            grads = take_handover(self, grads, keys)
        c = self._unchecked if propagate else self.compressor
        if flat is not None:  # the whole bucket may travel as it is: no need to look at its gradients
            plan = self._plans.get((tuple(keys), flat.dtype, comm.world_size))
            if plan is not None and (self.iteration < self.spec.start_iter or c.identity):
                return [self._plain([], flat, comm, propagate)], None
            if plan is not None and not plan.compressed and not plan.plain:
                return [self._whole([], flat, comm, c, plan.work)], None
        if callable(grads):
            grads = grads()
        if not isinstance(grads, list):
            grads = list(grads)
        plan = self._plan(grads, keys, comm)
        if self.iteration < self.spec.start_iter or c.identity:
            return [self._plain(grads, flat, comm, propagate)], None
        if not plan.compressed and not plan.plain:  # elementwise: the bucket as one tensor
            return [self._whole(grads, flat, comm, c, plan.work)], None
        reductions: list[CompressedReduction] = []
        finish = None
        plain: list[torch.Tensor] = [grads[i] for i in plan.plain]
        if plain:
            if plan.carry is None:
                plan.carry = carries_plain(c, plan, plain, comm.world_size)
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
        if self.spec.policy == "layerwise":
            if states:
                tensors = [grads[g[0]] for g in plan.compressed]
                reductions.append(issue(tensors, states, comm, c,
                                        single_round=plan.single_round, plain=plain))  # fmt: skip
        elif plan.compressed:
            members = [grads[i] for i in plan.compressed[0]]
            one = flat_view(members)
            if one is None:
                one, layout = flatten(members)

                def finish() -> None:
                    unflatten(one, layout, members)

            reductions.append(issue([one], states, comm, c,
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
            flat = grads[0].view(-1) if len(grads) == 1 and grads[0].is_contiguous() else flat_view(grads)
        tensors = [t for t in (grads if flat is None else [flat]) if t.numel()]
        if not tensors:
            return self._whole(grads, flat, comm, self._plain_c)
        gen, alg = self._plain_c.reduce(tensors, [self._stateless] * len(tensors), comm)
        return CompressedReduction(tensors, summing(gen, tensors, self._sums), "none", alg, single_round=True)

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
            flat = grads[0].view(-1) if len(grads) == 1 and grads[0].is_contiguous() else flat_view(grads)
        tensors = grads if flat is None else [flat]
        st = st or self._stateless
        return issue(tensors, [st] * len(tensors), comm, c, single_round=True)

    def end_iteration(self) -> bool:
        """Count a finished iteration; forget groups the current bucket layout no longer uses. An iteration
        where some bucket held NaN/Inf ("propagate") is undone instead: every state as before it, the
        iteration not counted. Returns whether it was undone."""
        if self._skip:
            self._restore()
            self.taken = set()  # the step is skipped: the handed-over residuals wait for the next one
            self._skip = False
            self._saved, self._created, self._used = set(), set(), set()
            self.nonfinite_steps += 1
            return True
        self._saved, self._created, self._sums = set(), set(), []
        if self.taken:
            for k in self.taken:
                self.handover.pop(k, None)
            self.taken = set()
        if self.auto is not None and (self.auto.decision is None or not self.auto.ready):
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
        self.taken = set()

    # -- checkpoints ----------------------------------------------------------------------------------

    def state_dict(self, owner: tuple[int, int] | None = None) -> dict:
        """The engine's state; ``owner``: (rank, world size) of the process whose residuals these are, recorded
        so that a load onto another rank is refused (None: not known here, not recorded)."""
        return {
            **({"rank": owner[0], "world_size": owner[1]} if owner is not None else {}),
            "iteration": self.iteration,
            "policy": self.spec.policy,
            "compressor": repr(self.compressor),
            "shapes": dict(self.shapes),
            "states": {k: s.state_dict() for k, s in self.states.items()},
            "auto": self.auto.decision.as_dict() if self.auto is not None and self.auto.decision else None,
            **({"handover": {k: r.clone() for k, r in self.handover.items()}} if self.handover else {}),
        }

    def load_state_dict(self, sd: dict, what: str, owner: tuple[int, int] | None = None) -> None:
        """Restore from :meth:`state_dict`, all or nothing: every entry is checked (types, the policy, the
        compressor, the auto choice, the shapes against those this engine has seen, each state, each
        residual's size against its tensors' shapes) before anything changes; a typed error names the
        first bad one (:func:`~torsh_kernels.parallel.engine_state.checked_state`)."""
        decision, iteration, shapes, states, handover = checked_state(self, sd, what, owner)
        # everything checked: now change
        if decision is not None:
            self._apply_auto(decision.compressor)
            self.auto.decision = decision
        self.iteration = iteration
        self.shapes = shapes
        self.states = states
        self.handover, self.taken = handover, set()
        self._plans = {}
        self._used = set()
        self._snapshots, self._saved, self._created, self._skip = {}, set(), set(), False

    def auto_compressor(self, compressor: Compressor | None) -> Compressor:
        """The compressor ``compressor="auto"``'s choice of ``compressor`` would install (nothing changed)."""
        rate = self._given.min_compression_rate
        if rate is None:
            rate = compressor.warmup()[1] if compressor is not None else self.spec.min_compression_rate
        return (compressor if compressor is not None else NoCompression()).per_tensor(float(rate))
