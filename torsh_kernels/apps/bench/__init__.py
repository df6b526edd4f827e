"""Benchmark harness shared by the suites: timing, copy bandwidth, environment metadata, tables, JSON.

Benchmarks are not tests: they report time, GB/s and the ratio to this machine's measured copy
bandwidth, side by side with the peer implementations, and can write JSON for later comparison.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from ... import cli_common
from ...env import (  # noqa: F401  (the suites' shared helpers)
    Timing,
    device_name,
    environment,
    fmt_bytes,
    git_commit,
    quantile,
    time_interleaved,
    versions,
)
from ...ops import registry


@dataclass(kw_only=True, slots=True)
class Result:
    """One benchmarked implementation of one op on one case."""

    case: str
    """Case name, e.g. 'a: 200 mixed tensors, 100 MiB'."""
    op: str
    """Operation: flatten, unflatten, bucket_reduce or copy."""
    impl: str
    """Implementation, e.g. 'torsh[triton]' or a peer's name."""
    kind: str
    """'ours', 'peer' or 'copy' (the bandwidth baseline)."""
    bytes_moved: int
    """Bytes read plus bytes written by one call."""
    timing: Timing
    """Measured time."""
    gbps: float = 0.0
    """bytes_moved / median time, in GB/s (1e9 bytes per second)."""
    ratio_to_copy: float = 0.0
    """gbps divided by the copy baseline's GB/s in the same run."""
    speedup_vs_best_peer: float | None = None
    """Best peer's median time divided by this one's (ours only): the best of ``peers`` where the row names
    them, else of every peer of its op."""
    peers: list[str] | None = None
    """Ours only: the impls of the peers this row is compared with like for like (the same algorithm, e.g.
    an approximate top-k against a sampled-threshold top-k in plain torch); None: every peer of its op."""
    best_peer: str | None = None
    """Ours only: the impl of the peer ``speedup_vs_best_peer`` is over."""
    speedups: dict[str, float] = field(default_factory=dict)
    """Ours only: each peer of its op (like for like or not) -> that peer's median time over this one's."""
    extra: dict = field(default_factory=dict)
    """Anything else worth recording."""


def finish(results: list[Result]) -> None:
    """Fill GB/s, ratio to copy and speedup over the best peer, per (case, op)."""
    copies = {r.case: r for r in results if r.kind == "copy"}
    for r in results:
        r.gbps = r.bytes_moved / (r.timing.median_ms * 1e-3) / 1e9
    for r in results:
        c = copies.get(r.case)
        r.ratio_to_copy = r.gbps / c.gbps if c else float("nan")
        if r.kind == "ours":
            peers = [p for p in results if p.kind == "peer" and (p.case, p.op) == (r.case, r.op)]
            r.speedups = {p.impl: p.timing.median_ms / r.timing.median_ms for p in peers}
            like = [p for p in peers if r.peers is None or p.impl in r.peers]
            if like:
                best = min(like, key=lambda p: p.timing.median_ms)
                r.speedup_vs_best_peer, r.best_peer = r.speedups[best.impl], best.impl


class Case:
    """One benchmark case: implementations added with what they move, then timed per op, each op's
    implementations interleaved with each other and with the case's copy baseline (added first)."""

    def __init__(self, title: str, device: torch.device) -> None:
        self.title, self.device = title, device
        self.results: list[Result] = []
        self.fns: list[Callable[[], object]] = []

    def add(self, op: str, impl: str, kind: str, fn: Callable[[], object], moved: int,
            peers: list[str] | None = None, **extra) -> None:  # fmt: skip
        """``peers`` (ours only): the impls of this op's peers the row is compared with like for like (each
        added to the case before :meth:`time`); default: every peer of the op."""
        if peers is not None and kind != "ours":
            raise ValueError(f"{impl!r}: only a row of ours names the peers it is compared with")
        self.fns.append(fn)
        t0 = Timing(median_ms=0.0, p20_ms=0.0, p80_ms=0.0, reps=0)
        self.results.append(Result(case=self.title, op=op, impl=impl, kind=kind, bytes_moved=moved, timing=t0,
                                   peers=list(peers) if peers is not None else None, extra=extra))  # fmt: skip

    def time(self, reps: int) -> list[Result]:
        for r in self.results:
            have = {p.impl for p in self.results if p.kind == "peer" and p.op == r.op}
            if r.peers is not None and (missing := [p for p in r.peers if p not in have]):
                raise ValueError(f"{r.op} / {r.impl}: no peer {', '.join(map(repr, missing))} in this op")
        for op in dict.fromkeys(r.op for r in self.results if r.kind != "copy"):
            idx = [0] + [i for i, r in enumerate(self.results) if r.op == op]
            for i, t in zip(idx, time_interleaved([self.fns[i] for i in idx], self.device, reps=reps)):
                if i == 0 and self.results[0].timing.reps:  # keep every copy measurement: the best median
                    t = min(t, self.results[0].timing, key=lambda x: x.median_ms)
                self.results[i].timing = t
        finish(self.results)
        return self.results


