"""What the viewer and the report compute from a :class:`~torsh_kernels.profiling.traces.Trace`: per-rank
time breakdowns, communication share and overlap, top spans by name, stragglers.

The breakdown of one rank over a set of windows (its steps, or a ``--window``):

1. On each thread and GPU-stream lane, every instant belongs to the *innermost* span open there (spans
   on a lane nest), so a ``wait`` inside ``backward`` counts as waiting, not computing. Step markers are
   windows, not work. Communication spans count whole, with what they nest (issuing a collective
   includes flattening its buffer), and so do in-flight lanes (torsh's ``comm N``).
2. A rank whose trace has GPU lanes is measured on its GPU lanes (and in-flight collectives) only, as
   Holistic Trace Analysis does: host threads then only launch work (``measured_on`` "device"; else
   "host").
3. Per class, the union of those segments; then exclusively, in this order: ``compute``, ``compression``
   (not under compute), ``memory``, ``communication`` (in flight while nothing above runs: *exposed*),
   ``unrecorded`` (the rest: time no span covers). The five add up to the window. Unrecorded is not
   idle: on a host-measured rank it is whatever ran without a span (Python between recorded calls, a
   forward or backward nobody recorded, data loading, or truly nothing); on a device-measured rank it is
   time when no kernel, copy or collective ran on the GPU, which is GPU idle time.
4. ``comm share`` = time with any collective in flight / window; ``overlap`` = the part of that time
   during which compute, compression or memory work runs / time with a collective in flight.
"""

from __future__ import annotations

import re
import statistics
from dataclasses import asdict, dataclass

from .traces import Span, Trace

__all__ = ["Breakdown", "breakdown", "class_intervals", "measured_on_device", "step_number", "stragglers", "top_spans",
           "windows"]  # fmt: skip

Intervals = list[tuple[float, float]]
BUSY = ("compute", "compression", "memory")


def union(iv: Intervals) -> Intervals:
    """Sorted, merged, non-empty intervals."""
    out: Intervals = []
    for a, b in sorted(x for x in iv if x[1] > x[0]):
        if out and a <= out[-1][1]:
            if b > out[-1][1]:
                out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def length(u: Intervals) -> float:
    return sum(b - a for a, b in u)


def intersect(a: Intervals, b: Intervals) -> Intervals:
    """Intersection of two merged interval lists."""
    out: Intervals = []
    i = j = 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if lo < hi:
            out.append((lo, hi))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(a: Intervals, b: Intervals) -> Intervals:
    """``a`` minus ``b`` (both merged)."""
    out: Intervals = []
    j = 0
    for lo, hi in a:
        cur = lo
        while j < len(b) and b[j][1] <= cur:
            j += 1
        k = j
        while k < len(b) and b[k][0] < hi:
            if b[k][0] > cur:
                out.append((cur, b[k][0]))
            cur = max(cur, b[k][1])
            k += 1
        if cur < hi:
            out.append((cur, hi))
    return out


def self_segments(spans: list[Span]) -> list[tuple[float, float, str]]:
    """(start, end, class) of each instant's innermost span on one nesting lane."""
    out: list[tuple[float, float, str]] = []
    stack: list[Span] = []
    cur = float("-inf")  # segments are emitted up to here

    def close_until(t: float) -> None:
        nonlocal cur
        while stack and stack[-1].end <= t:
            top = stack.pop()
            if cur < top.end:
                out.append((cur, top.end, top.cls))
                cur = top.end

    for s in sorted(spans, key=lambda s: (s.start, -s.dur)):
        close_until(s.start)
        if stack and cur < s.start:
            out.append((cur, s.start, stack[-1].cls))
        cur = s.start
        stack.append(s)
    close_until(float("inf"))
    return out


def _rank_lanes(trace: Trace, rank: int) -> tuple[dict[int, list[Span]], bool]:
    by_lane: dict[int, list[Span]] = {}
    for s in trace.spans:
        if s.rank == rank and s.cls != "step" and s.cat != "Trace":
            by_lane.setdefault(s.lane, []).append(s)
    device = any(trace.lanes[i].kind == "device" and any(s.cls in ("compute", "communication", "compression",
                                                                   "memory") for s in ss)
                 for i, ss in by_lane.items())  # fmt: skip
    return by_lane, device


