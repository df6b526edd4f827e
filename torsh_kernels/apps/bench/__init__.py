"""Benchmark harness shared by the suites: timing, copy bandwidth, environment metadata, tables, JSON.

Benchmarks are not tests: they report time, GB/s and the ratio to this machine's measured copy
bandwidth, side by side with the peer implementations, and can write JSON for later comparison.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..._env import (  # noqa: F401  (the suites' shared helpers)
    Timing,
    device_name,
    environment,
    fmt_bytes,
    git_commit,
    quantile,
    time_interleaved,
    versions,
    wide_console,
)
from ...ops.registry import can_run


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
    """Best peer's median time divided by this one's (ours only)."""
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
            peers = [p.timing.median_ms for p in results if p.kind == "peer" and (p.case, p.op) == (r.case, r.op)]
            if peers:
                r.speedup_vs_best_peer = min(peers) / r.timing.median_ms


class Case:
    """One benchmark case: implementations added with what they move, then timed per op, each op's
    implementations interleaved with each other and with the case's copy baseline (added first)."""

    def __init__(self, title: str, device: torch.device) -> None:
        self.title, self.device = title, device
        self.results: list[Result] = []
        self.fns: list[Callable[[], object]] = []

    def add(self, op: str, impl: str, kind: str, fn: Callable[[], object], moved: int, **extra) -> None:
        self.fns.append(fn)
        t0 = Timing(median_ms=0.0, p20_ms=0.0, p80_ms=0.0, reps=0)
        self.results.append(Result(case=self.title, op=op, impl=impl, kind=kind, bytes_moved=moved, timing=t0,
                                   extra=extra))  # fmt: skip

    def time(self, reps: int) -> list[Result]:
        for op in dict.fromkeys(r.op for r in self.results if r.kind != "copy"):
            idx = [0] + [i for i, r in enumerate(self.results) if r.op == op]
            for i, t in zip(idx, time_interleaved([self.fns[i] for i in idx], self.device, reps=reps)):
                if i == 0 and self.results[0].timing.reps:  # keep every copy measurement: the best median
                    t = min(t, self.results[0].timing, key=lambda x: x.median_ms)
                self.results[i].timing = t
        finish(self.results)
        return self.results


def print_tables(results: list[Result], title: str, env: dict) -> None:
    from rich.table import Table

    console = wide_console(132)
    console.print(f"[bold]{title}[/bold] on {env['device']}  (torch {env['versions']['torch']})")
    for case in dict.fromkeys(r.case for r in results):
        table = Table(title=case, title_justify="left")
        notes = any(r.extra.get("note") for r in results if r.case == case)
        for col, just in [("op", "left"), ("implementation", "left"), ("median", "right"), ("p20-p80", "right"),
                          ("GB/s", "right"), ("of copy", "right"), ("vs best peer", "right")]:  # fmt: skip
            table.add_column(col, justify=just)
        if notes:
            table.add_column("notes", justify="left")
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
            if notes:
                cells.append(r.extra.get("note", ""))
            table.add_row(*cells, style=style)
        console.print(table)


def check_providers(suite: str, requested: str | None, device: torch.device) -> list[str] | None:
    """The providers a suite times (default: those running compiled code on ``device``), or None after
    printing why a requested one cannot run."""
    from .bucket import native_providers  # bucket imports this module

    providers = requested.split(",") if requested else native_providers(device)
    for p in providers:
        why = can_run(p, device)
        if why is not None:
            print(f"torsh bench {suite}: provider {p!r} cannot run on {device.type} here: {why}", file=sys.stderr)
            return None
    return providers


def write_json(path: str | Path, suite: str, env: dict, results: list[Result], config: dict) -> None:
    data = {"suite": suite, **env, "config": config, "results": [asdict(r) for r in results]}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(data, indent=1) + "\n")
