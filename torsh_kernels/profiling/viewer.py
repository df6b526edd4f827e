"""``torsh timeline TRACE_OR_DIR``: a terminal timeline of one trace file or a directory of per-rank files.

One lane per rank and thread / GPU stream / in-flight collective, on one time axis; each character
cell shows the class that fills most of it (legend below the lanes); then per-rank totals (the
breakdown of :mod:`~torsh_kernels.profiling.analysis`, with the communication share and overlap) and
the top names by total time. Reads torsh traces and torch.profiler (Kineto) traces, gzip too.

Times count from the earliest event of any rank, shown in us, ms, s or min by their magnitude (the axis
says which). Lanes are named by what ran on them: a thread the trace calls ``Dummy-1``, ``Thread-3`` or
by a number is shown as ``autograd``, ``comm hook``, ``offload copy``, ``forward``, ``ops`` (from the
categories and names of its spans), its own name kept in a dim suffix. ``--window 120ms:180ms`` (units
us, ms, s, min; a bare number is ms; either side may be left out), ``--step N`` (the window of step N, from step
markers), ``--rank 0,2``, ``--cat communication`` (a class or a file category), ``--name REGEX``,
``--min-dur 0.5ms``, ``--top N``, ``--width COLUMNS``. ``--interactive``: keys pan (left/right, h/l),
zoom (+/-, i/o), step (n/p), rank (r), reset (0), quit (q); it draws on the terminal's alternate screen
(the shell's screen is back as it was on quit), each frame cut to the terminal's height.
"""

from __future__ import annotations

import argparse
import fnmatch
import math
import re
import sys
from dataclasses import dataclass, field, replace

from .. import cli_common
from ..env import fmt_bytes
from ..errors import InvalidArgumentError, TraceFormatError
from . import analysis as A
from .traces import CLASSES, Span, Trace, load

__all__ = ["GLYPHS", "View", "add_arguments", "fmt_time", "frame", "lane_title", "parse_duration", "parse_window",
           "render", "run", "time_unit"]  # fmt: skip

# class -> (glyph, style): the glyphs differ in shape, so the lanes read without colour too
GLYPHS = {
    "compute": ("█", "green"),
    "compression": ("▓", "magenta"),
    "communication": ("▒", "cyan"),
    "memory": ("░", "yellow"),
    "wait": ("-", "red"),
    "other": ("·", "bright_black"),
}
_UNITS = {"us": 1e-3, "µs": 1e-3, "ms": 1.0, "s": 1e3, "min": 6e4}
LABEL = 24


