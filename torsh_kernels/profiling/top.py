"""``torsh top DIR|URL [URL ...]``: a live terminal view of a running job's ranks, from its live metrics.

::

    TORSH_LIVE=live/ torchrun --nproc-per-node 8 train.py     # every rank publishes (profiling/live.py)
    torsh top live/                                            # the live view, refreshed every second
    torsh top http://node0:9400 http://node0:9401              # or the ranks' Prometheus endpoints
    torsh top live/ --once --json                              # one snapshot for scripts

A row per rank and source (``ddp``, ``sync``, ``fsdp``, ``ep``): its last step, step time, compute /
communication / compression time, the link rate it measured, wire MB/s, compression ratio and error, the
compressor, and a sparkline of its last ``--window`` step times; the rank with the most compute time at its
last step is marked slowest. Below, the alerts (:mod:`.alerts`: stragglers across ranks, the link judged on the
highest rate any rank measured, non-finite steps, compression error, ``auto``'s switches), each with its
threshold flag.

Sources: a directory is tailed (``DIR/rank{R}.jsonl``: the new complete lines since the last refresh, a line
still being written left for the next; a rotation to ``rank{R}.jsonl.1`` is followed: the rest of the rotated
file, then the new one from its start). A URL is scraped (Prometheus' text format; ``/metrics`` is added to a
bare ``http://host:port``); each scrape whose ``torsh_step`` moved makes a record, and a view of URLs keeps its
own history. An endpoint that stops answering is shown stale; the view goes on.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import http.client
import json
import os
import re
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import deque
from collections.abc import Iterable

from .. import cli_common
from ..errors import InvalidArgumentError, TorshKernelsError
from .alerts import AlertSpec, JobAlerts

__all__ = ["DirSource", "TopState", "UrlSource", "add_arguments", "live_view", "run", "snapshot"]

_BARS = "▁▂▃▄▅▆▇█"
_RANK_FILE = re.compile(r"rank(\d+)\.jsonl$")


class SourceError(InvalidArgumentError):
    """A directory or endpoint ``torsh top`` cannot read."""


# -- reading: a directory of rank files, or Prometheus endpoints ---------------------------------------------


class DirSource:
    """Tails ``DIR/rank{R}.jsonl`` (see the module docstring). ``read()`` returns the records new since the last."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._pos: dict[str, tuple[int, int, bytes]] = {}  # file -> (inode, offset, partial line)
        self.stale = False

    def describe(self) -> str:
        return self.path

    def _lines(self, f, start: int, partial: bytes) -> tuple[list[dict], int, bytes]:
        f.seek(start)
        data = partial + f.read()
        end = start + len(data) - len(partial)
        *lines, rest = data.split(b"\n")
        out = []
        for ln in lines:
            if ln.strip():
                try:
                    out.append(json.loads(ln))
                except ValueError:
                    continue  # (a line torn by a crash: skipped)
        return out, end, rest

    def read(self) -> list[dict]:
        if not os.path.isdir(self.path):
            raise SourceError(f"torsh top: {self.path!r} is not a directory (a live-metrics directory holds "
                              "rank{R}.jsonl files: TORSH_LIVE=DIR, or watch(dir=DIR))")  # fmt: skip
        out: list[dict] = []
        for p in sorted(glob.glob(os.path.join(self.path, "rank*.jsonl"))):
            if not _RANK_FILE.search(p):
                continue
            try:
                st = os.stat(p)
            except FileNotFoundError:
                continue  # (being rotated right now: next refresh)
            ino, off, part = self._pos.get(p, (st.st_ino, 0, b""))
            if ino != st.st_ino:  # rotated: finish the old file (now rank{R}.jsonl.N), then start the new one
                old = next((q for q in glob.glob(p + ".*") if os.stat(q).st_ino == ino), None)
                if old is not None:
                    with open(old, "rb") as f:
                        recs, _, _ = self._lines(f, off, part)
                        out += recs
                ino, off, part = st.st_ino, 0, b""
            if st.st_size < off:  # truncated in place: start over
                off, part = 0, b""
            with open(p, "rb") as f:
                recs, off, part = self._lines(f, off, part)
            out += recs
            self._pos[p] = (ino, off, part)
        return out


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
_GAUGE_FIELDS = {
    "torsh_step": "step", "torsh_step_seconds": "step_s", "torsh_compute_seconds": "compute_s",
    "torsh_comm_seconds": "comm_s", "torsh_compress_seconds": "compress_s",
    "torsh_link_bytes_per_second": "link_Bps", "torsh_compression_ratio": "ratio",
    "torsh_compression_error": "error", "torsh_world_size": "world_size",
}  # fmt: skip
_COUNTER_FIELDS = {
    "torsh_steps_total": "steps", "torsh_wire_bytes_total": "wire_bytes", "torsh_payload_bytes_total": "payload_bytes",
    "torsh_sent_bytes_total": "sent_bytes", "torsh_nonfinite_steps_total": "nonfinite",
    "torsh_auto_switches_total": "switches",
}  # fmt: skip


