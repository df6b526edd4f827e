"""``compressor="auto"`` that follows the link: :class:`FollowSpec` (when to look again) and :class:`LinkFollower`
(the measurements and the decision to re-plan, the same on every rank).

``auto`` chooses once, at the end of its warm-up, from a probed link and each candidate's measured cost
(:mod:`.auto`). A running job's link changes (a shared network, a congested switch), so afterwards the
engine keeps measuring, and re-plans when the link or the compression cost has moved:

1. **Each step** the DDP hook (or the synchronizer) hands the follower the bytes its communicator put on the
   wire, the seconds a collective was in flight (:class:`~torsh_kernels.collectives.Traffic`, timed) and the
   seconds spent compressing.
2. **Every** ``every`` **steps** (a check), every rank all-reduces three numbers: the window's link rate (wire
   bytes over in-flight seconds), its compression seconds per step and an exploration's bandwidth (below),
   each the largest any rank measured. A rank's in-flight seconds include waiting for slower peers, so the
   rank that waited least sees the link best; the slowest rank's compression paces the step. From here on
   every rank holds the same values and runs the same arithmetic, so every rank reaches the same verdict at
   the same step: nothing is decided per rank.
3. **The level.** The first check after a plan (after one window for the new compressor to settle) sets
   the level of both. A later check whose rate (or compression time) differs from its level by more than
   the factor ``change``, up or down, counts; ``patience`` such checks in a row trigger a re-plan (an
   ordinary check resets the count).
4. **Exploring.** What a compressed payload shows of the link is mostly latency: a few kilobytes per step
   cannot tell 100 Mbit/s from 10 Gbit/s, so a link that got faster under a compressor that no longer pays
   would go unseen. While the choice is one that some faster link would change (priced with the measured
   costs: arithmetic, the same on every rank), every ``explore_every`` steps a check first times one
   all-reduce of ``explore_bytes``; if the bandwidth that explains its time under the cost model (the largest
   any rank measured) exceeds ``change`` times the one the choice was priced on, a re-plan follows at once. (A
   small all-reduce's fixed overheads make it read low on a fast link, so it tells "much faster than
   planned", which is what it is for, and the re-plan's probe measures how fast.) Its cost is that
   all-reduce: ``explore_bytes`` at the slow link's rate (21 ms at 100 Mbit/s with the default 256 KiB, every
   8 steps), nothing while the choice is uncompressed or on a link no faster one would change.
5. **The re-plan** (a collective, at the same step on every rank): the link is probed again (ping-pong,
   ``probe_bytes``), and every candidate is priced on it with the compute measured at the decision (or
   measured again, when the compression time moved); rank 0's pick is broadcast, the current choice kept unless
   another is predicted cheaper by more than ``margin``. A different pick switches
   the compressor on every rank before the next step; each error-feedback residual is handed over to the new
   compressor (added to the parameter's next gradient, so no gradient mass is lost, whatever the new
   compressor keeps), PowerSGD's Q and the other state start afresh. A re-plan that keeps the choice
   changes nothing but the levels.

The check's all-reduce is 24 bytes every ``every`` steps; the probe and the pricing run only on a re-plan
(the probe moves ``3 x 2 x probe_bytes``: 0.5 s at 100 Mbit/s with the default 1 MiB).
"""

from __future__ import annotations

import dataclasses
import math
import time

import torch

from ..checks import check_int, check_number
from ..collectives.cost_model import Link, Topology, all_reduce_time
from ..specs import Spec

__all__ = ["FollowSpec", "LinkFollower", "follow_spec"]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class FollowSpec(Spec):
    """When ``compressor="auto"`` looks at its choice again (see the module docstring)."""

    every: int = 4
    """Steps per check (one all-reduce of two numbers)."""
    change: float = 2.0
    """A check counts when the window's link rate, or compression seconds per step, differs from its level by
    more than this factor (either way)."""
    patience: int = 2
    """Checks in a row that must count before a re-plan."""
    probe_bytes: int = 1 << 20
    """The re-plan's ping-pong message size."""
    min_compress_s: float = 1e-3
    """Compression seconds per step below which changes of it are ignored (noise)."""
    explore_every: int = 8
    """While the choice is one a faster link would change: steps between explorations (0: never explore)."""
    explore_bytes: int = 256 << 10
    """An exploration's all-reduce size."""
    margin: float = 0.1
    """A re-plan keeps the current choice unless another is predicted cheaper by more than this fraction (no
    flapping between candidates that cost about the same)."""

    def __post_init__(self) -> None:
        w = "FollowSpec"
        self.normalize("every", check_int(self.every, w, "every", 1))
        self.normalize("change", check_number(self.change, w, "change", lo=1.0, lo_open=True))
        self.normalize("patience", check_int(self.patience, w, "patience", 1))
        self.normalize("probe_bytes", check_int(self.probe_bytes, w, "probe_bytes", 1024, 1 << 30))
        self.normalize("min_compress_s", check_number(self.min_compress_s, w, "min_compress_s", lo=0.0))
        self.normalize("explore_every", check_int(self.explore_every, w, "explore_every", 0))
        self.normalize("explore_bytes", check_int(self.explore_bytes, w, "explore_bytes", 1024, 1 << 30))
        self.normalize("margin", check_number(self.margin, w, "margin", lo=0.0))


