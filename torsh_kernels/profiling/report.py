"""``torsh report TRACE_OR_DIR``: where the step time goes, and what to change.

Per rank, over its steps (step markers, outliers left out; else its recorded extent; or ``--step N`` /
``--window``): the
exclusive breakdown into compute, compression, memory, exposed communication and unrecorded time, the
communication share (time with a collective in flight / step time) and the overlap (share of that time
hidden behind work), the same numbers ``torsh timeline`` prints (both call
:func:`~torsh_kernels.profiling.analysis.breakdown` on the same windows). Steps carrying a ``label``
(``timeline.step(i, label="powersgd")``; the demo labels each compressor's steps) get one row per label.
Then stragglers (a rank whose collectives start last, consistently and by a margin) and suggestions
driven by :class:`Thresholds` and by what the trace shows the job already does (:func:`facts`: whether it
compresses and with what, on which providers, whether its collectives start during backward, what its
copies are). A suggestion never proposes what the job already does, and no two contradict each other:
"compress harder" and "compress more cheaply" are exclusive (the larger of the exposed communication and
the compression time decides), and time no span covers is reported as unrecorded, with advice to record
it, never as host stalls (those are suggested only for GPU idle time on ranks measured on their GPU).

Outlier steps (:func:`outlier_steps`): one step far slower than the others (a 57 s stall among 22 ms steps)
would decide every share of a sum over the steps. Over steps, each rank's steps of one label are judged
against their median: a step longer than ``median + 5 * max(1.4826 * MAD, 0.1 * median)`` (at least 1.5
times the median) is an outlier when such steps are rare (at most 10% of the group, at least one; more
are a mode of the job, such as the synchronising steps of gradient accumulation, and stay). Outliers are
listed, with their duration and the limit, left out of the windows every figure is computed over (shares,
median step, buckets, facts, suggestions), and the report says so; ``--step N`` and ``--window`` report
on what they name, outliers or not. (``torsh timeline`` computes its own breakdown over all the steps.)

``--json [PATH]`` writes the same content as JSON to PATH (with no PATH: to stdout, and nothing else).
"""

from __future__ import annotations

import argparse
import bisect
import math
import re
import statistics
from dataclasses import asdict, dataclass

from .. import cli_common
from ..errors import InvalidArgumentError, TraceFormatError
from . import analysis as A
from .traces import Trace, load

__all__ = ["Thresholds", "add_arguments", "build", "facts", "outlier_steps", "print_report", "run", "suggestions"]


@dataclass(kw_only=True, slots=True)
class Thresholds:
    """When the report suggests a change (fractions of the measured step time unless stated)."""

    comm_share: float = 0.30
    """Communication in flight above this share of the step: compress (or compress harder), bigger buckets,
    hierarchical."""
    overlap: float = 0.50
    """Overlap below this (with comm_share above ``overlap_min_comm``): overlap communication with backward."""
    overlap_min_comm: float = 0.10
    """The overlap rule applies only when communication is at least this share of the step."""
    compression: float = 0.15
    """Compression above this share of the step: faster kernels (or a cheaper compressor)."""
    idle: float = 0.20
    """GPU idle above this share, on ranks measured on their GPU (unrecorded time there: no kernel, copy or
    collective ran): host stalls between work."""
    unrecorded: float = 0.20
    """Unrecorded time above this share, on ranks measured on host threads: record more of the step."""
    memory: float = 0.20
    """Exposed copies above this share: prefetch earlier, pin host memory, or cheaper bucket copies."""
    small_bucket_bytes: int = 1 << 20
    """Median bucket below this many bytes with more than ``many_buckets`` buckets per step: raise bucket size."""
    many_buckets: int = 8
    """See ``small_bucket_bytes``."""

    def __post_init__(self) -> None:
        for k in ("comm_share", "overlap", "overlap_min_comm", "compression", "idle", "unrecorded", "memory"):
            v = getattr(self, k)
            if not isinstance(v, (int, float)) or not 0 <= v <= 1:
                raise InvalidArgumentError(f"Thresholds: {k} must be a fraction in [0, 1], got {v!r}")


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