def parse_prometheus(text: str) -> dict[tuple, dict]:
    """The torsh series of a Prometheus text exposition, per (job, rank, source): the gauges' values and
    compressor, the counters summed over compressors, the active alert kinds."""
    out: dict[tuple, dict] = {}
    for line in text.splitlines():
        if not line.startswith("torsh_"):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            continue
        name, labels, value = m.group(1), dict(_LABEL.findall(m.group(3) or "")), m.group(4)
        try:
            v = float(value)
        except ValueError:
            continue
        try:
            key = (labels["job"], int(labels["rank"]), labels["source"])
        except (KeyError, ValueError):
            continue
        d = out.setdefault(key, {"gauges": {}, "counters": {}, "alerts": set(), "compressor": None})
        if name in _GAUGE_FIELDS:
            d["gauges"][_GAUGE_FIELDS[name]] = v
            d["compressor"] = labels.get("compressor", d["compressor"])
        elif name in _COUNTER_FIELDS:
            f = _COUNTER_FIELDS[name]
            d["counters"][f] = d["counters"].get(f, 0.0) + v
        elif name == "torsh_alert" and v >= 1:
            d["alerts"].add(labels.get("kind", "?"))
    return out


class UrlSource:
    """Scrapes a Prometheus endpoint of torsh's live metrics (see the module docstring)."""

    def __init__(self, url: str, timeout: float = 5.0) -> None:
        u = urllib.parse.urlparse(url)
        if u.scheme not in ("http", "https") or not u.netloc:
            raise SourceError(f"torsh top: {url!r} is neither a directory nor an http(s) URL of a Prometheus endpoint")
        self.url = url if u.path not in ("", "/") else urllib.parse.urlunparse(u._replace(path="/metrics"))
        self.timeout = timeout
        self._last: dict[tuple, dict] = {}
        self.stale = False
        self.error: str | None = None
        self.scrapes = 0

    def describe(self) -> str:
        return self.url + (f" (stale: {self.error})" if self.stale else "")

    def read(self) -> list[dict]:
        try:
            with urllib.request.urlopen(self.url, timeout=self.timeout) as r:
                text = r.read().decode("utf-8", "replace")
        except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException) as e:
            self.stale, self.error = True, str(getattr(e, "reason", e)) or type(e).__name__
            raise SourceError(f"torsh top: cannot read {self.url}: {self.error}") from None
        self.stale, self.error = False, None
        self.scrapes += 1
        now = time.time()
        out = []
        for key, d in parse_prometheus(text).items():
            g, c = d["gauges"], d["counters"]
            if "step" not in g:
                continue
            prev = self._last.get(key)
            if prev is not None and prev["step"] == g["step"]:
                continue
            dsteps = c.get("steps", 0) - (prev["counters"].get("steps", 0) if prev else 0) or 1
            delta = {f: (c.get(f, 0.0) - (prev["counters"].get(f, 0.0) if prev else 0.0)) / dsteps
                     for f in ("wire_bytes", "payload_bytes", "sent_bytes")}  # fmt: skip
            switched = prev is not None and c.get("switches", 0) > prev["counters"].get("switches", 0)
            rec = {"schema": "torsh-live/1", "time": now, "job": key[0], "rank": key[1], "source": key[2],
                   "world_size": int(g.get("world_size", 1)), "step": int(g["step"]),
                   **{f: g.get(f) for f in ("step_s", "compute_s", "comm_s", "compress_s", "link_Bps", "ratio",
                                            "error")},
                   "wire_bytes": int(delta["wire_bytes"]), "payload_bytes": int(delta["payload_bytes"]),
                   "sent_bytes": int(delta["sent_bytes"]),
                   "nonfinite": int(prev is not None and c.get("nonfinite", 0) > prev["counters"].get("nonfinite", 0)),
                   "compressor": d["compressor"],
                   "switch": {"from": prev["compressor"], "to": d["compressor"], "reason": "(from Prometheus)"}
                   if switched else None,
                   "alerts": [{"kind": k, "message": f"{k} (from the endpoint)"}
                              for k in sorted(d["alerts"])]}  # fmt: skip
            # endpoints catch the ranks at different steps: across ranks, what one scrape of each saw is compared
            # (every endpoint is scraped once per refresh)
            rec["_round"] = self.scrapes
            self._last[key] = {"step": g["step"], "counters": dict(c), "compressor": d["compressor"]}
            out.append(rec)
        return out


