"""``compressor="auto"``: measure this job's link and every candidate compressor's real cost on this job's
buckets, then fix one choice on every rank.

How the choice is made (:meth:`AutoSelector.decide`, once, when the warm-up ends):

1. **The buckets.** During the warm-up iterations (plain all-reduces, as DDP would run) the selector
   notes the buckets of the last complete iteration: each gradient's shape and dtype, and whether the
   gradients lie back to back in one buffer (DDP's bucket views do).
2. **The link.** :func:`~torsh_kernels.collectives.cost_model.probe` times ping-pongs between rank pairs
   and returns the slowest pair's latency and bandwidth, the same on every rank.
3. **Each candidate's compute.** Every candidate runs the real bucket path (the same
   :class:`~._engine.BucketCompressor` start, with this job's ``policy``, ``min_numel`` and
   ``min_compression_rate``) on buckets of those shapes filled with random values, over a
   :class:`~torsh_kernels.collectives.replica.ReplicaCommunicator`: a stand-in for the world size in which
   every rank holds this rank's data, so compressing, decoding ``world_size`` payloads and the host work
   per bucket are all real while the network costs nothing. The fastest of ``repeats`` timed runs (after
   one untimed run that builds the states) is the candidate's compute per step; the slowest rank's value
   counts (an all-reduce of the vector with ``max``).
4. **Each candidate's wire time.** The replica records every collective the reduction issued and the
   bytes it put in; the alpha-beta model prices each on the probed link.
5. **The choice.** Rank 0 takes the candidate with the least compute + wire time per step and broadcasts
   it; every rank switches to it. The reasons (link, every candidate's compute, bytes, wire time and
   break-even bandwidth) are kept in :class:`AutoDecision`, which the hook and the synchronizer put in
   their statistics.

The model charges every candidate its compute and its wire time in full; it ignores the overlap of
communication with the backward pass, which favours compression a little where backward is long.
``benchmarks/bench_ddp.py --auto`` checks the choice against every candidate's measured step time.

The break-even bandwidth of a candidate is the link bandwidth below which it beats sending the
gradients uncompressed at the probed latency: ``inf`` when it wins at any bandwidth, ``0`` when it never
does.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ..collectives.communicator import Communicator
from ..collectives.cost_model import Link, Round, Topology, probe, rounds_time
from ..collectives.replica import ReplicaCommunicator
from ..compression import Compressor
from ..compression.names import AUTO, DEFAULT_CANDIDATE_NAMES, compressor_from_name, former_label
from ..errors import ArgumentTypeError, InvalidArgumentError

__all__ = ["AUTO", "AutoDecision", "AutoSelector", "CandidateCost", "default_candidates", "price"]


def default_candidates() -> tuple[Compressor | None, ...]:
    """What ``compressor="auto"`` chooses among unless told otherwise: uncompressed, fp16, bf16, top-k 1%,
    int8, int4, sign and PowerSGD rank 4. Each but the first changes what the optimizer sees; pass
    ``auto_candidates=`` to allow only those your model tolerates."""
    return tuple(None if n == "none" else compressor_from_name(n) for n in DEFAULT_CANDIDATE_NAMES)


def _label(c: Compressor | None) -> str:
    return "none" if c is None else c.label()


@dataclass(frozen=True, slots=True)
class CandidateCost:
    """One candidate as ``auto`` measured and priced it, per training step."""

    name: str
    """The compressor's label (``none`` for uncompressed)."""
    compute_s: float
    """Seconds of compressing, decoding and per-bucket host work (the slowest rank's)."""
    bytes_sent: int
    """Payload bytes this rank puts on the wire."""
    collectives: int
    """Collectives issued."""
    wire_s: float
    """Predicted seconds on the wire on the probed link."""
    break_even_bps: float
    """Link bandwidth (bytes/s) below which it beats uncompressed at the probed latency (inf: always)."""

    @property
    def total_s(self) -> float:
        return self.compute_s + self.wire_s

    def as_dict(self) -> dict:
        return {
            "compressor": self.name,
            "compute_s": self.compute_s,
            "bytes_sent": self.bytes_sent,
            "collectives": self.collectives,
            "wire_s": self.wire_s,
            "total_s": self.total_s,
            "break_even_gbit": None if math.isinf(self.break_even_bps) else self.break_even_bps * 8 / 1e9,
        }


