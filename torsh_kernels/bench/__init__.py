"""Benchmark harness shared by the suites: timing, copy bandwidth, environment metadata, tables, JSON.

Benchmarks are not tests: they report time, GB/s and the ratio to this machine's measured copy
bandwidth, side by side with the peer implementations, and can write JSON for later comparison.
"""

from __future__ import annotations

import datetime as _dt
import json
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..ops.registry import _version, can_run


@dataclass(kw_only=True, slots=True)
class Timing:
    """Per-call wall time of one implementation, over several repetitions."""

    median_ms: float
    """Median time of one call, in milliseconds."""
    p20_ms: float
    """20th percentile, in milliseconds."""
    p80_ms: float
    """80th percentile, in milliseconds."""
    reps: int
    """Number of timed repetitions."""


def quantile(xs: list[float], q: float) -> float:
    """The q-quantile of xs, interpolated between neighbours."""
    xs = sorted(xs)
    pos = q * (len(xs) - 1)
    lo, hi = int(pos), min(int(pos) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def fmt_bytes(n: float) -> str:
    """A byte count in B, KiB, MiB or GiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.4g} {unit}"
        n /= 1024
    return str(n)


class _Flusher:
    """Evicts caches between repetitions by writing a buffer larger than the last-level cache."""

    def __init__(self, device: torch.device) -> None:
        nbytes = (256 if device.type == "cuda" else 64) << 20
        self.buf = torch.empty(nbytes // 4, dtype=torch.float32, device=device)

    def __call__(self) -> None:
        self.buf.fill_(1.0)


def time_interleaved(
    fns: list[Callable[[], object]], device: torch.device, *, warmup: int = 3, reps: int = 10
) -> list[Timing]:
    """Time each of ``fns``, one call per repetition with caches flushed before it, interleaving the
    implementations (each repetition runs every one once, in rotating order) so that drift in clock
    speed or background load falls on all of them alike. CUDA events on GPU, a monotonic clock on CPU."""
    flush = _Flusher(device)
    for fn in fns:
        for _ in range(warmup):
            fn()
    n = len(fns)
    times: list[list[float]] = [[] for _ in fns]
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    pending = []
    for rep in range(reps):
        for j in range(n):
            i = (rep + j) % n
            flush()
            if cuda:
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                fns[i]()
                e.record()
                pending.append((i, s, e))
            else:
                t0 = time.perf_counter()
                fns[i]()
                times[i].append((time.perf_counter() - t0) * 1e3)
    if cuda:
        torch.cuda.synchronize(device)
        for i, s, e in pending:
            times[i].append(s.elapsed_time(e))
    return [
        Timing(median_ms=statistics.median(t), p20_ms=quantile(t, 0.2), p80_ms=quantile(t, 0.8), reps=reps)
        for t in times
    ]


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"CPU: {cpu} ({torch.get_num_threads()} torch threads)"


def git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, cwd=Path(__file__).parent
        )
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def versions() -> dict[str, str | None]:
    """Versions of torsh-kernels, torch, Triton, Numba, Python and CUDA (benchmark JSON, trace metadata)."""
    from .. import __version__

    return {
        "torsh_kernels": __version__,
        "torch": torch.__version__,
        "triton": _version("triton"),
        "numba": _version("numba"),
        "python": platform.python_version(),
        "cuda": torch.version.cuda,
    }


def environment(device: torch.device) -> dict[str, object]:
    return {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "device": device_name(device),
        "device_type": device.type,
        "versions": versions(),
        "git_commit": git_commit(),
        "host": platform.node(),
    }


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


def wide_console(width: int):
    """A rich console; on logs and pipes at least ``width`` columns, so that no table cell wraps."""
    from rich.console import Console

    console = Console()
    return console if console.is_terminal else Console(width=max(console.width, width))


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