def make_source(s: str) -> DirSource | UrlSource:
    if s.startswith(("http://", "https://")):
        return UrlSource(s)
    if "://" in s:
        raise SourceError(f"torsh top: {s!r} is neither a directory nor an http(s) URL of a Prometheus endpoint")
    return DirSource(s)


# -- the state: the last record per rank, the history, the alerts ----------------------------------------------


class TopState:
    """What the view shows, from every record read so far."""

    def __init__(self, spec: AlertSpec | None = None, window: int = 40) -> None:
        self.window = window
        self.latest: dict[tuple, dict] = {}  # (job, rank, source) -> its last record
        self.history: dict[tuple, deque] = {}  # ... -> its last ``window`` step times
        self.alerts = JobAlerts(spec)
        self.records = 0
        self.rounds = 0  # refreshes made

    def update(self, records: Iterable[dict]) -> None:
        records = [r for r in records if isinstance(r, dict) and "rank" in r and "step" in r]
        records.sort(key=lambda r: (r.get("time") or 0, r.get("step", 0)))
        for r in records:
            key = (r.get("job"), r["rank"], r.get("source"))
            last = self.latest.get(key)
            # a later step, or a lower one written later: the job was restarted into the same directory
            if last is None or r["step"] >= last["step"] or (r.get("time") or 0) > (last.get("time") or 0):
                self.latest[key] = r
            if r.get("step_s") is not None:
                self.history.setdefault(key, deque(maxlen=self.window)).append(r["step_s"])
        self.records += len(records)
        self.alerts.update(records)

    def slowest(self) -> set[tuple]:
        """Per (job, source) with 2+ ranks: the key of the rank with the most compute time at its last step."""
        groups: dict[tuple, list[tuple]] = {}
        for k in self.latest:
            groups.setdefault((k[0], k[2]), []).append(k)
        out = set()
        for keys in groups.values():
            timed = [(self._busy(self.latest[k]), k) for k in keys if self._busy(self.latest[k]) is not None]
            if len(timed) > 1:
                out.add(max(timed)[1])
        return out

    @staticmethod
    def _busy(r: dict) -> float | None:
        return r.get("compute_s") if r.get("compute_s") is not None else r.get("step_s")

    def snapshot(self) -> dict:
        """``--once --json``: the last record per rank and source, the active alerts, every alert raised."""
        slow = self.slowest()
        ranks = [{**self.latest[k], "slowest": k in slow, "step_s_history": list(self.history.get(k, ()))}
                 for k in sorted(self.latest, key=lambda k: (str(k[0]), str(k[2]), k[1]))]  # fmt: skip
        return {"schema": "torsh-top/1", "records": self.records, "ranks": ranks, "alerts": self.alerts.alerts(),
                "history": self.alerts.history()}  # fmt: skip


def sparkline(values: Iterable[float]) -> str:
    v = list(values)
    if not v:
        return ""
    lo, hi = min(v), max(v)
    if hi <= lo:
        return _BARS[0] * len(v)
    return "".join(_BARS[min(len(_BARS) - 1, int((x - lo) / (hi - lo) * len(_BARS)))] for x in v)


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:.1f}"


_COLUMNS = (  # (header, justify, the width its values take at most, its rank in what a narrow view keeps)
    ("rank", "right", 4, 0), ("source", "left", 6, 0), ("step", "right", 7, 0), ("step ms", "right", 7, 0),
    ("compute", "right", 7, 0), ("comm", "right", 7, 3), ("compress", "right", 7, 4), ("link Gbit/s", "right", 5, 1),
    ("wire MB/s", "right", 7, 5), ("ratio", "right", 5, 2), ("error", "right", 5, 6), ("compressor", "left", 0, 0),
    ("step time", "left", 0, 0), ("", "left", 0, 0),
)  # fmt: skip