@dataclass(slots=True)
class AutoDecision:
    """What ``auto`` chose and why."""

    choice: str
    """The chosen candidate's label."""
    compressor: Compressor | None
    """The chosen compressor (None: uncompressed)."""
    link: Link
    """The probed link."""
    world_size: int
    buckets: int
    """Buckets per step it was measured on."""
    gradient_bytes: int
    """Gradient bytes per step."""
    candidates: list[CandidateCost] = field(default_factory=list, repr=False)
    """Every candidate, cheapest first."""
    measure_s: float = 0.0
    """Seconds the decision took (probe and measurements)."""

    def __repr__(self) -> str:
        """One line; ``str()`` is the table of every candidate."""
        gbit = self.link.bandwidth * 8 / 1e9
        return (
            f"AutoDecision(choice={self.choice!r} of {len(self.candidates)} candidates, link {gbit:.3g} Gbit/s "
            f"{self.link.latency * 1e6:.0f} us, world_size={self.world_size}, buckets={self.buckets}, "
            f"gradient_bytes={self.gradient_bytes}, measure_s={self.measure_s:.3g})"
        )

    @property
    def reason(self) -> str:
        best = self.candidates[0]
        none = next((c for c in self.candidates if c.name == "none"), None)
        gbit = self.link.bandwidth * 8 / 1e9
        s = (
            f"{best.name}: predicted {best.total_s * 1e3:.1f} ms/step (compute {best.compute_s * 1e3:.1f} ms + wire "
            f"{best.wire_s * 1e3:.1f} ms) on a {gbit:.3g} Gbit/s, {self.link.latency * 1e6:.0f} us link"
        )
        if none is not None and none is not best:
            s += f"; uncompressed {none.total_s * 1e3:.1f} ms/step"
        runner = next((c for c in self.candidates[1:]), None)
        if runner is not None:
            s += f"; next best {runner.name} {runner.total_s * 1e3:.1f} ms/step"
        return s

    def as_dict(self) -> dict:
        return {
            "choice": self.choice,
            "reason": self.reason,
            "link": {"latency_s": self.link.latency, "bandwidth_Bps": self.link.bandwidth},
            "world_size": self.world_size,
            "buckets": self.buckets,
            "gradient_bytes": self.gradient_bytes,
            "measure_s": self.measure_s,
            "candidates": [c.as_dict() for c in self.candidates],
        }

    @classmethod
    def from_dict(cls, d: dict, compressor: Compressor | None) -> AutoDecision:
        """The decision ``as_dict()`` recorded (a checkpoint's)."""
        cands = [
            CandidateCost(c["compressor"], c["compute_s"], c["bytes_sent"], c["collectives"], c["wire_s"],
                          math.inf if c["break_even_gbit"] is None else c["break_even_gbit"] * 1e9 / 8)
            for c in d["candidates"]
        ]  # fmt: skip
        link = Link(latency=d["link"]["latency_s"], bandwidth=d["link"]["bandwidth_Bps"])
        return cls(d["choice"], compressor, link, d["world_size"], d["buckets"], d["gradient_bytes"], cands,
                   d["measure_s"])  # fmt: skip

    def __str__(self) -> str:
        head = f"{'compressor':<16}{'compute ms':>11}{'MB sent':>9}{'wire ms':>9}{'total ms':>10}{'pays below':>13}"
        lines = [f"auto chose {self.choice}: {self.reason}", head]
        for c in self.candidates:
            be = "any link" if math.isinf(c.break_even_bps) else (
                "never" if c.break_even_bps <= 0 else f"{c.break_even_bps * 8 / 1e9:.3g} Gbit/s")  # fmt: skip
            if c.name == "none":
                be = "-"
            lines.append(f"{c.name:<16}{c.compute_s * 1e3:>11.2f}{c.bytes_sent / 1e6:>9.2f}{c.wire_s * 1e3:>9.2f}"
                         f"{c.total_s * 1e3:>10.2f}{be:>13}")  # fmt: skip
        return "\n".join(lines)