def measured_on_device(trace: Trace, rank: int) -> bool:
    """Whether ``rank`` is measured on its GPU lanes (step 2 of the module docstring)."""
    return _rank_lanes(trace, rank)[1]


def class_intervals(trace: Trace, rank: int) -> dict[str, Intervals]:
    """Class -> merged intervals of one rank (steps 1-2 of the module docstring)."""
    return _class_intervals(trace, rank)[0]


def _class_intervals(trace: Trace, rank: int) -> tuple[dict[str, Intervals], bool]:
    by_lane, device = _rank_lanes(trace, rank)
    segs: dict[str, Intervals] = {}
    for i, ss in by_lane.items():
        kind = trace.lanes[i].kind
        if device and kind == "thread":
            continue
        if kind == "inflight":
            for s in ss:
                segs.setdefault(s.cls, []).append((s.start, s.end))
        else:
            for a, b, c in self_segments(ss):
                segs.setdefault(c, []).append((a, b))
            # a collective call counts whole as communication, with what it nests (flattening, waiting)
            segs.setdefault("communication", []).extend((s.start, s.end) for s in ss if s.cls == "communication")
    return {c: union(v) for c, v in segs.items()}, device


def step_number(s: Span) -> int | None:
    n = s.args.get("step") if isinstance(s.args, dict) else None
    if isinstance(n, int) and not isinstance(n, bool):
        return n
    m = re.search(r"(\d+)$", s.name)
    return int(m.group(1)) if m else None


def windows(trace: Trace, rank: int, *, step: int | None = None, window: tuple[float, float] | None = None,
            label: str | None = None) -> Intervals:  # fmt: skip
    """The windows one rank is measured over: ``window`` (ms) if given; else its steps (step ``step``
    only, or those whose ``label`` arg matches); else its whole extent."""
    if window is not None:
        return [window]
    steps = trace.steps(rank)
    if step is not None:
        steps = [s for s in steps if step_number(s) == step]
    if label is not None:
        steps = [s for s in steps if s.args.get("label") == label]
    if steps or step is not None or label is not None:
        return union([(s.start, s.end) for s in steps])
    mine = [s for s in trace.spans if s.rank == rank and s.cat != "Trace"]
    if not mine:
        return []
    return [(min(s.start for s in mine), max(s.end for s in mine))]


@dataclass(slots=True)
class Breakdown:
    """One rank's time over its windows, in milliseconds (see the module docstring)."""

    rank: int
    """The rank."""
    window_ms: float
    """Total time measured (the windows' length)."""
    steps: int
    """Step markers inside the windows."""
    compute_ms: float
    """Compute (exclusive)."""
    compression_ms: float
    """Compression not under compute."""
    memory_ms: float
    """Copies not under compute or compression."""
    communication_ms: float
    """Exposed communication: a collective in flight and nothing above running."""
    unrecorded_ms: float
    """Time no span covers (nothing recorded running, nothing in flight): not necessarily idle; see the
    module docstring."""
    comm_ms: float
    """Time with any collective in flight."""
    comm_share: float
    """comm_ms / window_ms."""
    overlap: float | None
    """Share of comm_ms overlapped by compute, compression or memory work (None without communication)."""
    wire_bytes: int
    """Bytes on the wire of the collectives that started in the windows (torsh traces)."""
    collectives: int
    """Collectives (communication spans on in-flight lanes, or all, for other traces) starting in the windows."""
    measured_on: str = "host"
    """``device``: measured on GPU lanes (unrecorded time is GPU idle time); ``host``: on host threads."""

    def as_dict(self) -> dict:
        return asdict(self)

    def share(self, name: str) -> float:
        return getattr(self, f"{name}_ms") / self.window_ms if self.window_ms else 0.0