OUTLIER_K = 5.0
"""A step longer than its group's median + OUTLIER_K * max(1.4826 * MAD, OUTLIER_FLOOR * median) may be an outlier."""
OUTLIER_FLOOR = 0.1
"""The least spread the rule assumes, as a fraction of the median (steps of identical length have no MAD)."""
OUTLIER_MIN_STEPS = 5
"""Groups of fewer steps are not judged."""
OUTLIER_MAX_FRACTION = 0.1
"""More steps than this fraction of the group (and more than one) beyond the limit are a mode, not outliers."""
OUTLIER_RULE = (f"a step longer than its rank's and label's median + {OUTLIER_K:g} x max(1.4826 x MAD, "
                f"{OUTLIER_FLOOR:g} x median), when at most {100 * OUTLIER_MAX_FRACTION:.0f}% of them (or one) are "
                f"(groups of {OUTLIER_MIN_STEPS} steps or more)")  # fmt: skip
"""The rule, as the report states it."""


def outlier_steps(trace: Trace) -> list[dict]:
    """The outlier steps of ``trace`` (see the module docstring): per (rank, step label), the steps beyond
    the limit when they are rare. Each: rank, step (its number or None), label, name, start_ms, ms (its
    duration), median_ms and limit_ms of its group."""
    groups: dict[tuple[int, object], list] = {}
    for st in trace.steps():
        lab = st.args.get("label") if isinstance(st.args, dict) else None
        groups.setdefault((st.rank, lab if isinstance(lab, str) else None), []).append(st)
    out = []
    for (rank, lab), steps in groups.items():
        if len(steps) < OUTLIER_MIN_STEPS:
            continue
        durs = [st.dur for st in steps]
        med = statistics.median(durs)
        mad = statistics.median(abs(d - med) for d in durs)
        limit = med + OUTLIER_K * max(1.4826 * mad, OUTLIER_FLOOR * med)
        far = [st for st in steps if st.dur > limit]
        if not far or len(far) > max(1, OUTLIER_MAX_FRACTION * len(steps)):
            continue
        out += [{"rank": rank, "step": A.step_number(st), "label": lab, "name": st.name, "start_ms": st.start,
                 "ms": st.dur, "median_ms": med, "limit_ms": limit} for st in far]  # fmt: skip
    return sorted(out, key=lambda o: (o["rank"], o["start_ms"]))


def _kept_windows(trace: Trace, rank: int, out: set[tuple[int, float]], label: str | None = None) -> A.Intervals:
    """The windows of ``rank``'s steps (of ``label``) other than the outliers ``out`` ((rank, start) pairs)."""
    return A.union([(st.start, st.end) for st in trace.steps(rank) if (rank, st.start) not in out
                    and (label is None or st.args.get("label") == label)])  # fmt: skip