@dataclass(frozen=True, slots=True)
class _BucketShape:
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]
    keys: tuple[int, ...]
    packed: bool
    """The gradients lay back to back in one buffer (DDP's bucket views)."""
    device: torch.device


def _wire(rounds: Sequence[Round], topo: Topology, link: Link) -> float:
    # each collective priced on its own (a big and a tiny all-reduce may want different algorithms)
    return sum(rounds_time([r], topo, link)[1] for r in rounds)


def _run_bucket(engine, grads, keys, comm) -> None:
    """One bucket through the engine's real path, to the end."""
    reductions, finish = engine.start(grads, keys, comm)
    for r in reductions:
        r.wait()
    if finish is not None:
        finish()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def price(names: Sequence[str], computes: Sequence[float], rounds_of: Sequence[Sequence[Round]], world_size: int,
          link: Link) -> list[CandidateCost]:  # fmt: skip
    """Each candidate's cost per step from its measured compute seconds and the collectives it issued,
    on ``link`` (the alpha-beta model, every collective priced on its own), with its break-even bandwidth
    against the candidate named ``none`` (0 for every candidate when none is named so)."""
    topo = Topology(world_size=world_size)
    fast = Link(latency=link.latency, bandwidth=2 * link.bandwidth)
    priced = []
    for s, rounds in zip(computes, rounds_of):
        w1 = _wire(rounds, topo, link) if world_size > 1 else 0.0
        w2 = _wire(rounds, topo, fast) if world_size > 1 else 0.0
        b = 2 * link.bandwidth * (w1 - w2)  # wire(B) = a + b / B: b bandwidth-bound, a latency-bound
        priced.append((s, w1, w1 - b / link.bandwidth, b))
    base = priced[names.index("none")] if "none" in names else None
    costs = []
    for name, (s, w1, a, b), rounds in zip(names, priced, rounds_of):
        if name == "none":
            be = math.inf
        elif base is None:
            be = 0.0
        else:
            gain = base[3] - b  # (seconds saved on the wire) x bandwidth
            extra = (s + a) - (base[0] + base[2])  # seconds added at any bandwidth
            be = 0.0 if gain <= 0 else (math.inf if extra <= 0 else gain / extra)
        costs.append(CandidateCost(name, s, int(sum(r.nbytes for r in rounds)), len(rounds), w1, be))
    return costs


