"""What the timeline instrumentation costs: per call, with no recorder active and with one recording.

The instrumented layers read ``torsh_kernels.recording.recorder`` on every op launch, collective, bucket and
compression round and do nothing else when it is None. Each case times a loop of ``--calls`` calls,
``--reps`` times, the implementations interleaved, and reports the median nanoseconds per call:

- ``op dispatch``: ``Op.__call__`` of a registered op whose implementation does nothing (so the
  dispatch is all that is timed), against the same call without the check (the peer: what dispatch
  cost before instrumentation), and with a recorder active (a span recorded per call);
- ``user span``: ``with timeline.record("x"): pass`` with no recorder, against ``contextlib.nullcontext``
  and with a recorder active; ``timeline.step`` likewise;
- ``flatten``: the public ``flatten`` of 3 small tensors (the whole op path: validation, custom op,
  selection, launch) with no recorder against a recorder active.

The target (issue 8): the instrumentation costs < 1 us per call with no recorder active, i.e. the
``no recorder`` row minus its uninstrumented peer.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Callable

import torch

from ... import cli_common, recording
from ...ops import flatten
from ...ops.registry import Op
from ...profiling import timeline
from . import Result, Timing, emit, environment, quantile, result_doc

TARGET_NS = 1000.0


def _loop_ns(fn: Callable[[], object], calls: int) -> float:
    t0 = time.perf_counter_ns()
    for _ in range(calls):
        fn()
    return (time.perf_counter_ns() - t0) / calls


def _time(fns: dict[str, Callable[[], object]], calls: int, reps: int) -> dict[str, list[float]]:
    """Per-call ns of each function, ``reps`` loops each, interleaved in rotating order."""
    names = list(fns)
    out: dict[str, list[float]] = {n: [] for n in names}
    for n in names:  # warm up
        _loop_ns(fns[n], max(1, calls // 10))
    for rep in range(reps):
        for j in range(len(names)):
            n = names[(rep + j) % len(names)]
            out[n].append(_loop_ns(fns[n], calls))
    return out


def _with(cm_factory: Callable[[], object]) -> Callable[[], None]:
    def fn() -> None:
        with cm_factory():
            pass

    return fn


def measure(calls: int, reps: int) -> list[tuple[str, str, str, list[float]]]:
    """(case, impl, kind, per-call ns samples) rows."""
    assert recording.recorder is None, "a recorder is active; the no-recorder cases would measure it"
    op = Op("bench_noop")

    @op.register("torch")
    def _noop(x):
        return x

    impl = op.impls["torch"]

    def uninstrumented(provider: str, *args: object) -> object:  # Op.__call__ before the trace check
        return op.impls[provider](*args)

    x = torch.zeros(4)
    cases = {
        "op dispatch": {
            ("Op.__call__, no recorder", "ours"): lambda: op("torch", x),
            ("dispatch without the trace check", "peer"): lambda: uninstrumented("torch", x),
            ("direct call of the implementation", "peer"): lambda: impl(x),
        },
        "user span": {
            ("timeline.record, no recorder", "ours"): _with(lambda: timeline.record("x")),
            ("timeline.step, no recorder", "ours"): _with(lambda: timeline.step(1)),
            ("contextlib.nullcontext", "peer"): _with(contextlib.nullcontext),
        },
    }
    rows = []
    for case, fns in cases.items():
        res = _time(dict(fns), calls, reps)
        rows += [(case, name, kind, res[(name, kind)]) for (name, kind) in fns]
    # with a recorder: it is installed around each timed loop and its events cleared before it
    rec = timeline.Recorder(max_events=10**9, cuda=False)
    small = [torch.randn(7), torch.randn(5, 3), torch.randn(11)]
    recorded = [
        ("op dispatch", "Op.__call__, recorder active", lambda: op("torch", x), calls, True),
        ("user span", "timeline.record, recorder active", _with(lambda: timeline.record("x")), calls, True),
        ("flatten", "flatten, no recorder", lambda: flatten(small), calls // 20, False),
        ("flatten", "flatten, recorder active", lambda: flatten(small), calls // 20, True),
    ]
    samples: list[list[float]] = [[] for _ in recorded]
    for _, _, fn, n, _ in recorded:
        _loop_ns(fn, max(1, n // 10))
    for rep in range(reps):
        for j in range(len(recorded)):
            i = (rep + j) % len(recorded)
            _, _, fn, n, on = recorded[i]
            rec._events.clear()
            recording.recorder = rec if on else None
            try:
                samples[i].append(_loop_ns(fn, n))
            finally:
                recording.recorder = None
    rec._events.clear()
    rows += [(case, name, "recording" if on else "ours", samples[i]) for i, (case, name, _, _, on) in
             enumerate(recorded)]  # fmt: skip
    return rows


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--calls", type=cli_common.int_at_least(100), default=200_000,
                    help="calls per timed loop (default 200000)")  # fmt: skip
    ap.add_argument(
        "--reps", type=cli_common.int_at_least(1), default=7, help="timed loops per implementation (default 7)"
    )
    cli_common.add_json(ap)


def run(a: argparse.Namespace) -> int:
    env = environment(torch.device("cpu"))
    rows = measure(a.calls, a.reps)
    results = []
    for case, name, kind, ns in rows:
        t = Timing(median_ms=statistics.median(ns) / 1e6, p20_ms=quantile(ns, 0.2) / 1e6,
                   p80_ms=quantile(ns, 0.8) / 1e6, reps=len(ns))  # fmt: skip
        results.append(Result(case=case, op=case, impl=name, kind=kind if kind != "recording" else "ours",
                              bytes_moved=0, timing=t, extra={"ns_per_call": statistics.median(ns),
                                                              "recording": kind == "recording"}))  # fmt: skip
    med = {(r.case, r.impl): r.extra["ns_per_call"] for r in results}
    cost_op = (
        med[("op dispatch", "Op.__call__, no recorder")] - med[("op dispatch", "dispatch without the trace check")]
    )
    cost_span = med[("user span", "timeline.record, no recorder")] - med[("user span", "contextlib.nullcontext")]
    summary = {"instrumentation_ns_op_dispatch": cost_op, "instrumentation_ns_user_span": cost_span,
               "target_ns": TARGET_NS, "met": max(cost_op, cost_span) < TARGET_NS}  # fmt: skip
    console = cli_common.console()
    console.print(f"[bold]timeline instrumentation cost[/bold] on {env['device']} (torch {env['versions']['torch']}), "
                  f"{a.reps} loops of {a.calls} calls")  # fmt: skip
    t = cli_common.table(None, ["case", "implementation", "ns / call", "p20-p80"], text=("case", "implementation"))
    for r in results:
        ns = r.extra["ns_per_call"]
        t.add_row(r.case, r.impl, f"{ns:,.0f}", f"{r.timing.p20_ms * 1e6:,.0f}-{r.timing.p80_ms * 1e6:,.0f}",
                  style="bold" if r.kind == "ours" and not r.extra["recording"] else None)  # fmt: skip
    console.print(t)
    console.print(f"instrumentation with no recorder: {cost_op:+.0f} ns per op dispatch, {cost_span:+.0f} ns per "
                  f"user span (target < {TARGET_NS:.0f} ns): {'met' if summary['met'] else 'NOT met'}")  # fmt: skip
    emit(a, result_doc("trace", env, results, {"calls": a.calls, "reps": a.reps, "summary": summary}))
    return 0
