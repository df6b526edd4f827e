"""Alerts over the live records (:data:`torsh_kernels.live.FIELDS`): what ``torsh top`` prints and the live metrics
expose.

Kinds, with their thresholds in :class:`AlertSpec` (defaults; ``torsh top`` takes each as a flag):

- ``straggler`` (across ranks: :class:`JobAlerts`): a rank whose ``compute_s`` (its step minus the seconds it was
  blocked on, or compressing for, communication; ``step_s`` where that is not known) exceeds the median of the
  job's ranks at the same step by more than ``straggler`` (25%) for ``straggler_steps`` (5) steps in a row. In a
  synchronous job every rank's step takes as long as the slowest's: the others wait in their collectives, so it
  is the time outside communication that tells the slow rank.
- ``link_drop``: a rank's measured link rate (``link_Bps``) below ``1 - link_drop`` (50%) of its running level
  (the median of up to 50 earlier steps' rates, taken before the drop, under the same compressor: another
  payload shows the link differently, so a switch starts a new level) for ``link_steps`` (5) steps in a row.
  A rank's rate counts the seconds its collectives waited for a slower peer, so on one rank (the publisher's,
  Prometheus') a straggling peer looks like a slower link; across ranks (``torsh top``) the link is judged on
  the highest rate any rank measured at each step, which a straggler does not lower.
- ``nonfinite``: a step that held NaN/Inf (``nonfinite``; the step was skipped).
- ``compression_error``: the relative compression error (``error``: the error-feedback residual's norm over the
  gradient's) above ``error_bound`` (100), at the steps that measure it. The ratio grows as training converges
  and the gradient shrinks while the residual keeps what the compressor leaves out: PowerSGD rank 4 on
  ``torsh demo``'s model ranged 1.5-35 over 200 steps, so the default flags a residual running away, not
  compression working as designed; set it from your own job's records.
- ``auto_switch``: ``compressor="auto"`` switched compressor at this step (``switch``); informational.

:class:`RankAlerts` evaluates one rank's records as they come (the publisher, per rank and source: its alerts go
into each record and into Prometheus' ``torsh_alert``); :class:`JobAlerts` evaluates everything read from all
ranks (``torsh top``): the per-rank kinds through a :class:`RankAlerts` per rank and source, the straggler across
ranks.
"""

from __future__ import annotations

import bisect
import dataclasses
import statistics
from collections import deque
from collections.abc import Iterable

from ..checks import check_bool, check_int, check_number
from ..specs import Spec

__all__ = ["KINDS", "AlertSpec", "JobAlerts", "RankAlerts"]

KINDS = ("straggler", "link_drop", "nonfinite", "compression_error", "auto_switch")
_LEVEL_WINDOW = 50
_MAX_LAG = 64
"""Steps a rank may fall behind the newest before its missing steps stop holding up the cross-rank judging."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class AlertSpec(Spec):
    """The alerts' thresholds (see the module docstring)."""

    straggler: float = 0.25
    """A rank's compute time above the median of the ranks' by more than this fraction..."""
    straggler_steps: int = 5
    """... for this many steps in a row: a straggler."""
    link_drop: float = 0.5
    """A link rate below (1 - this) of its running level..."""
    link_steps: int = 5
    """... for this many steps in a row: a link drop."""
    error_bound: float = 100.0
    """A relative compression error above this."""
    nonfinite: bool = True
    """Alert on steps that held NaN/Inf."""

    def __post_init__(self) -> None:
        w = "AlertSpec"
        self.normalize("straggler", check_number(self.straggler, w, "straggler", lo=0.0, lo_open=True))
        self.normalize("straggler_steps", check_int(self.straggler_steps, w, "straggler_steps", 1))
        self.normalize("link_drop", check_number(self.link_drop, w, "link_drop", lo=0.0, hi=1.0, lo_open=True,
                                                 hi_open=True))  # fmt: skip
        self.normalize("link_steps", check_int(self.link_steps, w, "link_steps", 1))
        self.normalize("error_bound", check_number(self.error_bound, w, "error_bound", lo=0.0, lo_open=True))
        self.normalize("nonfinite", check_bool(self.nonfinite, w, "nonfinite"))


def _alert(kind: str, rec: dict, message: str) -> dict:
    return {"kind": kind, "rank": rec.get("rank"), "step": rec.get("step"), "source": rec.get("source"),
            "message": message}  # fmt: skip