def follow_spec(value: object, what: str) -> FollowSpec | None:
    """``auto_follow=`` as given: None or True (the defaults), False (auto decides once), or a FollowSpec."""
    from ..errors import ArgumentTypeError

    if value is None or value is True:
        return FollowSpec()
    if value is False:
        return None
    if isinstance(value, FollowSpec):
        return value
    raise ArgumentTypeError(
        f"{what}: auto_follow must be a FollowSpec, True, False or None, got {type(value).__name__}"
    )


class LinkFollower:
    """The measurements between checks and the verdicts (see the module docstring). One per engine."""

    __slots__ = ("_busy", "_comp", "_count", "_explored", "_level", "_settle", "_steps", "_wire", "checks", "last",
                 "spec")  # fmt: skip

    def __init__(self, spec: FollowSpec) -> None:
        self.spec = spec
        self.checks = 0
        """Checks made."""
        self.last: dict | None = None
        """The last check's agreed values (``rate_Bps``, ``compress_s``, their levels, the verdict)."""
        self.planned()

    def planned(self) -> None:
        """A (re-)plan happened: the next window settles, the one after sets the level."""
        self._steps, self._wire, self._busy, self._comp = 0, 0, 0.0, 0.0
        self._level: tuple[float, float] | None = None
        self._settle = 1
        self._count = 0
        self._explored = 0  # steps since the last exploration

    def observe(self, wire_bytes: int, busy_s: float, compress_s: float) -> bool:
        """One step's figures; returns whether a check is due (every rank alike: it counts steps only)."""
        self._steps += 1
        self._explored += 1
        self._wire += wire_bytes
        self._busy += busy_s
        self._comp += compress_s
        return self._steps >= self.spec.every

    def explore_due(self) -> bool:
        """Whether this check explores (every ``explore_every`` steps; the same on every rank)."""
        e = self.spec.explore_every
        if e and self._explored >= e and self._level is not None:
            self._explored = 0
            return True
        return False

    def check(self, comm, explored_Bps: float = 0.0, planned_Bps: float = math.inf) -> str | None:
        """The check (a collective: every rank calls it at the same step). Returns ``"link"``, ``"explore"`` or
        ``"compute"`` when a re-plan is due, else None. ``explored_Bps``: this step's exploration's bandwidth
        (0: none), against ``planned_Bps``, the bandwidth the current choice was priced on."""
        rate = self._wire / self._busy if self._busy > 0 and self._wire > 0 else 0.0
        comp = self._comp / max(1, self._steps)
        vec = torch.tensor([rate, comp, explored_Bps], dtype=torch.float64, device=comm.device)
        if comm.world_size > 1:
            comm.all_reduce(vec, "max")  # the highest rates any rank measured, the slowest rank's compression time
        rate, comp, explored = float(vec[0]), float(vec[1]), float(vec[2])
        self._steps, self._wire, self._busy, self._comp = 0, 0, 0.0, 0.0
        self.checks += 1
        verdict = None
        if self._settle:
            self._settle -= 1
        elif self._level is None:
            self._level = (rate, comp)
        else:
            verdict = self._moved(rate, comp)
        if verdict is None and explored > self.spec.change * planned_Bps:
            verdict = "explore"  # a direct measurement: no patience needed (a wrong one costs a re-plan, no switch)
        lvl = self._level
        self.last = {"rate_Bps": rate, "compress_s": comp, "rate_level_Bps": lvl[0] if lvl else None,
                     "compress_level_s": lvl[1] if lvl else None, "count": self._count, "verdict": verdict,
                     "explored_Bps": explored or None, "planned_Bps": planned_Bps}  # fmt: skip
        return verdict

    def _moved(self, rate: float, comp: float) -> str | None:
        c = self.spec.change
        r0, c0 = self._level
        link = rate > 0 and r0 > 0 and not (r0 / c <= rate <= r0 * c)
        floor = self.spec.min_compress_s
        compute = max(comp, c0) >= floor and not (c0 / c <= comp <= c0 * c) if c0 > 0 else comp >= floor
        if not (link or compute):
            self._count = 0
            return None
        self._count += 1
        if self._count < self.spec.patience:
            return None
        return "link" if link else "compute"

    def __repr__(self) -> str:
        lv = self._level
        lvl = "unset" if lv is None else f"{lv[0] * 8 / 1e9:.3g} Gbit/s, {lv[1] * 1e3:.3g} ms"
        return f"LinkFollower({self.spec!r}, level {lvl}, checks={self.checks})"