def build(trace: Trace, *, step: int | None = None, window: tuple[float, float] | None = None,
          thresholds: Thresholds | None = None) -> dict:  # fmt: skip
    """The report as a JSON-ready dict: ranks, labels, summary, stragglers, suggestions."""
    th = thresholds or Thresholds()
    ranks = list(trace.ranks)
    steps = trace.steps()
    outliers = outlier_steps(trace) if step is None and window is None else []
    out = {(o["rank"], o["start_ms"]) for o in outliers}
    if out:
        steps = [s for s in steps if (s.rank, s.start) not in out]
        wins = {r: _kept_windows(trace, r, out) if trace.steps(r) else A.windows(trace, r) for r in ranks}
    else:
        wins = {r: A.windows(trace, r, step=step, window=window) for r in ranks}
    if step is not None and not any(wins.values()):
        raise InvalidArgumentError(f"--step {step}: no rank has a step {step} in this trace")
    bds = {r: A.breakdown(trace, r, wins[r]) for r in ranks}
    labels: dict[str, list[dict]] = {}
    if window is None and step is None:
        first: dict[str, float] = {}  # label -> its first step's start
        for s in steps:
            lab = s.args.get("label")
            if isinstance(lab, str):
                first[lab] = min(first.get(lab, s.start), s.start)
        for lab in sorted(first, key=first.get):
            labels[lab] = [A.breakdown(trace, r, _kept_windows(trace, r, out, lab)).as_dict() for r in ranks]
    step_ms = [s.dur for s in steps if step is None or A.step_number(s) == step]
    strag = A.stragglers(trace)
    measured = [b for b in bds.values() if b.window_ms > 0]
    summary = {
        "ranks": len(ranks),
        "sources": sorted({m.get("source", "?") for m in trace.ranks.values()}),
        "steps_per_rank": max((b.steps for b in measured), default=0),
        "step_ms_median": statistics.median(step_ms) if step_ms else None,
        "wire_bytes_per_step": _wire_per_step([b.as_dict() for b in measured]),
        "comm_share": statistics.fmean(b.comm_share for b in measured) if measured else 0.0,
        "comm_share_max": max((b.comm_share for b in measured), default=0.0),
        "overlap": _mean_overlap(measured),
        "compression_share": statistics.fmean(b.share("compression") for b in measured) if measured else 0.0,
        "unrecorded_share": statistics.fmean(b.share("unrecorded") for b in measured) if measured else 0.0,
        "measured_on": sorted({b.measured_on for b in measured}),
        "gpu_idle_share": _mean_share(measured, "unrecorded", "device"),
        "host_unrecorded_share": _mean_share(measured, "unrecorded", "host"),
        "memory_share": statistics.fmean(b.share("memory") for b in measured) if measured else 0.0,
        "exposed_comm_share": statistics.fmean(b.share("communication") for b in measured) if measured else 0.0,
    }
    buckets = _bucket_stats(trace, wins)
    rep = {
        "facts": facts(trace, wins),
        "window": {
            "step": step,
            "window_ms": list(window) if window else None,
            "over": "window" if window else ("steps" if steps else "recorded extent"),
        },
        "ranks": [bds[r].as_dict() for r in ranks],
        "labels": labels,
        "by_label": {lab: label_figures(trace, lab, rows, outliers) for lab, rows in labels.items()},
        "outliers": {"steps": outliers, "excluded": bool(outliers), "rule": OUTLIER_RULE},
        "summary": summary,
        "buckets": buckets,
        "stragglers": strag,
        "thresholds": asdict(th),
    }
    rep["suggestions"] = suggestions(rep, trace, th)
    return rep


def _wire_per_step(rows: list[dict]) -> float | None:
    """Wire bytes per step: each measured rank's wire bytes over its steps, averaged over the ranks."""
    per = [r["wire_bytes"] / r["steps"] for r in rows if r["window_ms"] > 0 and r["steps"]]
    return statistics.fmean(per) if per else None


def label_figures(trace: Trace, label: str, rows: list[dict], outliers: list[dict] | None = None) -> dict:
    """One step label's figures (``rows``: its per-rank breakdowns): the median and mean of its steps'
    durations over every rank (``outliers``, as :func:`outlier_steps` lists them, left out), wire bytes per
    step (:func:`_wire_per_step`) and the time shares. The per-label table, the JSON report and ``torsh demo
    --trace``'s table all read these, so they agree."""
    out = {(o["rank"], o["start_ms"]) for o in outliers or ()}
    durs = [s.dur for s in trace.steps() if s.args.get("label") == label and (s.rank, s.start) not in out]
    rows = [r for r in rows if r["window_ms"] > 0]
    w = sum(r["window_ms"] for r in rows)
    comm = sum(r["comm_ms"] for r in rows)

    def share(key: str) -> float | None:
        return sum(r[key] for r in rows) / w if w else None

    return {
        "steps_per_rank": statistics.fmean(r["steps"] for r in rows) if rows else 0,
        "step_ms_median": statistics.median(durs) if durs else None,
        "step_ms_mean": statistics.fmean(durs) if durs else None,
        "wire_bytes_per_step": _wire_per_step(rows),
        "compute": share("compute_ms"),
        "compression": share("compression_ms"),
        "comm_exposed": share("communication_ms"),
        "unrecorded": share("unrecorded_ms"),
        "comm_share": comm / w if w else None,
        "overlap": sum((r["overlap"] or 0) * r["comm_ms"] for r in rows) / comm if comm else None,
    }