class RankAlerts:
    """One rank's (and source's) alerts, evaluated record by record in step order (O(log n) per record)."""

    __slots__ = ("_active", "_below", "_below_n", "_comp", "_level", "_sorted", "spec")

    def __init__(self, spec: AlertSpec | None = None) -> None:
        self.spec = spec if spec is not None else AlertSpec()
        self._level: deque[float] = deque()  # the earlier rates (not those of a drop in progress)
        self._sorted: list[float] = []  # ... sorted, for the median
        self._below: deque[float] = deque(maxlen=self.spec.link_steps)  # the last rates of a drop in progress
        self._below_n = 0  # ... and its length
        self._active: dict[str, bool] = dict.fromkeys(KINDS[1:], False)
        self._comp: object = None  # the compressor of the rates in the level

    def active(self) -> dict[str, bool]:
        """Each per-rank kind: active at the last record."""
        return dict(self._active)

    def _add_level(self, rate: float) -> None:
        self._level.append(rate)
        bisect.insort(self._sorted, rate)
        if len(self._level) > _LEVEL_WINDOW:
            old = self._level.popleft()
            del self._sorted[bisect.bisect_left(self._sorted, old)]

    def _median(self) -> float | None:
        s = self._sorted
        if not s:
            return None
        n = len(s)
        return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2

    def update(self, rec: dict) -> list[dict]:
        """The alerts active at this record (``{"kind", "rank", "step", "source", "message"}``)."""
        sp, out = self.spec, []
        nf = bool(rec.get("nonfinite")) and sp.nonfinite
        self._active["nonfinite"] = nf
        if nf:
            out.append(_alert("nonfinite", rec, f"rank {rec.get('rank')} step {rec.get('step')}: NaN/Inf in the "
                              "gradients; the step was skipped"))  # fmt: skip
        err = rec.get("error")  # (measured every few steps: an alert at the steps that measured it)
        high = err is not None and err > sp.error_bound
        self._active["compression_error"] = high
        if high:
            out.append(_alert("compression_error", rec, f"rank {rec.get('rank')}: compression error {err:.3g} > "
                              f"{sp.error_bound:g} (error-feedback residual norm over gradient norm)"))  # fmt: skip
        sw = rec.get("switch")
        self._active["auto_switch"] = bool(sw)
        if sw:
            out.append(_alert("auto_switch", rec, f"auto switched {sw.get('from')} -> {sw.get('to')}: "
                              f"{sw.get('reason', '')}"))  # fmt: skip
        rate = rec.get("link_Bps")
        if rec.get("compressor") != self._comp:  # another payload shows the link differently: a new level
            self._comp = rec.get("compressor")
            self._level.clear()
            self._sorted.clear()
            self._below.clear()
            self._below_n = 0
        if rate is not None and rate > 0:
            level = self._median()
            if level is not None and len(self._level) >= sp.link_steps and rate < (1 - sp.link_drop) * level:
                self._below.append(rate)
                self._below_n += 1
            else:
                if self._below_n < sp.link_steps:  # a dip too short to be a drop: part of the level after all
                    for r in self._below:
                        self._add_level(r)
                self._below.clear()
                self._below_n = 0
                self._add_level(rate)
            drop = self._below_n >= sp.link_steps
            self._active["link_drop"] = drop
            if drop:
                now = statistics.median(self._below)
                msg = (f"rank {rec.get('rank')}: link {now * 8 / 1e9:.3g} Gbit/s for {self._below_n} steps, "
                       f"against a level of {level * 8 / 1e9:.3g} Gbit/s")  # fmt: skip
                out.append(_alert("link_drop", rec, msg))
        return out