# -- the engine's side: a step's figures in, a switch out -------------------------------------------------


def follow_step(engine, comm, wire_bytes: int, busy_s: float, compress_s: float) -> dict | None:
    """After an iteration of ``engine`` (a ``BucketCompressor`` with ``compressor="auto"`` and a follower): count
    the step, check every ``every`` steps and re-plan when due (collectives, the same on every rank). Returns
    the switch (``{"step", "from", "to", "reason", "link_Bps", "measure_s"}``) when the compressor changed."""
    f = engine.follow
    if f is None or engine.auto is None or engine.auto.decision is None:
        return None
    if not f.observe(wire_bytes, busy_s, compress_s):
        return None
    auto = engine.auto
    explored = 0.0
    if f.explore_due() and auto.choice_at(math.inf) != auto.decision.choice:  # a faster link would change it
        explored = explore(comm, f.spec.explore_bytes, auto.decision.link)
    why = f.check(comm, explored, auto.decision.link.bandwidth)
    if why is None:
        return None
    old = engine.auto.decision
    seen = f.last
    d = engine.auto.replan(comm, probe_bytes=f.spec.probe_bytes, remeasure=why == "compute", keep=old.choice,
                           margin=f.spec.margin)  # fmt: skip
    f.planned()
    gbit = d.link.bandwidth * 8 / 1e9
    if why == "link":
        what = (f"link rate {seen['rate_Bps'] * 8 / 1e9:.3g} Gbit/s against a level of "
                f"{seen['rate_level_Bps'] * 8 / 1e9:.3g}")  # fmt: skip
    elif why == "explore":
        what = (f"an exploration measured {seen['explored_Bps'] * 8 / 1e9:.3g} Gbit/s against the "
                f"{seen['planned_Bps'] * 8 / 1e9:.3g} Gbit/s {old.choice} was priced on")  # fmt: skip
    else:
        what = (f"compression {seen['compress_s'] * 1e3:.3g} ms/step against a level of "
                f"{seen['compress_level_s'] * 1e3:.3g}")  # fmt: skip
    event = {"step": engine.iteration, "from": old.choice, "to": d.choice, "link_Bps": d.link.bandwidth,
             "measure_s": d.measure_s,
             "reason": f"{what}; probed {gbit:.3g} Gbit/s: {d.reason}"}  # fmt: skip
    engine.replans.append(event)
    if d.choice == old.choice:
        return None
    engine._apply_auto(d.compressor)  # (set_compressor hands the residuals over)
    return event


def explore(comm, nbytes: int, link: Link) -> float:
    """One all-reduce of ``nbytes``, timed: the bandwidth (bytes/s) that explains its time on ``link``'s latency
    under the cost model (``inf`` when faster than the latency alone)."""
    buf = torch.zeros(max(1, nbytes // 4), dtype=torch.float32, device=comm.device)
    topo = Topology(world_size=comm.world_size)
    if comm.device.type == "cuda":
        torch.cuda.synchronize(comm.device)
    t0 = time.perf_counter()
    comm.all_reduce(buf)
    if comm.device.type == "cuda":
        torch.cuda.synchronize(comm.device)
    t = time.perf_counter() - t0
    fixed = all_reduce_time(buf.nbytes, topo, Link(latency=link.latency, bandwidth=1e30), "ring")
    per_byte = all_reduce_time(buf.nbytes, topo, Link(latency=link.latency, bandwidth=1.0), "ring") - fixed
    return per_byte / (t - fixed) if t > fixed else math.inf


def hand_over(engine) -> None:
    """Before a switch: each parameter's error-feedback residual (the gradient mass its compressor has not sent
    yet), kept per parameter until that parameter's next gradient takes it (:func:`take_handover`)."""
    for key, st in engine.states.items():
        r = st.tensors.get("residual")
        if r is None:
            continue
        off = 0
        for k in key:
            n = engine._numel(k)
            piece = r[off : off + n]
            off += n
            prev = engine.handover.get(k)
            engine.handover[k] = piece.clone() if prev is None else prev + piece


def take_handover(engine, grads, keys):
    """Add the handed-over residual of each of ``keys`` to its gradient (in place), once; returns the gradients
    (fetched if ``grads`` is the bucket's method). The mass then travels with whatever compressor runs now:
    sent as it is uncompressed or cast, or in the new error feedback's loop."""
    hand = engine.handover
    if not any(k in hand for k in keys):
        return grads
    if callable(grads):
        grads = grads()
    grads = list(grads)
    for g, k in zip(grads, keys):
        r = hand.get(k)
        if r is not None and k not in engine.taken:
            g.add_(r.view(g.shape).to(g.dtype))
            engine.taken.add(k)
    return grads