def parse_duration(text: str, what: str = "duration") -> float:
    """'120ms', '1.5s', '300us', '2min' or '7' (ms) -> milliseconds."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?\d+)?)\s*(us|µs|ms|s|min)?\s*", str(text), re.IGNORECASE)
    if not m:
        raise InvalidArgumentError(f"{what}: cannot read {text!r} as a time; write e.g. 120ms, 1.5s, 2min or 300us")
    return float(m.group(1)) * _UNITS[(m.group(2) or "ms").lower()]


def time_unit(ms: float) -> tuple[str, float]:
    """(unit, milliseconds per unit) that shows ``ms`` with 1 to 3 digits before the point where it can:
    us below 1 ms, ms below 1 s, s below 10 min, min from there."""
    a = abs(ms)
    if a < 1.0:
        return "us", 1e-3
    if a < 1e3:
        return "ms", 1.0
    if a < 6e5:
        return "s", 1e3
    return "min", 6e4


def fmt_time(ms: float, unit: str | None = None, digits: int = 3) -> str:
    """``ms`` in ``unit`` (default: :func:`time_unit`'s), e.g. ``'1.500 s'``."""
    u, f = time_unit(ms) if unit is None else (unit, _UNITS[unit])
    return f"{ms / f:.{digits}f} {u}"


def parse_window(text: str) -> tuple[float | None, float | None]:
    """'120ms:180ms' -> (120.0, 180.0); either side may be empty."""
    if ":" not in text:
        raise InvalidArgumentError(f"--window: expected START:END (e.g. 120ms:180ms), got {text!r}")
    a, b = text.split(":", 1)
    lo = parse_duration(a, "--window start") if a.strip() else None
    hi = parse_duration(b, "--window end") if b.strip() else None
    if lo is not None and hi is not None and hi <= lo:
        raise InvalidArgumentError(f"--window: the end ({b}) must come after the start ({a})")
    return lo, hi


@dataclass(slots=True)
class View:
    """What to show: a time window, filters, and the rank the interactive mode focuses on."""

    start: float | None = None
    """Window start (ms); None: the beginning (or the step's)."""
    end: float | None = None
    """Window end (ms); None: the end (or the step's)."""
    step: int | None = None
    """Show the window of this step (from step markers)."""
    ranks: list[int] | None = None
    """Ranks to show; None: all."""
    cats: set[str] = field(default_factory=set)
    """Classes or file categories to keep; empty: all."""
    name: NameFilter | None = None
    """Keep spans whose name matches."""
    min_dur: float = 0.0
    """Keep spans at least this long (ms)."""
    top: int = 15
    """Rows of the top-N table."""

    def keep(self, s: Span) -> bool:
        if self.ranks is not None and s.rank not in self.ranks:
            return False
        if s.cls == "step":
            return True
        if self.cats and s.cls not in self.cats and s.cat not in self.cats:
            return False
        if self.name is not None and not self.name.search(s.name):
            return False
        return s.dur >= self.min_dur


def resolve_window(trace: Trace, view: View) -> tuple[float, float]:
    """The window's (start, end) in ms."""
    lo, hi = 0.0, trace.end
    if view.step is not None:
        steps = [s for s in trace.steps() if A.step_number(s) == view.step and (view.ranks is None or s.rank in
                                                                                 view.ranks)]  # fmt: skip
        if not steps:
            have = sorted({n for s in trace.steps() if (n := A.step_number(s)) is not None})
            shown = f"{have[:5]}...{have[-5:]}" if len(have) > 10 else str(have)
            raise InvalidArgumentError(
                f"--step {view.step}: the trace has no step {view.step} "
                + (f"(its steps: {shown})" if have else "(it has no step markers: record them with timeline.step)")
            )
        lo, hi = min(s.start for s in steps), max(s.end for s in steps)
    if view.start is not None:
        lo = view.start
    if view.end is not None:
        hi = view.end
    if hi <= lo:
        raise InvalidArgumentError(f"the window {lo:.3f}-{hi:.3f} ms is empty; the trace spans 0-{trace.end:.3f} ms")
    return lo, hi


def _lane_order(trace: Trace, idx: int) -> tuple:
    ln = trace.lanes[idx]
    kind = {"thread": 0, "device": 1, "inflight": 2}[ln.kind]
    main = 0 if ln.name in ("main",) or "python" in ln.name else 1
    bucket = 1 if ln.name.startswith("bucket") else 0
    num = re.findall(r"\d+", ln.name)
    return (ln.rank, kind, bucket, main, int(num[-1]) if num else 0, ln.name)


def _cells(segs: list[tuple[float, float, str]], lo: float, hi: float, width: int) -> list[str | None]:
    """Per cell, the class covering most of it (None: nothing)."""
    cover: list[dict[str, float]] = [{} for _ in range(width)]
    scale = width / (hi - lo)
    for a, b, c in segs:
        a, b = max(a, lo), min(b, hi)
        if b < a or (b == a and not (lo <= a < hi)):
            continue
        i0 = int((a - lo) * scale)
        i1 = min(width - 1, max(i0, math.ceil((b - lo) * scale) - 1))  # cells [a, b) touches
        for i in range(max(0, i0), i1 + 1):
            c0, c1 = lo + i / scale, lo + (i + 1) / scale
            d = cover[i]
            d[c] = d.get(c, 0.0) + max(min(b, c1) - max(a, c0), 1e-9)
    return [max(d, key=d.get) if d else None for d in cover]


def _axis(lo: float, hi: float, width: int) -> tuple[str, str, str]:
    """Tick marks and labels under a time axis of ``width`` cells, and the labels' unit (by the window's
    length: :func:`time_unit`)."""
    unit, f = time_unit(hi - lo)
    lo_u, hi_u = lo / f, hi / f
    span = hi_u - lo_u
    raw = span / max(1, width // 14)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    digits = max(0, -math.floor(math.log10(step) + 1e-9))
    marks, labels = [" "] * width, [" "] * width
    k = math.ceil(lo_u / step - 1e-9)
    while (t := k * step) <= hi_u + 1e-9 * step:
        i = min(width - 1, int((t - lo_u) / span * width))
        marks[i] = "|"
        lab = f"{t:.{digits}f}"
        if all(c == " " for c in labels[max(0, i - 1) : i + len(lab) + 1]) and i + len(lab) <= width:
            labels[i : i + len(lab)] = list(lab)
        k += 1
    return "".join(marks), "".join(labels), unit


def _step_row(steps: list[Span], lo: float, hi: float, width: int) -> str:
    """The steps of one rank as a row: ``─`` over each step, ``[`` at its start and ``[N`` (its number) where
    the label fits whole, left to right: a label that would run into the one before it, end right before a
    step's ``[`` or run past the edge is dropped (its ``[`` stays unless a label covers it). Where steps are
    so dense that this leaves fewer than two numbers, labels hide the ``[`` they cover, one cell after each
    left blank: ``[0 [8 [16``."""
    row = [" "] * width
    scale = width / (hi - lo)
    starts = []
    for s in sorted(steps, key=lambda s: s.start):
        i0 = min(width - 1, max(0, int((max(s.start, lo) - lo) * scale)))
        i1 = min(width - 1, max(i0, math.ceil((min(s.end, hi) - lo) * scale) - 1))
        row[i0 : i1 + 1] = ["─"] * (i1 + 1 - i0)
        if s.start >= lo - 1e-6:  # a step begun before the window has no start here
            starts.append((i0, s))
    for i0, _ in starts:
        row[i0] = "["
    marks = {i for i, c in enumerate(row) if c == "["}
    for dense in (False, True):
        out, free, shown = list(row), 0, 0  # free: the first cell a label may take, one after the previous label
        for i0, s in starts:
            n = A.step_number(s)
            lab = "[" if n is None else f"[{n}"
            end = i0 + len(lab)  # a label may hide later steps' "[" but not end right before one ("[9[")...
            if i0 >= free and end <= width and (end == width or end not in marks or len(lab) == 1 or dense):
                out[i0:end] = list(lab)
                if end < width and end in marks:  # ...unless steps are too dense for that: a gap hides that one
                    out[end] = " "
                free, shown = end + 1, shown + (n is not None)
        if shown >= min(2, len(starts)):
            break
    return "".join(out)


# a thread lane whose name says nothing of what it does: Python's Dummy-N / Thread-N (Thread-N (target) from
# Python 3.10), a bare thread id, or the "pid:tid" of a file without thread names
_ANONYMOUS = re.compile(r"(?:thread )?(?:(?:Dummy|Thread)-\d+(?: \(.*\))?|\d+(?: \(.*\))?|[^\s:]+:\S+)")


_OS_NAMED = re.compile(r"(?:thread )?(\d+) \((.+)\)")
"""A thread id with the name the OS (or Kineto) gave it: the name is kept, the id goes to the dim suffix."""


def lane_purpose(spans: list[Span]) -> str | None:
    """What a thread did, from the categories and names of its spans, strongest first: ``autograd`` (a
    backward pass: torsh's module span ``backward`` or the engine's ``autograd::`` ops), ``offload copy``,
    ``comm hook`` (issuing collectives, buckets, compressing), ``forward``, the name of its recorded
    (``user``) spans, ``ops``, ``wait``; None when nothing there says."""
    cats = {s.cat for s in spans}
    names = {s.name for s in spans}
    if any(s.cat == "module" and s.name == "backward" for s in spans) or any(n.startswith("autograd::") for n in names):
        return "autograd"
    if "offload" in cats:
        return "offload copy"
    if cats & {"issue", "collective", "bucket"} or any(s.cls in ("compression", "communication") for s in spans):
        return "comm hook"
    if "module" in cats:
        return "forward"
    user = [s for s in spans if s.cat == "user"]
    if user:
        by: dict[str, float] = {}
        for s in user:
            by[s.name] = by.get(s.name, 0.0) + s.dur
        return max(by, key=by.get)
    if cats & {"op", "cpu_op"} or any(s.cls == "compute" for s in spans):
        return "ops"
    if "wait" in cats:
        return "wait"
    return None


def lane_title(lane, spans: list[Span]) -> tuple[str, str]:
    """(name, raw id) a lane is shown by: a thread with an anonymous name (:data:`_ANONYMOUS`) takes
    :func:`lane_purpose`'s, its own kept as the raw id (``Dummy-1``); other lanes keep theirs ("")."""
    if lane.kind != "thread" or not _ANONYMOUS.fullmatch(lane.name):
        return lane.name, ""
    named = _OS_NAMED.fullmatch(lane.name)  # Kineto's "thread 123 (pt_gloo_...)": the OS's name says what it is
    if named and not re.fullmatch(r"(?:Dummy|Thread)-\d+(?: \(.*\))?", named[2]):
        return named[2], named[1]
    purpose = lane_purpose(spans)
    raw = re.sub(r" \(.*\)$", "", lane.name.removeprefix("thread "))  # Thread-3 (worker): its target goes
    return (purpose, raw) if purpose else (lane.name, "")


def _lane_label(rank: int, name: str, raw: str):
    """The label column of a lane: ``r0 comm hook (Dummy-1)``, the raw id dim and shortened first."""
    from rich.text import Text

    head = f"r{rank} {name}"[:LABEL]
    t = Text(head)
    room = LABEL - len(head) - 3  # " (" and ")"
    if raw and room >= 2:
        t.append(f" ({raw if len(raw) <= room else raw[: room - 1] + '…'})", style="dim")
    t.append(" " * (LABEL + 1 - len(t.plain)))
    return t


def render(trace: Trace, view: View, console, *, source: str = "") -> dict:
    """Print the lanes, the legend, the per-rank totals and the top-N table; returns what was computed
    (window, breakdowns, top rows) for callers and tests."""
    lanes = render_lanes(trace, view, console, source=source)
    return {**render_tables(trace, view, console), "lanes": lanes}


def _ranks(trace: Trace, view: View) -> list[int]:
    ranks = [r for r in trace.ranks if view.ranks is None or r in view.ranks]
    if not ranks:
        raise InvalidArgumentError(f"--rank {view.ranks}: the trace holds ranks {list(trace.ranks)}")
    return ranks


def render_lanes(trace: Trace, view: View, console, *, source: str = "") -> int:
    """Print the header, the time axis, one row per rank and lane, and the legend; returns the lanes shown."""
    from rich.text import Text

    lo, hi = resolve_window(trace, view)
    width = max(20, console.width - LABEL - 1)
    ranks = _ranks(trace, view)
    kept = [s for s in trace.spans if view.keep(s) and s.end >= lo and s.start <= hi]
    n_ranks = len(trace.ranks)
    srcs = sorted({m.get("source", "?") for m in trace.ranks.values()})
    console.print(Text(f"{source or 'trace'}: {n_ranks} rank(s) ({', '.join(srcs)}), {fmt_time(trace.end)} recorded",
                       style="bold"), soft_wrap=True)  # fmt: skip
    step_note = f", step {view.step}" if view.step is not None else ""
    u, f = time_unit(max(abs(lo), abs(hi)))
    digits = 3 + max(0, math.ceil(-math.log10((hi - lo) / f)))  # the window's length stays readable
    console.print(Text(f"window {lo / f:.{digits}f} - {hi / f:.{digits}f} {u} ({fmt_time(hi - lo)}){step_note}",
                       style="bold"), soft_wrap=True)  # fmt: skip
    marks, labels, axis_unit = _axis(lo, hi, width)
    console.print(Text(" " * LABEL + " " + labels, style="dim"))
    console.print(Text(f"{axis_unit} ".rjust(LABEL) + " " + marks, style="dim"))
    by_lane: dict[int, list[Span]] = {}
    for s in kept:
        by_lane.setdefault(s.lane, []).append(s)
    everything: dict[int, list[Span]] = {}  # a lane's name comes from all its spans, so panning keeps it
    for s in trace.spans:
        everything.setdefault(s.lane, []).append(s)
    shown_lanes = 0
    for r in ranks:
        steps = [s for s in kept if s.rank == r and s.cls == "step"]
        if steps:
            t = Text(f"r{r} steps".ljust(LABEL)[:LABEL] + " ", style="bold")
            t.append(_step_row(steps, lo, hi, width), style="bright_white")
            console.print(t, no_wrap=True, overflow="crop")
        for li in sorted((i for i in by_lane if trace.lanes[i].rank == r), key=lambda i: _lane_order(trace, i)):
            spans = [s for s in by_lane[li] if s.cls != "step" and s.cat != "Trace"]  # not Kineto's whole-run span
            if not spans:
                continue
            ln = trace.lanes[li]
            segs = [(s.start, s.end, s.cls) for s in spans] if ln.kind == "inflight" else A.self_segments(spans)
            cells = _cells(segs, lo, hi, width)
            t = _lane_label(r, *lane_title(ln, everything.get(li, [])))
            for c in cells:
                if c is None:
                    t.append(" ")
                else:
                    g, style = GLYPHS.get(c, GLYPHS["other"])
                    t.append(g, style=style)
            console.print(t, no_wrap=True, overflow="crop")
            shown_lanes += 1
    if not shown_lanes:
        console.print(Text("(no spans match the filters in this window)", style="yellow"))
    legend = Text("legend: ")
    for c, (g, style) in GLYPHS.items():
        legend.append(g * 2, style=style)
        legend.append(f" {c}  ")
    legend.append("(blank: unrecorded, no span)")
    console.print(legend)
    return shown_lanes


def render_tables(trace: Trace, view: View, console) -> dict:
    """Print the per-rank totals and the top-N table for the view's window; returns the window, the
    breakdowns and the top rows."""
    lo, hi = resolve_window(trace, view)
    ranks = _ranks(trace, view)
    kept = [s for s in trace.spans if view.keep(s) and s.end >= lo and s.start <= hi]

    # per-rank totals: over the rank's steps (all, or step N) when no explicit window is given, else over the
    # window; the same windows `torsh report` uses. They ignore the name/cat filters: it is the rank's time.
    explicit = view.start is not None or view.end is not None
    wins = {r: [(lo, hi)] if explicit else A.intersect(A.windows(trace, r, step=view.step), [(lo, hi)])
            for r in ranks}  # fmt: skip
    bds = [A.breakdown(trace, r, wins[r]) for r in ranks]
    over = "the window" if explicit else ("its steps" if trace.steps() else "its recorded extent")
    title = (f"per-rank totals over {over}, ms (exclusive: compute > compression > memory > exposed communication "
             "(comm exp) > unrecorded (no span, not always idle); in flight: any collective in flight)")  # fmt: skip
    tt = cli_common.table(title, ["rank", "time", "compute", "compress", "memory", "comm exp", "unrecorded",
                                  "in flight", "comm share", "overlap", "colls", "wire"], text=("rank",))  # fmt: skip
    for b in bds:
        tt.add_row(str(b.rank), f"{b.window_ms:.3f}", f"{b.compute_ms:.3f}", f"{b.compression_ms:.3f}",
                   f"{b.memory_ms:.3f}", f"{b.communication_ms:.3f}", f"{b.unrecorded_ms:.3f}", f"{b.comm_ms:.3f}",
                   f"{100 * b.comm_share:.1f}%", "-" if b.overlap is None else f"{100 * b.overlap:.1f}%",
                   str(b.collectives), fmt_bytes(b.wire_bytes))  # fmt: skip
    console.print(tt)
    top = A.top_spans(trace, kept, wins, view.top)
    if top:
        t2 = cli_common.table(f"top {len(top)} by total time in the window",
                        ["name", "class", "count", "total ms", "mean ms", "max ms", "ranks"],
                        text=("name", "class", "ranks"))  # fmt: skip
        for d in top:
            rk = ",".join(map(str, d["ranks"]))
            t2.add_row(d["name"][:48], d["class"], str(d["count"]), f"{d['total_ms']:.3f}", f"{d['mean_ms']:.3f}",
                       f"{d['max_ms']:.3f}", rk if len(rk) <= 12 else f"{len(d['ranks'])} ranks")  # fmt: skip
        console.print(t2)
    return {"window": (lo, hi), "breakdowns": bds, "top": top}


# -- interactive ---------------------------------------------------------------------------------------


def apply_key(trace: Trace, view: View, key: str) -> View | None:
    """The view after one key press (None: quit). Pure, so the keys are testable without a terminal."""
    lo, hi = resolve_window(trace, view)
    span = hi - lo
    if key in ("q", "Q", "\x03", "\x1b"):
        return None
    if key in ("right", "l"):
        d = min(span / 4, max(0.0, trace.end - hi))
        return replace(view, start=lo + d, end=hi + d, step=None)
    if key in ("left", "h"):
        d = min(span / 4, lo)
        return replace(view, start=lo - d, end=hi - d, step=None)
    if key in ("+", "=", "i"):
        mid = (lo + hi) / 2
        return replace(view, start=mid - span / 4, end=mid + span / 4, step=None)
    if key in ("-", "o"):
        mid = (lo + hi) / 2
        a, b = max(0.0, mid - span), min(trace.end, mid + span)
        return replace(view, start=a, end=b, step=None)
    if key == "0":
        return replace(view, start=None, end=None, step=None)
    if key in ("n", "p"):
        nums = sorted({n for s in trace.steps() if (n := A.step_number(s)) is not None})
        if not nums:
            return view
        if view.step is None:
            nxt = next((n for s in trace.steps() if s.start >= lo and (n := A.step_number(s)) is not None), nums[0])
        else:
            i = nums.index(view.step) if view.step in nums else 0
            nxt = nums[min(len(nums) - 1, i + 1)] if key == "n" else nums[max(0, i - 1)]
        return replace(view, step=nxt, start=None, end=None)
    if key == "r":
        ranks = list(trace.ranks)
        if view.ranks is None or len(view.ranks) != 1:
            return replace(view, ranks=[ranks[0]])
        i = ranks.index(view.ranks[0]) if view.ranks[0] in ranks else -1
        return replace(view, ranks=None if i + 1 >= len(ranks) else [ranks[i + 1]])
    return view


def _read_key(fd: int) -> str:
    import os

    ch = os.read(fd, 1).decode(errors="replace")
    if ch == "\x1b":
        import select

        if select.select([fd], [], [], 0.05)[0]:
            seq = os.read(fd, 2).decode(errors="replace")
            return {"[C": "right", "[D": "left", "[A": "+", "[B": "-"}.get(seq, "")
        return "\x1b"
    return ch


KEYS = "keys: ←/→ pan  +/- zoom  n/p step  r rank  0 reset  q quit"


def frame(trace: Trace, view: View, console, source: str, height: int) -> list[str]:
    """One screen of the interactive mode: the lanes and tables cut to ``height`` lines, the last of them the
    keys (a cut frame says how many lines it left out); lines as the console writes them (with its styles)."""
    with console.capture() as cap:
        render(trace, view, console, source=source)
    lines = cap.get().splitlines()
    room = max(1, height - 1)
    if len(lines) > room:
        cut = len(lines) - (room - 1)
        with console.capture() as cap:
            console.print(f"[yellow]... {cut} more lines (r: one rank at a time; a taller terminal shows more)",
                          no_wrap=True, overflow="crop")  # fmt: skip
        lines = lines[: room - 1] + cap.get().splitlines()[:1]
    with console.capture() as cap:
        console.print(f"[dim]{KEYS}[/dim]", no_wrap=True, overflow="crop")
    return lines[:room] + cap.get().splitlines()[:1]


def interactive(trace: Trace, view: View, console, source: str) -> int:
    """Draw on the terminal's alternate screen (left, and the shell's screen restored, on quit, Ctrl-C or an
    error), one frame per key, each cut to the terminal's height."""
    import termios
    import tty

    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        raise InvalidArgumentError("--interactive needs a terminal on stdin and stdout; drop it to print once")
    fd = sys.stdin.fileno()
    old = termios.tcgetattr(fd)
    try:
        tty.setcbreak(fd)
        with console.screen(hide_cursor=True):
            while view is not None:
                lines = frame(trace, view, console, source, console.height)
                console.file.write("\x1b[H\x1b[2J" + "\n".join(lines))  # home, clear, the frame
                console.file.flush()
                view = apply_key(trace, view, _read_key(fd))
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, old)
    return 0


# -- command line -------------------------------------------------------------------------------------


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("trace", help="a trace file (.json, .json.gz) or a directory of per-rank files")
    ap.add_argument("--window", default=None, help="time window, e.g. 120ms:180ms (ms from the trace start)")
    ap.add_argument(
        "--step", type=cli_common.int_at_least(0), default=None, help="show the window of step N (step markers)"
    )
    ap.add_argument("--rank", default=None, help="ranks to show, e.g. 0 or 0,2")
    ap.add_argument("--cat", default=None,
                    help=f"classes ({', '.join(c for c in CLASSES if c != 'step')}) or the trace's own categories to "
                    "show, e.g. communication,compression")  # fmt: skip
    ap.add_argument("--name", default=None,
                    help="only spans whose name contains this text, or matches it as a glob (*, ?, [...]) when it has "
                    "one of those")  # fmt: skip
    ap.add_argument("--min-dur", default=None, help="only spans at least this long, e.g. 0.5ms")
    ap.add_argument("--top", type=cli_common.int_at_least(0), default=15, help="rows of the top-N table (default 15)")
    ap.add_argument("--width", type=cli_common.int_at_least(40, MAX_WIDTH), default=None,
                    help=f"columns, 40 to {MAX_WIDTH} (default: the terminal's)")  # fmt: skip
    ap.add_argument("--interactive", action="store_true", help="pan and zoom with keys (needs a terminal)")


MAX_WIDTH = 4096
"""The widest timeline drawn (a lane is drawn column by column: 10**7 columns took 70 s and 2.5 GB)."""


class NameFilter:
    """``--name``'s matcher: a glob (``fnmatch``: ``*``, ``?``, ``[...]``, matching the whole name) when the text has
    one of those characters, else a substring test. Never a regular expression, whose backtracking can take for
    ever on a span's name (``(a|a)*c``); a glob is matched in time linear in the name."""

    __slots__ = ("_glob", "text")

    def __init__(self, text: str) -> None:
        self.text = text
        self._glob = re.compile(fnmatch.translate(text)) if any(c in text for c in "*?[") else None

    def search(self, name: str) -> bool:
        return self.text in name if self._glob is None else self._glob.match(name) is not None


def view_from_args(a: argparse.Namespace) -> View:
    v = View(step=a.step, top=a.top)
    if a.window:
        v.start, v.end = parse_window(a.window)
    if a.rank:
        try:
            v.ranks = [int(x) for x in a.rank.split(",") if x.strip()]
        except ValueError as e:
            raise InvalidArgumentError(f"--rank: expected ranks like 0 or 0,2, got {a.rank!r}") from e
    if a.cat:
        v.cats = {c.strip() for c in a.cat.split(",") if c.strip()}
    if a.name:
        v.name = NameFilter(a.name)
    if a.min_dur:
        v.min_dur = parse_duration(a.min_dur, "--min-dur")
    if a.top < 0:
        raise InvalidArgumentError(f"--top must be >= 0, got {a.top}")
    return v


def check_categories(trace: Trace, cats: set[str]) -> None:
    """Every name of ``--cat`` must be a class or a category of the trace (else the filter shows nothing)."""
    have = sorted({s.cat for s in trace.spans if s.cat} - set(CLASSES))
    bad = sorted(c for c in cats if c not in CLASSES and c not in have)
    if bad:
        raise InvalidArgumentError(
            f"--cat: {', '.join(map(repr, bad))} is neither a class ({', '.join(c for c in CLASSES if c != 'step')}) "
            f"nor a category of this trace ({', '.join(have) or 'it has none other'})"
        )


def make_console(width: int | None = None):
    """The viewer's console: ``width`` columns, else the terminal's (80 when not a terminal): the lanes fill it."""
    if width is None:
        from rich.console import Console

        width = Console().width
    return cli_common.console(width=width, highlight=False)


def run(a: argparse.Namespace) -> int:
    try:
        view = view_from_args(a)
        trace = load(a.trace)
        check_categories(trace, view.cats)
        console = make_console(a.width)
        if a.interactive:
            return interactive(trace, view, console, a.trace)
        render(trace, view, console, source=a.trace)
    except (TraceFormatError, InvalidArgumentError) as e:
        return cli_common.fail("torsh timeline", e)
    return 0