def _mean_share(bds: list[A.Breakdown], name: str, measured_on: str) -> float | None:
    """The mean share of ``name`` over the ranks measured on ``measured_on`` (None: no such rank)."""
    sel = [b.share(name) for b in bds if b.measured_on == measured_on]
    return statistics.fmean(sel) if sel else None


def _mean_overlap(bds: list[A.Breakdown]) -> float | None:
    """Overlap over all ranks: overlapped communication time / communication time, summed over ranks."""
    comm = sum(b.comm_ms for b in bds)
    if not comm:
        return None
    return sum((b.overlap or 0.0) * b.comm_ms for b in bds) / comm


def _bucket_stats(trace: Trace, wins: dict[int, A.Intervals]) -> dict | None:
    sizes = []
    for s in trace.spans:
        if s.cat == "bucket" and isinstance(s.args.get("bytes"), int) and any(a <= s.start < b for a, b in
                                                                               wins.get(s.rank, [])):  # fmt: skip
            sizes.append(s.args["bytes"])
    nsteps = sum(len([x for x in trace.steps(r) if any(a <= x.start < b for a, b in wins[r])]) for r in wins)
    if not sizes:
        return None
    per_step = len(sizes) / nsteps if nsteps else None
    compressors = sorted({s.args.get("compressor") for s in trace.spans if s.cat == "bucket"} - {None})
    return {"count": len(sizes), "median_bytes": statistics.median(sizes), "per_step": per_step,
            "compressors": compressors}  # fmt: skip


_BACKWARD = re.compile(r"^(?:backward\b|autograd::engine::evaluate_function: )")
_ROUND = re.compile(r"^(\w+) round \d+$")
_OFFLOAD = re.compile(r"offload|memcpy|memset|\bcopy\b|HtoD|DtoH", re.IGNORECASE)


def _in(wins: A.Intervals, t: float) -> bool:
    """Whether ``t`` lies in one of ``wins`` (merged and sorted, as :func:`analysis.union` makes them)."""
    i = bisect.bisect_right(wins, (t, math.inf)) - 1
    return i >= 0 and wins[i][0] <= t < wins[i][1]


def facts(trace: Trace, wins: dict[int, A.Intervals]) -> dict:
    """What the trace shows the job already does, over the ranks' windows: the compressors it uses (the
    ``compressor`` of its buckets, collectives and compression rounds) and whether any compression work
    runs (torsh compression ops, also in Kineto traces); the providers of its compression ops; whether
    backward is recorded and whether collectives start during it; what its exposed copies are (ms by
    name, the largest first). The suggestions read these so as never to propose what the job does."""
    compressors: set[str] = set()
    providers: set[str] = set()
    compression_ms = 0.0
    backward: dict[int, A.Intervals] = {}
    comm_starts: list[tuple[int, float]] = []
    memory: dict[str, float] = {}
    wins = {r: A.union(w) for r, w in wins.items()}
    for s in trace.spans:
        w = wins.get(s.rank, [])
        if not _in(w, s.start):
            continue
        c = s.args.get("compressor") if isinstance(s.args, dict) else None
        if isinstance(c, str) and c.lower() != "none":
            compressors.add(c)
        if s.cls == "compression":
            compression_ms += s.dur
            m = _ROUND.match(s.name)  # a compression round, also where its args did not survive (Kineto)
            if m and m.group(1).lower() != "none":
                compressors.add(m.group(1))
            p = s.args.get("provider")
            if isinstance(p, str):
                providers.add(p)
        elif s.cls == "communication":
            comm_starts.append((s.rank, s.start))
        elif s.cls == "memory":
            memory[s.name] = memory.get(s.name, 0.0) + s.dur
        if _BACKWARD.match(s.name) and trace.lanes[s.lane].kind == "thread":
            backward.setdefault(s.rank, []).append((s.start, s.end))
    bw = {r: A.union(v) for r, v in backward.items()}
    during = any(_in(bw.get(r, []), t) for r, t in comm_starts)
    return {
        "compressors": sorted(compressors),
        "compressing": bool(compressors) or compression_ms > 0,
        "compression_providers": sorted(providers),
        "backward_recorded": bool(bw),
        "comm_during_backward": during if bw else None,
        "memory_ms_by_name": dict(sorted(memory.items(), key=lambda kv: -kv[1])),
        "sources": sorted({m.get("source", "?") for m in trace.ranks.values()}),
    }