def breakdown(trace: Trace, rank: int, wins: Intervals) -> Breakdown:
    """The breakdown of ``rank`` over ``wins`` (ms)."""
    wins = union(wins)
    total = length(wins)
    cls_iv, device = _class_intervals(trace, rank)
    ci = {c: intersect(v, wins) for c, v in cls_iv.items()}
    taken: Intervals = []
    excl = {}
    for c in (*BUSY, "communication"):
        mine = subtract(ci.get(c, []), taken)
        excl[c] = length(mine)
        taken = union(taken + mine)
    comm = ci.get("communication", [])
    busy = union([x for c in BUSY for x in ci.get(c, [])])
    comm_ms = length(comm)
    inflight = any(ln.rank == rank and ln.kind == "inflight" for ln in trace.lanes)
    wire, count, nsteps = 0, 0, 0
    for s in trace.spans:
        if s.rank != rank or not any(a <= s.start < b for a, b in wins):
            continue
        if s.cls == "step":
            nsteps += 1
        elif s.cls == "communication" and (not inflight or trace.lanes[s.lane].kind == "inflight"):
            count += 1
            w = s.args.get("wire_bytes")
            if isinstance(w, int):
                wire += w
    return Breakdown(
        rank=rank, window_ms=total, steps=nsteps, compute_ms=excl["compute"], compression_ms=excl["compression"],
        memory_ms=excl["memory"], communication_ms=excl["communication"],
        unrecorded_ms=max(0.0, total - length(taken)), comm_ms=comm_ms, comm_share=comm_ms / total if total else 0.0,
        overlap=length(intersect(comm, busy)) / comm_ms if comm_ms else None, wire_bytes=wire, collectives=count,
        measured_on="device" if device else "host",
    )  # fmt: skip


def top_spans(trace: Trace, spans: list[Span], wins_by_rank: dict[int, Intervals], n: int = 15) -> list[dict]:
    """The ``n`` names with the most total time (spans clipped to their rank's windows), steps excluded."""
    agg: dict[str, dict] = {}
    for s in spans:
        if s.cls == "step" or s.cat == "Trace":
            continue
        t = 0.0
        for a, b in wins_by_rank.get(s.rank, []):
            t += max(0.0, min(b, s.end) - max(a, s.start))
        if t <= 0 and not (s.dur == 0 and any(a <= s.start <= b for a, b in wins_by_rank.get(s.rank, []))):
            continue
        d = agg.setdefault(s.name, {"name": s.name, "class": s.cls, "count": 0, "total_ms": 0.0, "max_ms": 0.0,
                                    "ranks": set()})  # fmt: skip
        d["count"] += 1
        d["total_ms"] += t
        d["max_ms"] = max(d["max_ms"], s.dur)
        d["ranks"].add(s.rank)
    rows = sorted(agg.values(), key=lambda d: -d["total_ms"])[:n]
    for d in rows:
        d["mean_ms"] = d["total_ms"] / d["count"]
        d["ranks"] = sorted(d["ranks"])
    return rows


def stragglers(trace: Trace, *, min_late_ms: float | None = None) -> list[dict]:
    """Per rank: how late its collectives start relative to the earliest rank's start of the same
    collective (matched by group and sequence number in torsh traces, by name and occurrence otherwise).
    A rank is a straggler when it starts last in at least 60% of the matched collectives and its median
    lateness is at least ``min_late_ms`` (default: 5% of the median step, at least 0.1 ms)."""
    ranks = list(trace.ranks)
    if len(ranks) < 2:
        return []
    starts: dict[tuple, dict[int, float]] = {}
    seen: dict[tuple, int] = {}
    inflight = {i for i, ln in enumerate(trace.lanes) if ln.kind == "inflight"}
    for s in trace.spans:
        if s.cls != "communication":
            continue
        if trace.ranks[s.rank].get("source") == "torsh":
            if s.lane not in inflight or "seq" not in s.args:
                continue
            key = (s.args.get("group"), s.args["seq"])
        else:
            k = (s.rank, s.name)
            seen[k] = seen.get(k, 0) + 1
            key = (s.name, seen[k])
        starts.setdefault(key, {}).setdefault(s.rank, s.start)
    matched = [v for v in starts.values() if len(v) >= 2]
    if not matched:
        return []
    if min_late_ms is None:
        durs = [s.dur for s in trace.steps()]
        min_late_ms = max(0.1, 0.05 * statistics.median(durs)) if durs else 0.1
    out = []
    for r in ranks:
        late, last = [], 0
        for v in matched:
            if r not in v:
                continue
            first = min(v.values())
            late.append(v[r] - first)
            if v[r] == max(v.values()) and v[r] > first:
                last += 1
        if not late:
            continue
        med = statistics.median(late)
        frac = last / len(late)
        out.append({"rank": r, "collectives": len(late), "median_late_ms": med, "max_late_ms": max(late),
                    "latest_fraction": frac, "straggler": frac >= 0.6 and med >= min_late_ms,
                    "threshold_ms": min_late_ms})  # fmt: skip
    return out
