"""Environment and timing helpers that several layers share: which machine and library versions a result
or a trace comes from, interleaved timing with caches flushed, the judgement of one timing against another
beyond their spread (:func:`compare_spread`), byte and quantile formatting. Imports only torch, the
standard library and the error types. (The console the commands print with is in ``cli_common``.)"""

from __future__ import annotations

import datetime as _dt
import importlib.metadata
import math
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import InvalidArgumentError

# the version has its own torch-free module (torsh --version imports no torch); its names stay importable here
from .version import DIST, UNKNOWN_VERSION, __version__, own_version  # noqa: F401


def package_version(dist: str) -> str | None:
    """The installed version of distribution ``dist``, or None (read from metadata: nothing is imported)."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


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


SpreadLike = Timing | Sequence[float]
"""What :func:`compare_spread` takes for one side: a :class:`Timing` (its p20-p80 interval) or the samples."""

VERDICTS = ("faster", "slower", "within noise")


@dataclass(frozen=True, slots=True)
class SpreadComparison:
    """How one measurement (``a``) compares with another (``b``): see :func:`compare_spread`."""

    verdict: str
    """"faster" (``a`` is), "slower" (``a`` is) or "within noise"."""
    a: tuple[float, float, float]
    """``a``'s (p20, median, p80) in ms."""
    b: tuple[float, float, float]
    """``b``'s (p20, median, p80) in ms."""
    ratio: float
    """``a``'s median / ``b``'s median (inf where ``b``'s is 0)."""

    def interval(self, which: str = "a") -> str:
        """One side's ``p20-p80`` interval, for a table."""
        lo, _, hi = getattr(self, which)
        return f"{lo:.4g}-{hi:.4g} ms"


def spread(x: SpreadLike) -> tuple[float, float, float]:
    """(p20, median, p80) of a :class:`Timing` or of samples (at least one)."""
    if isinstance(x, Timing):
        return (x.p20_ms, x.median_ms, x.p80_ms)
    xs = [float(v) for v in x]
    if not xs:
        raise InvalidArgumentError("compare_spread: a side has no samples")
    return (quantile(xs, 0.2), statistics.median(xs), quantile(xs, 0.8))


def compare_spread(a: SpreadLike, b: SpreadLike, *, margin: float = 0.0) -> SpreadComparison:
    """Whether ``a`` is faster or slower than ``b`` beyond the measured spread, the one rule the tuner (a
    winner is cached only when faster than the default) and ``torsh bench --compare`` (a regression) judge by.

    Each side's interval is its p20-p80 (of the samples, or the :class:`Timing`'s). ``a`` is "slower" when
    its interval lies wholly above ``b``'s (a's p20 > b's p80) and its median is more than ``1 + margin``
    times b's; "faster" in the mirror case (a's p80 < b's p20 and b's median more than ``1 + margin`` times
    a's); anything else, overlapping intervals included, is "within noise": one slow repetition or a busy
    machine moves a median, rarely a whole interval of interleaved repetitions."""
    if not (isinstance(margin, (int, float)) and margin >= 0 and math.isfinite(margin)):
        raise InvalidArgumentError(f"compare_spread: margin={margin!r} must be a finite fraction >= 0")
    sa, sb = spread(a), spread(b)
    for name, s in (("a", sa), ("b", sb)):
        if not all(math.isfinite(v) and v >= 0 for v in s) or not s[0] <= s[1] <= s[2]:
            raise InvalidArgumentError(f"compare_spread: {name}'s (p20, median, p80) {s} are not ordered times in ms")
    ratio = sa[1] / sb[1] if sb[1] > 0 else (math.inf if sa[1] > 0 else 1.0)
    if sa[0] > sb[2] and sa[1] > (1 + margin) * sb[1]:
        verdict = "slower"
    elif sa[2] < sb[0] and sb[1] > (1 + margin) * sa[1]:
        verdict = "faster"
    else:
        verdict = "within noise"
    return SpreadComparison(verdict=verdict, a=sa, b=sb, ratio=ratio)


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
    return {
        "torsh_kernels": __version__,
        "torch": torch.__version__,
        "triton": package_version("triton"),
        "numba": package_version("numba"),
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