# cheaper compressors, cheapest first: what "switch to a cheaper compressor" may propose
_CHEAP = ("FP16", "BF16", "Quantize")


def suggestions(rep: dict, trace: Trace, th: Thresholds) -> list[dict]:
    """Concrete changes, each with the metric and threshold that triggered it, consistent with each other
    and with :func:`facts` (see the module docstring)."""
    s = rep["summary"]
    f = rep.get("facts") or facts(trace, {r: A.windows(trace, r) for r in trace.ranks})
    out = [
        _suggest_communication(rep, f, th),
        _suggest_overlap(s, f, th),
        _suggest_compression(s, f, th),
        _suggest_idle(s, th),
        _suggest_unrecorded(s, f, th),
        _suggest_memory(s, f, th),
    ]
    out += [_suggest_straggler(r) for r in rep["stragglers"] if r["straggler"]]
    out.append(_suggest_buckets(rep.get("buckets") or {}, th))
    return [x for x in out if x is not None]


def _suggestion(id_: str, metric: str, value: float, threshold: float, msg: str) -> dict:
    return {"id": id_, "metric": metric, "value": value, "threshold": threshold, "message": msg}


def _compression_dominates(s: dict) -> bool:
    """The larger cost decides: compress harder (less exposed communication) or more cheaply (less compression)."""
    return s["compression_share"] > s["exposed_comm_share"]


def _suggest_communication(rep: dict, f: dict, th: Thresholds) -> dict | None:
    s = rep["summary"]
    if not s["comm_share_max"] > th.comm_share:
        return None
    worst = max(rep["ranks"], key=lambda r: r["comm_share"])
    using = ", ".join(f["compressors"]) if f["compressors"] else "torsh's compression ops"
    if not f["compressing"]:
        how = ("compress gradients with compression_hook / GradientSynchronizer(compressor=PowerSGD(4) or TopK "
               "or Quantize(8)); ")  # fmt: skip
    elif not _compression_dominates(s):
        how = (f"the job already compresses ({using}): raise the compression rate (a lower PowerSGD rank, a "
               "smaller TopK ratio, fewer Quantize bits) to cut the exposed communication; ")  # fmt: skip
    else:
        how = (f"the job already compresses ({using}) and compressing costs more of the step "
               f"({_pct(s['compression_share'])}) than the communication it leaves exposed "
               f"({_pct(s['exposed_comm_share'])}), so compressing harder would not pay; ")  # fmt: skip
    return _suggestion("communication", "comm_share", s["comm_share_max"], th.comm_share,
        f"Communication is in flight for {_pct(worst['comm_share'])} of rank {worst['rank']}'s step (over "
        f"{_pct(th.comm_share)}): {how}use larger buckets (bucket_mb / DDP bucket_cap_mb) to cut per-message "
        "latency; across nodes, hierarchical_all_reduce keeps most bytes on the fast links.")  # fmt: skip