class AutoSelector:
    """Chooses a compressor for a bucket engine at the end of its warm-up (see the module docstring).

    Args:
        make_engine: builds the bucket engine a candidate would run in (same policy and size rules as
            the job's), with no warm-up; the selector drives its ``start`` on replica buckets.
        candidates: compressors to choose among (None in it: uncompressed); default
            :func:`default_candidates`.
        repeats: timed runs per candidate (the fastest counts).
        link: a known link instead of probing (also used when the world has a single rank).
    """

    def __init__(
        self,
        make_engine: Callable[[Compressor | None], object],
        candidates: Sequence[Compressor | None] | None = None,
        *,
        repeats: int = 3,
        link: Link | None = None,
    ) -> None:
        cands = tuple(default_candidates() if candidates is None else candidates)
        if not cands:
            raise InvalidArgumentError("compressor='auto': auto_candidates is empty; give at least one compressor")
        for c in cands:
            if c is not None and not isinstance(c, Compressor):
                raise ArgumentTypeError(
                    f"compressor='auto': auto_candidates must hold Compressors or None, got {type(c).__name__}"
                )
        labels = [_label(c) for c in cands]
        if len(set(labels)) != len(labels):
            raise InvalidArgumentError(f"compressor='auto': auto_candidates lists a compressor twice: {labels}")
        if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
            raise InvalidArgumentError(f"compressor='auto': repeats must be an int >= 1, got {repeats!r}")
        if link is not None and not isinstance(link, Link):
            raise ArgumentTypeError(f"compressor='auto': link must be a Link, got {type(link).__name__}")
        self.candidates = cands
        self.repeats = repeats
        self.link = link
        self._make_engine = make_engine
        self._current: list[_BucketShape] = []
        self._last: list[_BucketShape] = []
        self.decision: AutoDecision | None = None
        self._computes: list[float] | None = None  # each candidate's measured compute, kept for re-planning
        self._rounds: list[list[Round]] = []  # ... and the collectives it issued

    def __repr__(self) -> str:
        return f"auto({', '.join(_label(c) for c in self.candidates)})"

    # -- warm-up --------------------------------------------------------------------------------------

    def observe(self, grads: Sequence[torch.Tensor], keys: Sequence[int], *, packed: bool) -> None:
        """Note one bucket of the current warm-up iteration; ``packed``: its gradients lie back to back in
        one buffer (DDP's bucket views)."""
        if grads:
            self._current.append(_BucketShape(
                tuple(tuple(g.shape) for g in grads), tuple(g.dtype for g in grads), tuple(keys), packed,
                grads[0].device,
            ))  # fmt: skip

    def end_iteration(self) -> None:
        if self._current:
            self._last, self._current = self._current, []

    @property
    def ready(self) -> bool:
        """Whether a complete iteration has been observed."""
        return bool(self._last)

    def restore(self, record: dict, what: str) -> Compressor | None:
        """Take the choice recorded in a checkpoint (``AutoDecision.as_dict()``) without measuring again;
        returns the chosen candidate."""
        decision = self.recorded(record, what)
        self.decision = decision
        return decision.compressor

    def recorded(self, record: object, what: str) -> AutoDecision:
        """The decision a checkpoint recorded (``AutoDecision.as_dict()``), checked against this selector's
        candidates; a typed error for a record that is not one. Changes nothing."""
        labels = [_label(c) for c in self.candidates]
        if not isinstance(record, dict):
            raise ArgumentTypeError(f"{what}.load_state_dict: 'auto' must be a dict from AutoDecision.as_dict(), got "
                                    f"{type(record).__name__}")  # fmt: skip
        choice = record.get("choice")
        former = [former_label(c) for c in self.candidates]  # a checkpoint saved before the names
        if isinstance(choice, str) and choice not in labels and choice in former:
            record = {**record, "choice": labels[former.index(choice)]}
            choice = record["choice"]
        if not isinstance(choice, str) or choice not in labels:
            raise InvalidArgumentError(
                f"{what}.load_state_dict: the checkpoint's 'auto' choice {choice!r} is not among "
                f"this state's candidates {labels}; construct it with the same auto_candidates"
            )
        try:
            return AutoDecision.from_dict(record, self.candidates[labels.index(choice)])
        except (KeyError, TypeError, ValueError, IndexError, AttributeError, InvalidArgumentError) as e:
            raise InvalidArgumentError(
                f"{what}.load_state_dict: the checkpoint's 'auto' record is malformed ({type(e).__name__}: {e}); "
                "expected AutoDecision.as_dict()"
            ) from None

    # -- the decision ---------------------------------------------------------------------------------

    def _buckets(self) -> list[tuple[list[torch.Tensor], tuple[int, ...]]]:
        out = []
        for b in self._last or self._current:
            numels = [math.prod(s) for s in b.shapes]
            if b.packed:
                flat = torch.empty(sum(numels), dtype=b.dtypes[0], device=b.device)
                grads = [v.view(s) for v, s in zip(flat.split(numels), b.shapes)]
            else:
                grads = [torch.empty(s, dtype=d, device=b.device) for s, d in zip(b.shapes, b.dtypes)]
            out.append((grads, b.keys))
        return out

    @staticmethod
    def _fill(buckets, gen: torch.Generator) -> None:
        for grads, _ in buckets:
            for g in grads:
                g.copy_(torch.randn(g.shape, generator=gen).mul_(1e-3))

    def _measure(self, buckets, world_size: int, device: torch.device) -> tuple[list[float], list[list[Round]]]:
        """Every candidate's fastest timed run and the collectives it issued. Candidates take turns run by
        run, so a burst of load on a shared machine slows one run of each rather than all runs of one."""
        engines = [self._make_engine(c) for c in self.candidates]
        gen = torch.Generator().manual_seed(0)
        best = [math.inf] * len(engines)
        rounds: list[list[Round]] = [[] for _ in engines]
        for run in range(self.repeats + 1):
            for i, engine in enumerate(engines):
                self._fill(buckets, gen)
                comm = ReplicaCommunicator(world_size, device)
                _sync(device)
                t0 = time.perf_counter()
                for grads, keys in buckets:
                    _run_bucket(engine, grads, keys, comm)
                _sync(device)
                dt = time.perf_counter() - t0
                if run:  # the first run builds the states and warms the caches
                    best[i] = min(best[i], dt)
                rounds[i] = comm.rounds
        return best, rounds

    def decide(self, comm: Communicator) -> AutoDecision:
        """Measure and choose (a collective call: every rank of ``comm`` must call it at the same point)."""
        t_start = time.perf_counter()
        ws = comm.world_size
        link = self.link
        if link is None:
            link = probe(comm, large_bytes=4 << 20, repeats=3) if ws > 1 else Link(latency=0.0, bandwidth=1e12)
        self._computes, self._rounds = self._measured(comm)
        self.decision = self._choose(comm, link, t_start)
        return self.decision

    def replan(self, comm: Communicator, *, probe_bytes: int = 1 << 20, remeasure: bool = False,
               keep: str | None = None, margin: float = 0.0) -> AutoDecision:  # fmt: skip
        """Choose again (a collective call, as :meth:`decide`): the link probed anew, every candidate priced on
        it with the compute measured at the decision, or measured again (``remeasure``, or where the decision
        came from a checkpoint). ``keep``: a candidate that stays chosen unless another is predicted cheaper by more
        than ``margin`` (a fraction). Used by :mod:`.auto_follow` when the link or the compression cost moved."""
        t_start = time.perf_counter()
        ws = comm.world_size
        if ws > 1:
            link = probe(comm, small_bytes=8, large_bytes=probe_bytes, repeats=3)
        else:
            link = self.decision.link if self.decision is not None else Link(latency=0.0, bandwidth=1e12)
        if remeasure or self._computes is None:
            self._computes, self._rounds = self._measured(comm)
        self.decision = self._choose(comm, link, t_start, keep, margin)
        return self.decision

    def choice_at(self, bandwidth: float) -> str | None:
        """The candidate the measured costs make cheapest on a link of ``bandwidth`` bytes/s (the decision's
        latency); None before a decision with measurements. The same arithmetic on every rank."""
        d = self.decision
        if d is None or self._computes is None:
            return None
        bw = min(bandwidth, 1e18)
        costs = price([_label(c) for c in self.candidates], self._computes, self._rounds, d.world_size,
                      Link(latency=d.link.latency, bandwidth=bw))  # fmt: skip
        return costs[min(range(len(costs)), key=lambda i: (costs[i].total_s, i))].name

    def _measured(self, comm: Communicator) -> tuple[list[float], list[list[Round]]]:
        """Every candidate's compute on this job's buckets (the slowest rank's) and the collectives it issues."""
        computes, rounds_of = self._measure(self._buckets(), comm.world_size, comm.device)
        vec = torch.tensor(computes, dtype=torch.float64, device=comm.device)
        if comm.world_size > 1:
            comm.all_reduce(vec, "max")  # the slowest rank sets the pace
        return vec.tolist(), rounds_of

    def _choose(self, comm: Communicator, link: Link, t_start: float, keep: str | None = None,
                margin: float = 0.0) -> AutoDecision:  # fmt: skip
        ws = comm.world_size
        device = comm.device
        costs = price([_label(c) for c in self.candidates], self._computes, self._rounds, ws, link)
        order = sorted(range(len(costs)), key=lambda i: (costs[i].total_s, i))
        best = order[0]
        kept = next((i for i, c in enumerate(costs) if c.name == keep), None)
        if kept is not None and costs[kept].total_s <= costs[best].total_s * (1 + margin):
            best = kept
        pick = torch.tensor([best], dtype=torch.int64, device=device)
        if ws > 1:
            comm.broadcast(pick, 0)  # rank 0 decides; every rank takes its choice
        i = int(pick.item())
        shapes = self._last or self._current
        return AutoDecision(
            choice=costs[i].name,
            compressor=self.candidates[i],
            link=link,
            world_size=ws,
            buckets=len(shapes),
            gradient_bytes=sum(
                math.prod(s) * torch.empty((), dtype=d).element_size()
                for b in shapes
                for s, d in zip(b.shapes, b.dtypes)
            ),
            candidates=[costs[i]] + [costs[j] for j in order if j != i],
            measure_s=time.perf_counter() - t_start,
        )