class JobAlerts:
    """Alerts over every rank's records (``torsh top``): per-rank kinds through :class:`RankAlerts`, the straggler
    across ranks. Records may come in any order; each rank's are evaluated in step order as they complete."""

    def __init__(self, spec: AlertSpec | None = None) -> None:
        self.spec = spec if spec is not None else AlertSpec()
        self._ranks: dict[tuple, RankAlerts] = {}
        self._last: dict[tuple, dict] = {}  # (job, rank, source) -> the last record evaluated
        self._current: dict[tuple, list[dict]] = {}  # ... -> its alerts now
        self._steps: dict[tuple, dict[int, dict[int, float]]] = {}  # (job, source) -> step -> rank -> compute
        self._slow: dict[tuple, int] = {}  # (job, source, rank) -> steps in a row above the median
        self._strag: dict[tuple, dict] = {}  # (job, source, rank) -> its active straggler alert
        self._done: dict[tuple, int] = {}  # (job, source) -> the last step judged
        self._reported: dict[tuple, dict] = {}  # (job, source) -> rank -> the last step (or round) it reported
        self._world: dict[tuple, int] = {}  # (job, source) -> its world size
        self._links: dict[tuple, RankAlerts] = {}  # (job, source) -> the link judged on the per-step maximum rate
        self._history: list[dict] = []
        self._was: dict[tuple, bool] = {}  # (job, rank, source, kind) -> active at the rank's last record

    def update(self, records: Iterable[dict]) -> None:
        """Evaluate ``records`` (any ranks, any order; one already evaluated is skipped). A rank's record at a lower
        step than its last, written later, is a restarted job (into the same directory): that rank and its job's
        cross-rank judging start afresh. A record with ``_round`` (``torsh top`` sets it on what one refresh
        scraped from Prometheus endpoints, which catch the ranks at different steps) is compared across ranks by
        that round instead of its step."""
        by_key: dict[tuple, list[dict]] = {}
        for r in records:
            by_key.setdefault((r.get("job"), r.get("rank"), r.get("source")), []).append(r)
        for key, recs in by_key.items():
            recs.sort(key=lambda x: (x.get("time") or 0, x.get("step", 0)))
            js = (key[0], key[2])
            last = self._last.get(key)
            for r in recs:
                if last is not None and r.get("step", 0) <= last.get("step", 0):
                    if r.get("step", 0) < last.get("step", 0) and (r.get("time") or 0) > (last.get("time") or 0):
                        self._restart(key)  # a new run of the job
                        last = None
                    else:
                        continue  # already evaluated
                ra = self._ranks.setdefault(key, RankAlerts(self.spec))
                al = ra.update(r)
                al = [a for a in al if a["kind"] != "link_drop"]  # judged across ranks (see _judge)
                self._current[key] = al
                self._remember(key, al)
                last = r
                c = r.get("compute_s")
                c = r.get("step_s") if c is None else c
                at = r.get("_round", r["step"])
                self._steps.setdefault(js, {}).setdefault(at, {})[key[1]] = (c, r.get("link_Bps"), r["step"],
                                                                             r.get("compressor"))  # fmt: skip
                self._reported.setdefault(js, {})[key[1]] = at
                self._world[js] = max(self._world.get(js, 1), r.get("world_size") or 1)
            if last is not None:
                self._last[key] = last
        for js in list(self._steps):
            self._judge(js)

    def _restart(self, key: tuple) -> None:
        js = (key[0], key[2])
        for k in [k for k in self._ranks if (k[0], k[2]) == js]:
            self._ranks.pop(k, None)
            self._last.pop(k, None)
            self._current.pop(k, None)
        for k in [k for k in self._strag if k[:2] == js]:
            del self._strag[k]
        for k in [k for k in self._slow if k[:2] == js]:
            del self._slow[k]
        self._steps.pop(js, None)
        self._reported.pop(js, None)
        self._done.pop(js, None)
        self._links.pop(js, None)

    def _remember(self, key: tuple, alerts: list[dict]) -> None:
        """History: an alert when its kind becomes active on that rank (once per episode)."""
        now = {a["kind"]: a for a in alerts}
        for kind in KINDS[1:]:
            k = (*key, kind)
            if kind in now and not self._was.get(k):
                self._history.append(now[kind])
            self._was[k] = kind in now

    def _judge(self, js: tuple) -> None:
        """Judge every step that all the job's ranks (of this source) have reported, in order: the stragglers,
        and the link. A rank's link rate counts the seconds its collectives waited for slower peers, so a
        straggler lowers every other rank's; the link has dropped only when even the highest rate any rank
        measured at that step is down (a job-level :class:`RankAlerts` over the per-step maximum)."""
        steps = self._steps[js]
        reported = dict.fromkeys(range(self._world.get(js, 1)), -1)  # every rank of the job, seen or not yet ...
        reported.update(self._reported.get(js, {}))  # ... -> the last step (or round) it reported
        newest = max(reported.values(), default=-1)
        sp = self.spec
        for s in sorted(x for x in steps if x > self._done.get(js, -1)):
            got = steps[s]
            # judged once every rank of the job has reported this step or a later one (a step a rank skipped, or a
            # file rotated away, never holds the others up), or once some rank is far past it (a rank that stopped,
            # or one never seen: a node-local endpoint)
            if not all(r in got or last > s for r, last in reported.items()) and newest - s < _MAX_LAG:
                break
            self._done[js] = s
            del steps[s]
            rates = [(v[1], rank, v[2], v[3]) for rank, v in got.items() if v[1]]
            if rates:
                best, who, real, comp = max(rates, key=lambda x: x[0])
                link = self._links.setdefault(js, RankAlerts(self.spec))
                al = link.update({"rank": who, "step": real, "source": js[1], "link_Bps": best, "compressor": comp})
                key = (js[0], "job", js[1])
                self._current[key] = al
                self._remember(key, al)
            comp = {rank: v[0] for rank, v in got.items() if v[0] is not None}
            real = {rank: v[2] for rank, v in got.items()}
            if len(comp) < 2:
                continue
            med = statistics.median(comp.values())
            for rank, c in comp.items():
                k = (*js, rank)
                if med > 0 and c > (1 + sp.straggler) * med:
                    self._slow[k] = self._slow.get(k, 0) + 1
                else:
                    self._slow[k] = 0
                    self._strag.pop(k, None)
                if self._slow[k] >= sp.straggler_steps:
                    msg = (f"rank {rank}: {c * 1e3:.1f} ms of compute at step {real[rank]}, {c / med:.2f}x the ranks' "
                           f"median ({med * 1e3:.1f} ms), {self._slow[k]} steps in a row")  # fmt: skip
                    a = {"kind": "straggler", "rank": rank, "step": real[rank], "source": js[1], "message": msg}
                    if k not in self._strag:
                        self._history.append(a)
                    self._strag[k] = a

    def alerts(self) -> list[dict]:
        """Every alert active now: each rank's at its last record, and the stragglers."""
        out = [a for al in self._current.values() for a in al]
        return out + list(self._strag.values())

    def history(self) -> list[dict]:
        """Every alert raised so far, once per episode, with the step it was first raised at."""
        return list(self._history)