def _suggest_overlap(s: dict, f: dict, th: Thresholds) -> dict | None:
    ov = s["overlap"]
    if ov is None or not ov < th.overlap or not s["comm_share"] >= th.overlap_min_comm:
        return None
    head = f"Only {_pct(ov)} of communication overlaps work (below {_pct(th.overlap)}): "
    if f["comm_during_backward"]:
        msg = (
            "collectives already start during backward, so the exposed part comes after it: a smaller first "
            "bucket (first_bucket_mb) starts communication earlier, and work that does not need the reduced "
            "gradients (the next batch's loading, logging) can run while the last buckets are in flight."
        )
    elif f["comm_during_backward"] is None:
        msg = (
            "backward is not recorded, so the report cannot tell whether collectives start during it; record "
            "it (Recorder(model=net)). If they start only after backward, start buckets during backward "
            "(GradientSynchronizer(overlap=True) or a DDP comm hook), with a small first bucket "
            "(first_bucket_mb) so communication starts early."
        )
    else:
        msg = (
            "collectives start only after backward: start buckets during backward "
            "(GradientSynchronizer(overlap=True) or a DDP comm hook instead of an all-reduce after backward), "
            "with a small first bucket (first_bucket_mb) so communication starts early."
        )
    return _suggestion("overlap", "overlap", ov, th.overlap, head + msg)


def _suggest_compression(s: dict, f: dict, th: Thresholds) -> dict | None:
    compression = s["compression_share"]
    if not compression > th.compression:
        return None
    ways = []
    if f["compression_providers"] != ["triton"]:
        ways.append("run the compression kernels on the GPU (triton provider)")
    if _compression_dominates(s):
        in_use = {c.split("(")[0] for c in f["compressors"]}
        cheaper = [c for c in _CHEAP if c not in in_use]
        if cheaper and not in_use & {"FP16", "BF16"}:
            ways.append(f"switch to a cheaper compressor ({' or '.join(cheaper)})")
    ways.append("compress only large tensors (min_numel, min_compression_rate)")
    return _suggestion("compression", "compression_share", compression, th.compression,
        f"Compression takes {_pct(compression)} of the step (over {_pct(th.compression)}): "
        + ", ".join(ways[:-1]) + (", or " if len(ways) > 1 else "") + ways[-1] + ".")  # fmt: skip


def _suggest_idle(s: dict, th: Thresholds) -> dict | None:
    gpu_idle = s["gpu_idle_share"]
    if gpu_idle is None or not gpu_idle > th.idle:
        return None
    return _suggestion("idle", "gpu_idle_share", gpu_idle, th.idle,
        f"The GPU is idle for {_pct(gpu_idle)} of the step (no kernel, copy or collective on it; over "
        f"{_pct(th.idle)}): it waits for the host; look at the gaps in `torsh timeline` for host stalls (data "
        "loading, .item() or .cpu() synchronisations, logging).")  # fmt: skip


def _suggest_unrecorded(s: dict, f: dict, th: Thresholds) -> dict | None:
    unrec = s["host_unrecorded_share"]
    if unrec is None or not unrec > th.unrecorded:
        return None
    if "torsh" in f["sources"]:
        how = (
            "pass the model to the recorder (Recorder(dir, model=net)) to record forward and backward, and "
            "wrap the rest (data loading, the optimizer step) in timeline.record(...)"
            if not f["backward_recorded"]
            else "wrap the unrecorded work (data loading, the optimizer step, logging) in timeline.record(...)"
        )
    else:
        how = "profile with with_stack=True to see the Python that runs between the recorded ops"
    return _suggestion("unrecorded", "host_unrecorded_share", unrec, th.unrecorded,
        f"{_pct(unrec)} of the step is covered by no recorded span (over {_pct(th.unrecorded)}): the trace "
        f"cannot say what ran then, or whether anything did; {how}.")  # fmt: skip


