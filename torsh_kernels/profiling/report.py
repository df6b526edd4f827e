"""``torsh report TRACE_OR_DIR``: where the step time goes, and what to change.

Per rank, over its steps (step markers; else its recorded extent; or ``--step N`` / ``--window``): the
exclusive breakdown into compute, compression, memory, exposed communication and idle time, the
communication share (time with a collective in flight / step time) and the overlap (share of that time
hidden behind work), the same numbers ``torsh timeline`` prints (both call
:func:`~torsh_kernels.profiling.analysis.breakdown` on the same windows). Steps carrying a ``label``
(``timeline.step(i, label="powersgd")``; the demo labels each compressor's steps) get one row per label.
Then stragglers (a rank whose collectives start last, consistently and by a margin) and suggestions
driven by :class:`Thresholds`. ``--json`` prints the same content as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import asdict, dataclass

from ..errors import InvalidArgumentError, TraceFormatError
from . import analysis as A
from .traces import Trace, load

__all__ = ["Thresholds", "add_arguments", "build", "print_report", "run", "suggestions"]


@dataclass(kw_only=True, slots=True)
class Thresholds:
    """When the report suggests a change (fractions of the measured step time unless stated)."""

    comm_share: float = 0.30
    """Communication in flight above this share of the step: compress, bigger buckets, hierarchical."""
    overlap: float = 0.50
    """Overlap below this (with comm_share above ``overlap_min_comm``): overlap communication with backward."""
    overlap_min_comm: float = 0.10
    """The overlap rule applies only when communication is at least this share of the step."""
    compression: float = 0.15
    """Compression above this share of the step: cheaper compressor or faster kernels."""
    idle: float = 0.20
    """Idle above this share: host stalls between work."""
    memory: float = 0.20
    """Exposed copies above this share: prefetch earlier, pin host memory."""
    small_bucket_bytes: int = 1 << 20
    """Median bucket below this many bytes with more than ``many_buckets`` buckets per step: raise bucket size."""
    many_buckets: int = 8
    """See ``small_bucket_bytes``."""

    def __post_init__(self) -> None:
        for k in ("comm_share", "overlap", "overlap_min_comm", "compression", "idle", "memory"):
            v = getattr(self, k)
            if not isinstance(v, (int, float)) or not 0 <= v <= 1:
                raise InvalidArgumentError(f"Thresholds: {k} must be a fraction in [0, 1], got {v!r}")


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def build(trace: Trace, *, step: int | None = None, window: tuple[float, float] | None = None,
          thresholds: Thresholds | None = None) -> dict:  # fmt: skip
    """The report as a JSON-ready dict: ranks, labels, summary, stragglers, suggestions."""
    th = thresholds or Thresholds()
    ranks = list(trace.ranks)
    steps = trace.steps()
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
        names = sorted(first, key=first.get)
        if len(names) > 1:
            for lab in names:
                labels[lab] = [A.breakdown(trace, r, A.windows(trace, r, label=lab)).as_dict() for r in ranks]
    step_ms = [s.dur for s in steps if step is None or A.step_number(s) == step]
    strag = A.stragglers(trace)
    measured = [b for b in bds.values() if b.window_ms > 0]
    summary = {
        "ranks": len(ranks),
        "sources": sorted({m.get("source", "?") for m in trace.ranks.values()}),
        "steps_per_rank": max((b.steps for b in measured), default=0),
        "step_ms_median": statistics.median(step_ms) if step_ms else None,
        "comm_share": statistics.fmean(b.comm_share for b in measured) if measured else 0.0,
        "comm_share_max": max((b.comm_share for b in measured), default=0.0),
        "overlap": _mean_overlap(measured),
        "compression_share": statistics.fmean(b.share("compression") for b in measured) if measured else 0.0,
        "idle_share": statistics.fmean(b.share("idle") for b in measured) if measured else 0.0,
        "memory_share": statistics.fmean(b.share("memory") for b in measured) if measured else 0.0,
        "exposed_comm_share": statistics.fmean(b.share("communication") for b in measured) if measured else 0.0,
    }
    buckets = _bucket_stats(trace, wins)
    rep = {
        "window": {
            "step": step,
            "window_ms": list(window) if window else None,
            "over": "window" if window else ("steps" if steps else "recorded extent"),
        },
        "ranks": [bds[r].as_dict() for r in ranks],
        "labels": labels,
        "summary": summary,
        "buckets": buckets,
        "stragglers": strag,
        "thresholds": asdict(th),
    }
    rep["suggestions"] = suggestions(rep, trace, th)
    return rep


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


def suggestions(rep: dict, trace: Trace, th: Thresholds) -> list[dict]:
    """Concrete changes, each with the metric and threshold that triggered it."""
    out = []
    s = rep["summary"]
    b = rep.get("buckets") or {}
    comp = [c for c in b.get("compressors", []) if c != "none"]

    def add(id_: str, metric: str, value: float, threshold: float, msg: str) -> None:
        out.append({"id": id_, "metric": metric, "value": value, "threshold": threshold, "message": msg})

    if s["comm_share_max"] > th.comm_share:
        worst = max(rep["ranks"], key=lambda r: r["comm_share"])
        already = f" (already compressing with {', '.join(comp)}: raise its compression rate)" if comp else ""
        add("communication", "comm_share", s["comm_share_max"], th.comm_share,
            f"Communication is in flight for {_pct(worst['comm_share'])} of rank {worst['rank']}'s step (over "
            f"{_pct(th.comm_share)}): compress gradients with compression_hook / GradientSynchronizer(compressor="
            f"PowerSGD(4) or TopK or Quantize(8)){already}; use larger buckets (bucket_mb / DDP bucket_cap_mb) to "
            "cut per-message latency; across nodes, hierarchical_all_reduce keeps most bytes on the fast links.",
        )  # fmt: skip
    ov = s["overlap"]
    if ov is not None and ov < th.overlap and s["comm_share"] >= th.overlap_min_comm:
        add("overlap", "overlap", ov, th.overlap,
            f"Only {_pct(ov)} of communication overlaps work (below {_pct(th.overlap)}): start buckets during "
            "backward (GradientSynchronizer(overlap=True) or a DDP comm hook instead of an all-reduce after "
            "backward), with a small first bucket (first_bucket_mb) so communication starts early.")  # fmt: skip
    if s["compression_share"] > th.compression:
        add("compression", "compression_share", s["compression_share"], th.compression,
            f"Compression takes {_pct(s['compression_share'])} of the step (over {_pct(th.compression)}): run the "
            "compression kernels on the GPU (triton provider), switch to a cheaper compressor (FP16/BF16 or "
            "Quantize), or compress only large tensors (min_numel, min_compression_rate).")  # fmt: skip
    if s["idle_share"] > th.idle:
        add("idle", "idle_share", s["idle_share"], th.idle,
            f"Ranks are idle for {_pct(s['idle_share'])} of the step (over {_pct(th.idle)}): look at the gaps in "
            "`torsh timeline` for host stalls (data loading, .item() or .cpu() synchronisations, logging).",
        )  # fmt: skip
    if s["memory_share"] > th.memory:
        add("memory", "memory_share", s["memory_share"], th.memory,
            f"Copies are exposed for {_pct(s['memory_share'])} of the step (over {_pct(th.memory)}): prefetch "
            "offloaded state earlier (ParameterOffloader prefetch) and keep host buffers pinned.")  # fmt: skip
    for r in rep["stragglers"]:
        if r["straggler"]:
            add("straggler", "median_late_ms", r["median_late_ms"], r["threshold_ms"],
                f"Rank {r['rank']} starts {_pct(r['latest_fraction'])} of its collectives last, by a median "
                f"{r['median_late_ms']:.3f} ms: the others wait for it. Check its data loading, host load and "
                "input sizes (uneven batches or MoE routing).")  # fmt: skip
    if b and b.get("per_step") and b["per_step"] > th.many_buckets and b["median_bytes"] < th.small_bucket_bytes:
        add("buckets", "median_bucket_bytes", b["median_bytes"], th.small_bucket_bytes,
            f"{b['per_step']:.0f} buckets per step with a median of {b['median_bytes'] / 1024:.0f} KiB: each "
            "collective pays a fixed latency; raise bucket_mb (DDP: bucket_cap_mb).")  # fmt: skip
    return out


def print_labels(rep: dict, console) -> None:
    """The per-label table (steps grouped by their ``label``), when the steps carry several labels."""
    from rich.table import Table

    if not rep["labels"]:
        return
    tl = Table(title="by step label (mean over ranks)", title_justify="left")
    for c in ("label", "steps/rank", "ms/step", "compute", "compression", "comm exposed", "idle", "comm share",
              "overlap", "wire bytes/step"):  # fmt: skip
        tl.add_column(c, justify="left" if c == "label" else "right")
    for lab, rows in rep["labels"].items():
        rows = [r for r in rows if r["window_ms"] > 0]
        if not rows:
            continue
        n = statistics.fmean(r["steps"] for r in rows) or 1
        w = sum(r["window_ms"] for r in rows)
        comm = sum(r["comm_ms"] for r in rows)
        ov = sum((r["overlap"] or 0) * r["comm_ms"] for r in rows) / comm if comm else None
        tl.add_row(lab, f"{n:.0f}", f"{w / len(rows) / n:.3f}", _pct(sum(r["compute_ms"] for r in rows) / w),
                   _pct(sum(r["compression_ms"] for r in rows) / w),
                   _pct(sum(r["communication_ms"] for r in rows) / w), _pct(sum(r["idle_ms"] for r in rows) / w),
                   _pct(comm / w), "-" if ov is None else _pct(ov),
                   f"{statistics.fmean(r['wire_bytes'] for r in rows) / n / 1024:.1f} KiB")  # fmt: skip
    console.print(tl)


def print_report(rep: dict, console) -> None:
    from rich.table import Table

    s = rep["summary"]
    over = rep["window"]["over"]
    title = f"torsh report: {s['ranks']} rank(s) ({', '.join(s['sources'])}), over {over}"
    if rep["window"]["step"] is not None:
        title += f" (step {rep['window']['step']})"
    if s["step_ms_median"] is not None:
        title += f"; median step {s['step_ms_median']:.3f} ms"
    t = Table(title=title, title_justify="left")
    cols = ("rank", "time ms", "steps", "compute", "compression", "memory", "comm exposed", "idle", "comm share",
            "overlap", "collectives")  # fmt: skip
    for c in cols:
        t.add_column(c, justify="left" if c == "rank" else "right")
    for b in rep["ranks"]:
        w = b["window_ms"] or 1.0
        t.add_row(str(b["rank"]), f"{b['window_ms']:.3f}", str(b["steps"]), _pct(b["compute_ms"] / w),
                  _pct(b["compression_ms"] / w), _pct(b["memory_ms"] / w), _pct(b["communication_ms"] / w),
                  _pct(b["idle_ms"] / w), _pct(b["comm_share"]),
                  "-" if b["overlap"] is None else _pct(b["overlap"]), str(b["collectives"]))  # fmt: skip
    console.print(t)
    print_labels(rep, console)
    if rep["stragglers"]:
        ts = Table(title="collective start lateness (vs the earliest rank, same collective)", title_justify="left")
        for c in ("rank", "collectives", "median late ms", "max late ms", "starts last", "straggler"):
            ts.add_column(c, justify="left" if c == "rank" else "right")
        for r in rep["stragglers"]:
            ts.add_row(str(r["rank"]), str(r["collectives"]), f"{r['median_late_ms']:.3f}", f"{r['max_late_ms']:.3f}",
                       _pct(r["latest_fraction"]), "YES" if r["straggler"] else "no")  # fmt: skip
        console.print(ts)
    console.print(f"communication share {_pct(s['comm_share'])} of step time (mean over ranks; max "
                  f"{_pct(s['comm_share_max'])}), overlap {'-' if s['overlap'] is None else _pct(s['overlap'])}, "
                  f"exposed communication {_pct(s['exposed_comm_share'])}, compression "
                  f"{_pct(s['compression_share'])}, idle {_pct(s['idle_share'])}")  # fmt: skip
    if rep["suggestions"]:
        console.print("[bold]suggestions[/bold]")
        for i, sg in enumerate(rep["suggestions"], 1):
            console.print(f"{i}. ({sg['id']}) {sg['message']}", markup=False)
    else:
        console.print("no suggestions: every measure is within its threshold")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("trace", help="a trace file (.json, .json.gz) or a directory of per-rank files")
    ap.add_argument("--step", type=int, default=None, help="report on step N only")
    ap.add_argument("--window", default=None, help="report on a time window, e.g. 120ms:180ms")
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    ap.add_argument("--width", type=int, default=None, help="columns (default: the terminal's)")


def run(a: argparse.Namespace) -> int:
    from .viewer import make_console, parse_window

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
        print(f"torsh report: {e}", file=sys.stderr)
        return 2
    if a.json:
        print(json.dumps(rep, indent=2))
    else:
        print_report(rep, make_console(a.width))
    return 0
