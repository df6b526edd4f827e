"""``compressor="auto"`` that follows the link: :class:`FollowSpec` (when to look again) and :class:`LinkFollower`
(the measurements and the decision to re-plan, the same on every rank).

``auto`` chooses once, at the end of its warm-up, from a probed link and each candidate's measured cost
(:mod:`.auto`). A running job's link changes (a shared network, a congested switch), so afterwards the
engine keeps measuring, and re-plans when the link or the compression cost has moved:

1. **Each step** the DDP hook (or the synchronizer) hands the follower the bytes its communicator put on the
   wire, the seconds a collective was in flight (:class:`~torsh_kernels.collectives.Traffic`, timed) and the
   seconds spent compressing.
2. **Every** ``every`` **steps** (a check), every rank all-reduces two numbers: the window's link rate (wire
   bytes over in-flight seconds) and its compression seconds per step, each the largest any rank measured (a
   rank's in-flight seconds include waiting for slower peers, so the rank that waited least sees the link
   best; the slowest rank's compression time is the one that paces the step). From here on every rank holds the same values and runs the same arithmetic, so every rank
   reaches the same verdict at the same step: nothing is decided per rank.
3. **The level.** The first check after a plan (after one window for the new compressor to settle) sets
   the level of both. A later check whose rate (or compression time) differs from its level by more than
   the factor ``change``, up or down, counts; ``patience`` such checks in a row trigger a re-plan (an
   ordinary check resets the count).
4. **The re-plan** (a collective, at the same step on every rank): the link is probed again (ping-pong,
   ``probe_bytes``), and every candidate is priced on it with the compute measured at the decision (or
   measured again, when the compression time moved); rank 0's pick is broadcast. A different pick switches
   the compressor on every rank before the next step; each error-feedback residual is handed over to the new
   compressor (added to the parameter's next gradient, so no gradient mass is lost, whatever the new
   compressor keeps), PowerSGD's Q and the other state start afresh.

The check's all-reduce is 16 bytes every ``every`` steps; the probe and the pricing run only on a re-plan
(the probe takes ``3 x 2 x probe_bytes`` on the wire: 0.5 s at 100 Mbit/s with the default).
"""

from __future__ import annotations

import dataclasses

import torch

from ..checks import check_int, check_number
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

    def __post_init__(self) -> None:
        w = "FollowSpec"
        self.normalize("every", check_int(self.every, w, "every", 1))
        self.normalize("change", check_number(self.change, w, "change", lo=1.0, lo_open=True))
        self.normalize("patience", check_int(self.patience, w, "patience", 1))
        self.normalize("probe_bytes", check_int(self.probe_bytes, w, "probe_bytes", 1024, 1 << 30))
        self.normalize("min_compress_s", check_number(self.min_compress_s, w, "min_compress_s", lo=0.0))


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

    __slots__ = ("_busy", "_comp", "_count", "_level", "_settle", "_steps", "_wire", "checks", "last", "spec")

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

    def observe(self, wire_bytes: int, busy_s: float, compress_s: float) -> bool:
        """One step's figures; returns whether a check is due (every rank alike: it counts steps only)."""
        self._steps += 1
        self._wire += wire_bytes
        self._busy += busy_s
        self._comp += compress_s
        return self._steps >= self.spec.every

    def check(self, comm) -> str | None:
        """The check (a collective: every rank calls it at the same step). Returns ``"link"`` or ``"compute"``
        when a re-plan is due, else None."""
        rate = self._wire / self._busy if self._busy > 0 and self._wire > 0 else 0.0
        comp = self._comp / max(1, self._steps)
        vec = torch.tensor([rate, comp], dtype=torch.float64, device=comm.device)
        if comm.world_size > 1:
            comm.all_reduce(vec, "max")  # the highest rate a rank measured, the slowest rank's compression time
        rate, comp = float(vec[0]), float(vec[1])
        self._steps, self._wire, self._busy, self._comp = 0, 0, 0.0, 0.0
        self.checks += 1
        verdict = None
        if self._settle:
            self._settle -= 1
        elif self._level is None:
            self._level = (rate, comp)
        else:
            verdict = self._moved(rate, comp)
        lvl = self._level
        self.last = {"rate_Bps": rate, "compress_s": comp, "rate_level_Bps": lvl[0] if lvl else None,
                     "compress_level_s": lvl[1] if lvl else None, "count": self._count, "verdict": verdict}  # fmt: skip
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
    why = f.check(comm)
    if why is None:
        return None
    old = engine.auto.decision
    seen = f.last
    d = engine.auto.replan(comm, probe_bytes=f.spec.probe_bytes, remeasure=why == "compute")
    f.planned()
    gbit = d.link.bandwidth * 8 / 1e9
    if why == "link":
        what = (f"link rate {seen['rate_Bps'] * 8 / 1e9:.3g} Gbit/s against a level of "
                f"{seen['rate_level_Bps'] * 8 / 1e9:.3g}")  # fmt: skip
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