def _suggest_memory(s: dict, f: dict, th: Thresholds) -> dict | None:
    if not s["memory_share"] > th.memory:
        return None
    by_name = f["memory_ms_by_name"]
    top = list(by_name)[:3]
    offload = sum(v for k, v in by_name.items() if _OFFLOAD.search(k))
    if offload >= sum(by_name.values()) / 2:
        how = "prefetch offloaded state earlier (ParameterOffloader prefetch) and keep host buffers pinned"
    else:
        how = (
            "these are copies into and out of buckets or expert order, not transfers: the triton provider "
            "fuses each into one launch per bucket, and larger buckets mean fewer of them"
        )
    return _suggestion("memory", "memory_share", s["memory_share"], th.memory,
        f"Copies are exposed for {_pct(s['memory_share'])} of the step (over {_pct(th.memory)}), mostly "
        f"{', '.join(top) or 'copies'}: {how}.")  # fmt: skip


def _suggest_straggler(r: dict) -> dict:
    return _suggestion("straggler", "median_late_ms", r["median_late_ms"], r["threshold_ms"],
        f"Rank {r['rank']} starts {_pct(r['latest_fraction'])} of its collectives last, by a median "
        f"{r['median_late_ms']:.3f} ms: the others wait for it. Check its data loading, host load and "
        "input sizes (uneven batches or MoE routing).")  # fmt: skip


def _suggest_buckets(b: dict, th: Thresholds) -> dict | None:
    if not (b and b.get("per_step") and b["per_step"] > th.many_buckets and b["median_bytes"] < th.small_bucket_bytes):
        return None
    return _suggestion("buckets", "median_bucket_bytes", b["median_bytes"], th.small_bucket_bytes,
        f"{b['per_step']:.0f} buckets per step with a median of {b['median_bytes'] / 1024:.0f} KiB: each "
        "collective pays a fixed latency; raise bucket_mb (DDP: bucket_cap_mb).")  # fmt: skip


def print_labels(rep: dict, console) -> None:
    """The per-label table (steps grouped by their ``label``), when the steps carry several labels (the
    figures of each label are in ``rep["by_label"]`` whenever steps carry labels)."""
    from ..env import fmt_bytes

    if len(rep["by_label"]) < 2:
        return
    cols = ["label", "steps/rank", "median ms/step", "compute", "compression", "comm exposed", "unrecorded",
            "comm share", "overlap", "wire bytes/step"]  # fmt: skip
    tl = cli_common.table("by step label (steps of every rank)", cols, text=("label",))
    for lab, f in rep["by_label"].items():
        if f["step_ms_median"] is None or f["compute"] is None:
            continue
        wire = "-" if f["wire_bytes_per_step"] is None else fmt_bytes(f["wire_bytes_per_step"])
        tl.add_row(lab, f"{f['steps_per_rank']:.0f}", f"{f['step_ms_median']:.3f}", _pct(f["compute"]),
                   _pct(f["compression"]), _pct(f["comm_exposed"]), _pct(f["unrecorded"]), _pct(f["comm_share"]),
                   "-" if f["overlap"] is None else _pct(f["overlap"]), wire)  # fmt: skip
    console.print(tl)


def print_outliers(rep: dict, console) -> None:
    """The outlier steps, and that every figure leaves them out."""
    o = rep.get("outliers") or {}
    if not o.get("steps"):
        return
    listed = "; ".join(
        f"rank {x['rank']} {x['name']}{'' if x['label'] is None else ' (' + x['label'] + ')'}: {x['ms']:.4g} ms "
        f"(median {x['median_ms']:.4g} ms, limit {x['limit_ms']:.4g} ms)"
        for x in o["steps"][:10]
    ) + ("; ..." if len(o["steps"]) > 10 else "")
    console.print(f"{len(o['steps'])} outlier step(s) excluded from every figure of this report (shares, median "
                  f"step, suggestions): {listed}. Outlier: {o['rule']}; `--step N` reports on one of them.",
                  markup=False)  # fmt: skip