def render(state: TopState, sources: list, *, note: str = "", width: int = 200):
    """The view: a table of ranks, then the alerts. On a narrower terminal (``width``) the sparkline shortens
    and the least needed columns go (error, wire MB/s, compress, comm, ratio, link, in that order), so that what
    is shown stays whole."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    slow = state.slowest()
    jobs = sorted({str(k[0]) for k in state.latest})
    title = f"torsh top: {', '.join(jobs) or '-'}  ({', '.join(s.describe() for s in sources)})"
    comp_w = max([len(str(r.get("compressor"))) for r in state.latest.values()] + [len("compressor")])
    mark = "◀ slowest" if width >= 110 else "◀"

    def col_w(c) -> int:
        return max(len(c[0]), c[2]) + 3

    used = sum(col_w(c) for c in _COLUMNS if c[3] == 0 and c[0] not in ("compressor", "step time", "")) + 1
    used += comp_w + 3 + len("step time") + 3 + len(mark) + 3
    shown_opt = set()
    for c in sorted((c for c in _COLUMNS if c[3]), key=lambda c: c[3]):
        if used + col_w(c) <= width:
            shown_opt.add(c[0])
            used += col_w(c)
    shown = [c for c in _COLUMNS if c[3] == 0 or c[0] in shown_opt]
    spark = max(4, min(state.window, width - used + len("step time")))
    t = Table(title=title, title_justify="left", expand=False)
    for col, just, _, _ in shown:
        t.add_column(col, justify=just, no_wrap=True)
    names = [c[0] for c in shown]
    for k in sorted(state.latest, key=lambda k: (str(k[0]), str(k[2]), k[1])):
        r = state.latest[k]
        link = r.get("link_Bps")
        wire = r.get("wire_bytes")
        mbps = wire / r["step_s"] / 1e6 if wire is not None and r.get("step_s") else None
        cells = {
            "rank": str(r["rank"]), "source": str(r.get("source")), "step": str(r["step"]),
            "step ms": _ms(r.get("step_s")), "compute": _ms(r.get("compute_s")), "comm": _ms(r.get("comm_s")),
            "compress": _ms(r.get("compress_s")), "link Gbit/s": "-" if link is None else f"{link * 8 / 1e9:.3g}",
            "wire MB/s": "-" if mbps is None else f"{mbps:.1f}",
            "ratio": "-" if r.get("ratio") is None else f"{r['ratio']:.2f}",
            "error": "-" if r.get("error") is None else f"{r['error']:.3g}", "compressor": str(r.get("compressor")),
            "step time": sparkline(list(state.history.get(k, ()))[-spark:]),
            "": Text(mark, style="bold red") if k in slow else Text(""),
        }  # fmt: skip
        t.add_row(*(cells[n] for n in names))
    lines = []
    active = state.alerts.alerts()
    if active:
        for a in active:
            lines.append(
                Text(f"ALERT {a['kind']} (rank {a['rank']}, step {a['step']}): {a['message']}", style="bold red")
            )
    else:
        lines.append(Text("no active alerts", style="green"))
    past = [a for a in state.alerts.history() if a not in active][-5:]
    for a in past:
        lines.append(Text(f"  earlier: {a['kind']} rank {a['rank']} step {a['step']}: {a['message']}", style="dim"))
    if not state.latest:
        lines.insert(0, Text("waiting for records ...", style="yellow"))
    if note:
        lines.append(Text(note, style="dim"))
    return Group(t, *lines)


def _read_all(sources: list, state: TopState, *, strict: bool) -> None:
    """One refresh: every source read once; a source that fails is shown stale and the view goes on (``strict``:
    raise)."""
    got = []
    for s in sources:
        try:
            recs = s.read()
        except Exception as e:
            if strict:
                if isinstance(e, SourceError):
                    raise
                raise SourceError(f"torsh top: cannot read {s.describe()}: {type(e).__name__}: {e}") from None
            s.stale = True
            continue
        got += recs
    state.rounds += 1
    state.update(got)


def live_view(sources: list[str], *, interval: float = 1.0, stop: threading.Event | None = None,
              spec: AlertSpec | None = None, console=None, window: int = 40) -> dict:  # fmt: skip
    """Show the live view of ``sources`` (directories or URLs), refreshed every ``interval`` seconds, until ``stop``
    is set (or Ctrl-C); returns the last :meth:`TopState.snapshot`. A directory that does not exist yet, or holds no
    records yet, is waited for."""
    from rich.live import Live

    srcs = [make_source(s) for s in sources]
    state = TopState(spec, window)
    con = console if console is not None else cli_common.console()
    with Live(render(state, srcs, width=con.width), console=con, refresh_per_second=4, transient=False) as lv:
        try:
            while True:
                _read_all(srcs, state, strict=False)
                lv.update(render(state, srcs, note=time.strftime("updated %H:%M:%S"), width=con.width))
                if stop is not None:
                    if stop.wait(interval):
                        _read_all(srcs, state, strict=False)
                        lv.update(render(state, srcs, note=time.strftime("final %H:%M:%S"), width=con.width))
                        break
                else:
                    time.sleep(interval)
        except KeyboardInterrupt:
            pass
    return state.snapshot()


def snapshot(sources: list[str], spec: AlertSpec | None = None, window: int = 40) -> tuple[TopState, list]:
    """Read every source once (``--once``): the state, and the sources. A source that cannot be read, or no record
    at all, is a typed error."""
    srcs = [make_source(s) for s in sources]
    state = TopState(spec, window)
    _read_all(srcs, state, strict=True)
    if not state.latest:
        raise SourceError(f"torsh top: no live records in {', '.join(sources)} (rank{{R}}.jsonl lines, or torsh_step "
                          "series)")  # fmt: skip
    return state, srcs


# -- the command ---------------------------------------------------------------------------------------------


_ALERT_HELP = {
    "straggler": "straggler: compute time above the ranks' median by this fraction",
    "straggler_steps": "... for this many steps in a row",
    "link_drop": "link drop: the rate below (1 - this) of its running level",
    "link_steps": "... for this many steps in a row",
    "error_bound": "compression error above this",
    "nonfinite": "no alert for steps that held NaN/Inf",
}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    d = AlertSpec()
    ap.add_argument("sources", nargs="+", metavar="DIR|URL",
                    help="a live-metrics directory (rank{R}.jsonl files) or Prometheus endpoints "
                    "(http://host:port)")  # fmt: skip
    ap.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes (default 1)")
    ap.add_argument("--once", action="store_true", help="print one snapshot and exit")
    cli_common.add_json(ap, "with --once, the snapshot (ranks, alerts, history)")
    ap.add_argument("--window", type=cli_common.int_at_least(2), default=40, help="steps in each sparkline (40)")
    for f in dataclasses.fields(AlertSpec):  # one flag per threshold, named and typed after the spec's field
        v = getattr(d, f.name)
        if isinstance(v, bool):
            ap.add_argument(f"--no-{f.name}", dest=f.name, action="store_false", help=_ALERT_HELP[f.name])
        else:
            ap.add_argument(f"--{f.name.replace('_', '-')}", type=type(v), default=v,
                            help=f"{_ALERT_HELP[f.name]} (default {v})")  # fmt: skip


def run(a: argparse.Namespace) -> int:
    try:
        spec = AlertSpec(**{f.name: getattr(a, f.name) for f in dataclasses.fields(AlertSpec)})
    except TorshKernelsError as e:
        raise cli_common.UsageError(str(e)) from None
    if a.json and not a.once:
        raise cli_common.UsageError("--json needs --once (the live view is for a terminal)")
    if not a.interval > 0:
        raise cli_common.UsageError(f"--interval must be > 0, got {a.interval}")
    if a.once:
        state, srcs = snapshot(a.sources, spec, a.window)
        try:
            if a.json:
                cli_common.write_json(a.json, state.snapshot())
            else:
                con = cli_common.console()
                con.print(render(state, srcs, width=con.width))
        except BrokenPipeError:  # `torsh top DIR --once --json | head`: the reader left; nothing more to say
            os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
        return 0
    for s in a.sources:
        make_source(s)  # a malformed source fails now; a missing directory is waited for
    live_view(a.sources, interval=a.interval, spec=spec, window=a.window)
    return 0