def print_tables(results: list[Result], title: str, env: dict) -> None:
    console = cli_common.console()
    console.print(f"[bold]{title}[/bold] on {env['device']}  (torch {env['versions']['torch']})")
    for case in dict.fromkeys(r.case for r in results):
        notes = any(r.extra.get("note") for r in results if r.case == case)
        # which peer each ratio is over, where a row names its like-for-like peers or its op has several
        named = any(r.peers is not None or len(r.speedups) > 1 for r in results if r.case == case)
        cols = ["op", "implementation", "median", "p20-p80", "GB/s", "of copy", "vs best peer"]
        cols += ["over (like for like)"] if named else []
        table = cli_common.table(case, cols + (["notes"] if notes else []),
                                 text=("op", "implementation", "over (like for like)", "notes"))  # fmt: skip
        last_op = None
        for r in (r for r in results if r.case == case):
            if last_op is not None and r.op != last_op:
                table.add_section()
            last_op = r.op
            t = r.timing
            speed = f"{r.speedup_vs_best_peer:.2f}x" if r.speedup_vs_best_peer is not None else ""
            style = "bold" if r.kind == "ours" else ("dim" if r.kind == "copy" else None)
            cells = [r.op, r.impl, f"{t.median_ms:.3f} ms", f"{t.p20_ms:.3f}-{t.p80_ms:.3f}", f"{r.gbps:.1f}",
                     f"{100 * r.ratio_to_copy:.0f}%", speed]  # fmt: skip
            if named:
                cells.append(r.best_peer or "")
            if notes:
                cells.append(r.extra.get("note", ""))
            table.add_row(*cells, style=style)
        console.print(table)


def native_providers(device: torch.device) -> list[str]:
    """Providers that run compiled code on ``device`` (not the interpreter or the simulator)."""
    out = []
    for p in registry.PROVIDERS:
        if registry.can_run(p, device) is not None:
            continue
        if p == "triton" and registry.triton_state()[1]:
            continue
        if p == "numba" and registry.numba_state()[1]:
            continue
        out.append(p)
    return out


def add_providers(p: argparse.ArgumentParser, verb: str = "time") -> None:
    """``--providers a,b``: which providers to ``verb`` (default: those running compiled code here)."""
    p.add_argument("--providers", default=None, type=cli_common.choice_list(registry.PROVIDERS, "provider"),
                   help=f"comma-separated providers to {verb}, from {', '.join(registry.PROVIDERS)} (default: those "
                   "running compiled code here; one that cannot run here is refused, with why)")  # fmt: skip


def select_providers(prog: str, requested: list[str] | None, device: torch.device, verb: str = "timing") -> list[str]:
    """The providers a command uses on ``device``. Named ones (``--providers``) must all run here: one that
    cannot is a :class:`~torsh_kernels.cli_common.UsageError` that says why and how to enable it. The default is
    the providers running compiled code here; the others are named on one line of stderr."""
    if requested:
        for p in requested:
            why = registry.can_run(p, device)
            if why is not None:
                raise cli_common.UsageError(f"--providers: {p} cannot run on {device.type} here: {why}")
        return list(requested)
    chosen = native_providers(device)
    left = [p for p in registry.PROVIDERS if p not in chosen]
    if left:
        print(f"{prog}: {verb} {', '.join(chosen)}; not {', '.join(left)}: no compiled code for {device.type} here "
              "('torsh providers' says why; name them in --providers to use them where they can run)",
              file=sys.stderr)  # fmt: skip
    return chosen


def add_device(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default=None, type=cli_common.device, help="cuda or cpu (default: cuda when available)")


def resolve_device(requested: torch.device | None) -> torch.device:
    return requested or torch.device("cuda" if torch.cuda.is_available() else "cpu")


def emit(args: argparse.Namespace, doc: dict) -> None:
    """A suite's JSON document: the options it ran with are added (a baseline replays them), then it is
    handed to the harness (when the harness runs the suite) and written where ``--json`` says."""
    options = getattr(args, "options", None)
    if options is not None:
        doc["options"] = list(options)
    sink = getattr(args, "sink", None)
    if sink is not None:
        sink.append(doc)
    cli_common.write_json(args.json, doc)


def result_doc(suite: str, env: dict, results: list[Result], config: dict) -> dict:
    """The JSON document of a suite made of :class:`Result` rows."""
    return {"suite": suite, **env, "config": config, "results": [asdict(r) for r in results]}