def print_report(rep: dict, console) -> None:
    s = rep["summary"]
    over = rep["window"]["over"]
    title = f"torsh report: {s['ranks']} rank(s) ({', '.join(s['sources'])}), over {over}"
    if rep["window"]["step"] is not None:
        title += f" (step {rep['window']['step']})"
    if s["step_ms_median"] is not None:
        title += f"; median step {s['step_ms_median']:.3f} ms"
    cols = ["rank", "time ms", "steps", "compute", "compression", "memory", "comm exposed", "unrecorded", "comm share",
            "overlap", "collectives"]  # fmt: skip
    t = cli_common.table(title, cols, text=("rank",))
    for b in rep["ranks"]:
        w = b["window_ms"] or 1.0
        t.add_row(str(b["rank"]), f"{b['window_ms']:.3f}", str(b["steps"]), _pct(b["compute_ms"] / w),
                  _pct(b["compression_ms"] / w), _pct(b["memory_ms"] / w), _pct(b["communication_ms"] / w),
                  _pct(b["unrecorded_ms"] / w), _pct(b["comm_share"]),
                  "-" if b["overlap"] is None else _pct(b["overlap"]), str(b["collectives"]))  # fmt: skip
    console.print(t)
    print_outliers(rep, console)
    print_labels(rep, console)
    if rep["stragglers"]:
        ts = cli_common.table("collective start lateness (vs the earliest rank, same collective)",
                        ["rank", "collectives", "median late ms", "max late ms", "starts last", "straggler"],
                        text=("rank",))  # fmt: skip
        for r in rep["stragglers"]:
            ts.add_row(str(r["rank"]), str(r["collectives"]), f"{r['median_late_ms']:.3f}", f"{r['max_late_ms']:.3f}",
                       _pct(r["latest_fraction"]), "YES" if r["straggler"] else "no")  # fmt: skip
        console.print(ts)
    console.print(f"communication share {_pct(s['comm_share'])} of step time (mean over ranks; max "
                  f"{_pct(s['comm_share_max'])}), overlap {'-' if s['overlap'] is None else _pct(s['overlap'])}, "
                  f"exposed communication {_pct(s['exposed_comm_share'])}, compression "
                  f"{_pct(s['compression_share'])}, unrecorded {_pct(s['unrecorded_share'])}"
                  + ("" if s["gpu_idle_share"] is None else f" (GPU idle {_pct(s['gpu_idle_share'])})"))  # fmt: skip
    if rep["suggestions"]:
        console.print("[bold]suggestions[/bold]")
        for i, sg in enumerate(rep["suggestions"], 1):
            console.print(f"{i}. ({sg['id']}) {sg['message']}", markup=False)
    else:
        console.print("no suggestions: every measure is within its threshold")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("trace", help="a trace file (.json, .json.gz) or a directory of per-rank files")
    ap.add_argument("--step", type=cli_common.int_at_least(0), default=None, help="report on step N only")
    ap.add_argument("--window", default=None, help="report on a time window, e.g. 120ms:180ms")
    cli_common.add_json(ap, "the report")
    ap.add_argument("--width", type=cli_common.int_at_least(40), default=None, help="columns (default: the terminal's)")


def run(a: argparse.Namespace) -> int:
    from .viewer import parse_window

    try:
        window = None
        if a.window:
            lo, hi = parse_window(a.window)
            trace = load(a.trace)
            window = (lo or 0.0, hi if hi is not None else trace.end)
        else:
            trace = load(a.trace)
        rep = build(trace, step=a.step, window=window)
    except (TraceFormatError, InvalidArgumentError) as e:
        return cli_common.fail("torsh report", e)
    if a.json != "-":  # on stdout the JSON is the report: nothing else is printed
        print_report(rep, cli_common.console(width=a.width))
    cli_common.write_json(a.json, rep)
    return 0
