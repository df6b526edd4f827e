"""Reading traces: torsh's own (``rank{R}.json``), torch.profiler/Kineto Chrome traces (``.json`` or
``.json.gz``) and other Chrome Trace Event files, into one model the viewer and the report share.

:func:`load` takes a file or a directory (every ``*.json`` / ``*.json.gz`` in it, one rank per file) and
returns a :class:`Trace`: spans on lanes, each lane belonging to a rank, times in milliseconds from the
earliest event of any rank. Each span gets a *class*, what the breakdown counts it as:

==================  ==================================================================================
class               spans
==================  ==================================================================================
``compute``         user and module spans, torsh ops not listed below; Kineto kernels and CPU ops that are
                    not collectives
``communication``   collectives in flight (torsh ``collective``), host time issuing them (torsh ``issue``);
                    NCCL kernels; ``gloo:``/``c10d::`` ops
``compression``     torsh compression rounds; the compression ops of :data:`TORSH_OPS`
``memory``          offload transfers (torsh ``offload``); the copy ops of :data:`TORSH_OPS` (bucket
                    flatten/unflatten, offload packing, MoE permutations); Kineto ``gpu_memcpy``/``gpu_memset``
``wait``            a thread blocked on a collective (torsh ``wait``)
``step``            step markers (torsh ``step N``; Kineto ``ProfilerStep#N``)
``other``           everything else (buckets in flight, runtime calls, Python frames, annotations)
==================  ==================================================================================

torsh's ops are classified by one table, :data:`TORSH_OPS`, wherever they appear: as ``op`` spans in
torsh's traces and as ``torsh::NAME`` CPU ops in Kineto traces. In Kineto traces, torsh's own spans
arrive as ``record_function`` ranges (``user_annotation``) with their torsh names; the trace's
top-level ``torsh`` entry (see :mod:`torsh_kernels.recording`) gives each name's torsh category.
Work nested inside a torsh span of class compression, memory or communication that would otherwise count
as plain compute (the ``aten::`` ops under ``torsh::orthogonalize``, untabled torsh ops inside a
compression round, and in Kineto traces the GPU kernels those CPU ops launched, found by their
``External id``) takes that span's class.

:func:`validate` checks a file against the format (:class:`TraceFormatError` names the problem):
required fields, numeric microsecond timestamps, for torsh traces the metadata and no partially
overlapping complete events on one thread.

Reading the files (the size and nesting limits, gzip, strings made printable) is
:mod:`~torsh_kernels.profiling.trace_files`; its public names are importable from here too.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import TraceFormatError
from .trace_files import (
    ENV_MAX_BYTES,
    ENV_MAX_DEPTH,
    MAX_BYTES,
    MAX_DEPTH,
    parse,
    printable,
    printable_all,
    read_json,
    resolve_limit,
    too_deep,
)

__all__ = [
    "CLASSES",
    "ENV_MAX_BYTES",
    "ENV_MAX_DEPTH",
    "MAX_BYTES",
    "MAX_DEPTH",
    "TORSH_OPS",
    "Lane",
    "Span",
    "Trace",
    "classify",
    "load",
    "printable",
    "read_json",
    "validate",
]

CLASSES = ("compute", "communication", "compression", "memory", "wait", "step", "other")

_COMM = re.compile(
    r"nccl|gloo:|c10d::|record_param_comms|all_?reduce|all_?gather|reduce_?scatter|all_?to_?all|broadcast|"
    r"sendrecv|send_recv|allgather|reducescatter",
    re.IGNORECASE,
)
_STEP = re.compile(r"^(?:ProfilerStep#|step )(\d+)$")
_TORSH_CLASSES = {"collective": "communication", "issue": "communication", "compression": "compression",
                  "op": "compute", "user": "compute", "module": "compute", "wait": "wait", "step": "step",
                  "offload": "memory"}  # fmt: skip

TORSH_OPS: dict[str, str] = {
    # compression: encoding and decoding payloads, error feedback, the wire casts of FP16/BF16
    "topk_compress": "compression", "topk_decompress": "compression", "quantize": "compression",
    "quantize_out": "compression", "dequantize": "compression", "sign_compress": "compression",
    "sign_compress.pack": "compression", "sign_decompress": "compression", "orthogonalize": "compression",
    "residual_add": "compression", "error_update": "compression", "wire_cast": "compression",
    "quantize_rows": "compression", "dequantize_rows": "compression",
    # memory: copies into and out of buckets, offload packing, MoE row permutations
    "flatten": "memory", "flatten_out": "memory", "unflatten": "memory", "pack": "memory", "pack_cast": "memory",
    "unpack": "memory",
    "moe_permute": "memory", "moe_unpermute": "memory", "moe_unpermute_backward": "memory",
    "moe_unpermute.backward": "memory",
    # compute: local arithmetic (a reduction of same-shape buffers, MoE routing and its losses)
    "bucket_reduce": "compute", "bucket_reduce_out": "compute", "moe_route": "compute",
    "moe_route.assign": "compute", "moe_aux_loss": "compute", "moe_z_loss": "compute",
}  # fmt: skip
"""torsh op -> class: the ``torsh::NAME`` custom ops (``torch.library.custom_op`` in ``torsh_kernels/ops``)
and the names the provider registry records their launches under. No torsh op is a collective: torsh's
communication is its collectives (``collective`` and ``issue`` spans; ``c10d::``/``gloo:``/NCCL in Kineto)."""
INHERITED = ("compression", "memory", "communication")
"""Classes that plain compute nested inside a torsh span of that class takes on (see the module docstring)."""


def torsh_op_class(name: str) -> str | None:
    """The class of a torsh op (``flatten``, ``torsh::flatten``, ``torsh::flatten.default``), None if unknown."""
    if name.startswith("torsh::"):
        name = name[7:]
    c = TORSH_OPS.get(name)
    if c is None and "." in name:
        c = TORSH_OPS.get(name.split(".", 1)[0])
    return c


_DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation"}
# nesting tolerance: torsh writes nanosecond-rounded microseconds; sums of two such doubles differ by < 1e-3 us
EPS_US = 1e-3


@dataclass(slots=True)
class Lane:
    """One row of the timeline: a thread, a GPU stream, or torsh's in-flight ``comm N`` / ``bucket N``."""

    rank: int
    """The rank (one file: one rank)."""
    name: str
    """Display name, e.g. ``main``, ``comm 0``, ``stream 7``."""
    kind: str
    """``thread`` (nested spans), ``device`` (a GPU stream) or ``inflight`` (collectives/buckets in flight)."""
    key: tuple = ()
    """(pid, tid) in the file."""


@dataclass(slots=True)
class Span:
    """One complete event."""

    rank: int
    """The rank."""
    lane: int
    """Index into :attr:`Trace.lanes`."""
    name: str
    """Event name."""
    cat: str
    """The file's category."""
    cls: str
    """What the breakdown counts it as (:data:`CLASSES`)."""
    start: float
    """Milliseconds from the trace's origin."""
    dur: float
    """Milliseconds."""
    args: dict = field(default_factory=dict)
    """The event's args."""

    @property
    def end(self) -> float:
        return self.start + self.dur


@dataclass(slots=True)
class Trace:
    """Every rank's spans on one time axis (see the module docstring)."""

    spans: list[Span] = field(repr=False)
    """All spans, sorted by start."""
    lanes: list[Lane] = field(repr=False)
    """All lanes; spans refer to them by index."""
    ranks: dict[int, dict] = field(repr=False)
    """Rank -> metadata (source, file, world size, device, versions, wire bytes, ...)."""
    origin_us: float
    """Absolute time (microseconds since the Unix epoch) of time 0."""
    counters: list[tuple[int, str, float, dict]] = field(default_factory=list, repr=False)
    """(rank, name, ms, values) of counter events."""

    @property
    def end(self) -> float:
        return max((s.end for s in self.spans), default=0.0)

    def __repr__(self) -> str:
        """Counts and the time span; the spans, lanes and metadata are attributes."""
        ranks = sorted(self.ranks)
        shown = ranks if len(ranks) <= 8 else f"{len(ranks)} ranks, {ranks[0]}..{ranks[-1]}"
        return (
            f"Trace(ranks={shown}, spans={len(self.spans)}, lanes={len(self.lanes)}, steps={len(self.steps())}, "
            f"counters={len(self.counters)}, {self.end:.3f} ms)"
        )

    def steps(self, rank: int | None = None) -> list[Span]:
        """Step markers (of one rank, or all), by start."""
        return [s for s in self.spans if s.cls == "step" and (rank is None or s.rank == rank)]


def classify(cat: str, name: str, source: str, torsh_spans: dict | None = None) -> str:
    """The class of an event (see the module docstring). ``torsh_spans``: a Kineto trace's map of torsh span
    names to their torsh categories (its top-level ``torsh.categories``)."""
    return _classify(cat, name, source, torsh_spans)[0]


def _classify(cat: str, name: str, source: str, torsh_spans: dict | None) -> tuple[str, bool]:
    """(class, whether torsh named it): torsh's categories and op table, as opposed to the generic rules."""
    if source == "torsh":
        if cat == "op":
            c = torsh_op_class(name)
            return (c, True) if c is not None else ("compute", False)
        return _TORSH_CLASSES.get(cat, "other"), True
    if _STEP.match(name):
        return "step", False
    if name.startswith("torsh::") and cat in ("cpu_op", "user_annotation", ""):
        c = torsh_op_class(name)
        if c is not None:
            return c, True
    if torsh_spans and cat in ("user_annotation", "gpu_user_annotation"):
        tc = torsh_spans.get(name)
        if isinstance(tc, str):
            c = torsh_op_class(name) if tc == "op" else None
            return c or _TORSH_CLASSES.get(tc, "other"), True
    return _generic(cat, name, source), False


def _generic(cat: str, name: str, source: str) -> str:
    if cat in ("gpu_memcpy", "gpu_memset") or (source == "chrome" and "memcpy" in name.lower()):
        return "memory"
    if cat in ("kernel", "cpu_op", "user_annotation", "gpu_user_annotation") or source == "chrome":
        if _COMM.search(name):
            return "communication"
        if cat in ("kernel", "cpu_op") or (source == "chrome" and cat not in ("Trace",)):
            return "compute"
    return "other"


def _events(data: dict | list, p: Path) -> list:
    if isinstance(data, list):  # the JSON Array Format
        return data
    if not isinstance(data, dict):
        raise TraceFormatError(f"{p}: expected a JSON object with 'traceEvents' (or an array of events), "
                               f"got {type(data).__name__}")  # fmt: skip
    ev = data.get("traceEvents")
    if not isinstance(ev, list):
        raise TraceFormatError(f"{p}: no 'traceEvents' list at the top level; not a Chrome trace")
    return ev


def _num(e: dict, key: str, i: int, p: Path) -> float:
    v = e.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TraceFormatError(f"{p}: event {i} ({e.get('name')!r}, ph {e.get('ph')!r}) has {key}={v!r}; "
                               "expected a number of microseconds")  # fmt: skip
    if v != v or v in (float("inf"), float("-inf")):
        raise TraceFormatError(f"{p}: event {i} ({e.get('name')!r}) has {key}={v!r}")
    return float(v)


_TORSH_META = ("rank", "world_size", "device", "versions", "clock")


def validate(data: dict | list, path: str | Path = "<trace>") -> str:
    """Check a parsed trace; returns its source (``torsh``, ``kineto`` or ``chrome``) or raises
    :class:`TraceFormatError`. Every event needs ``ph``; complete events (``X``) a string ``name``,
    numeric ``ts`` and ``dur >= 0``, ``pid`` and ``tid``. torsh traces must also carry their metadata
    (``otherData``: rank, world_size, device, versions, clock; process and thread names) and hold no
    two complete events on one (pid, tid) that overlap without nesting."""
    p = Path(path)
    events = _events(data, p)
    source = "chrome"
    if isinstance(data, dict):
        od = data.get("otherData")
        if isinstance(od, dict) and str(od.get("schema", "")).startswith("torsh-trace/"):
            source = "torsh"
            missing = [k for k in _TORSH_META if k not in od]
            if missing:
                raise TraceFormatError(f"{p}: torsh trace metadata (otherData) lacks {missing}")
            if not isinstance(od["rank"], int) or not isinstance(od["world_size"], int) or not 0 <= od["rank"] < \
                    od["world_size"]:  # fmt: skip
                raise TraceFormatError(f"{p}: otherData has rank={od['rank']!r}, world_size={od['world_size']!r}")
            if not isinstance(od["clock"], dict) or not isinstance(od["clock"].get("base_unix_us"), int):
                raise TraceFormatError(f"{p}: otherData.clock lacks an integer base_unix_us")
        elif "schemaVersion" in data or "deviceProperties" in data or "baseTimeNanoseconds" in data:
            source = "kineto"
    lanes: dict[tuple, list[tuple[float, float, int]]] = {}
    named_threads, named_procs = set(), set()
    for i, e in enumerate(events):
        if not isinstance(e, dict):
            raise TraceFormatError(f"{p}: event {i} is a {type(e).__name__}, expected an object")
        ph = e.get("ph")
        if not isinstance(ph, str) or not ph:
            raise TraceFormatError(f"{p}: event {i} ({e.get('name')!r}) has no 'ph' (phase)")
        for k in ("pid", "tid"):  # process and thread ids key the lanes: numbers or strings (Chrome's format)
            v = e.get(k)
            if v is not None and not isinstance(v, (int, float, str)):
                raise TraceFormatError(f"{p}: event {i} ({e.get('name')!r}) has {k}={type(v).__name__} "
                                       f"{printable(repr(v))[:60]}; expected a number or a string")  # fmt: skip
        if ph == "M":
            if e.get("name") == "thread_name":
                named_threads.add((e.get("pid"), e.get("tid")))
            elif e.get("name") == "process_name":
                named_procs.add(e.get("pid"))
            continue
        if ph not in ("X", "B", "E", "C", "i", "I"):
            continue
        if ph != "E" and not isinstance(e.get("name"), str):
            raise TraceFormatError(f"{p}: event {i} (ph {ph!r}) has no string 'name'")
        ts = _num(e, "ts", i, p)
        if ph == "X":
            dur = _num(e, "dur", i, p)
            if dur < 0:
                raise TraceFormatError(f"{p}: event {i} ({e['name']!r}) has a negative duration {dur}")
            for k in ("pid", "tid"):
                if k not in e:
                    raise TraceFormatError(f"{p}: event {i} ({e['name']!r}) has no {k!r}")
            if source == "torsh":
                lanes.setdefault((e["pid"], e["tid"]), []).append((ts, ts + dur, i))
    if source == "torsh":
        for key, spans in lanes.items():
            if key not in named_threads:
                raise TraceFormatError(f"{p}: lane pid={key[0]} tid={key[1]} has no thread_name metadata")
            if key[0] not in named_procs:
                raise TraceFormatError(f"{p}: pid {key[0]} has no process_name metadata")
            _check_nesting(spans, key, events, p)
    return source


def _check_nesting(spans: list[tuple[float, float, int]], key: tuple, events: list, p: Path) -> None:
    spans.sort(key=lambda s: (s[0], -s[1]))
    stack: list[tuple[float, float, int]] = []
    for s in spans:
        while stack and stack[-1][1] <= s[0] + EPS_US:
            stack.pop()
        if stack and s[1] > stack[-1][1] + EPS_US:
            a, b = events[stack[-1][2]], events[s[2]]
            raise TraceFormatError(
                f"{p}: events {a['name']!r} (ts {a['ts']}, dur {a['dur']}) and {b['name']!r} (ts {b['ts']}, dur "
                f"{b['dur']}) overlap without nesting on pid={key[0]} tid={key[1]}; Perfetto rejects such lanes"
            )
        stack.append(s)


def _files(target: Path) -> list[Path]:
    if target.is_dir():
        fs = sorted(f for f in target.iterdir() if f.is_file() and (f.name.endswith(".json") or f.name.endswith(
            ".json.gz")))  # fmt: skip
        if not fs:
            raise TraceFormatError(f"{target}: no trace files (*.json, *.json.gz) in this directory")
        return fs
    if not target.exists():
        raise TraceFormatError(f"{target}: no such file or directory")
    return [target]


def _rank_of(data: dict | list, source: str, f: Path, fallback: int) -> int:
    if isinstance(data, dict):
        if source == "torsh":
            return int(data["otherData"]["rank"])
        di = data.get("distributedInfo")
        if isinstance(di, dict) and isinstance(di.get("rank"), int):
            return di["rank"]
    m = re.search(r"rank[_-]?(\d+)", f.name)
    return int(m.group(1)) if m else fallback


def _base_us(data: dict | list, source: str) -> float:
    if not isinstance(data, dict):
        return 0.0
    if source == "torsh":
        return float(data["otherData"]["clock"]["base_unix_us"])
    b = data.get("baseTimeNanoseconds")
    return b / 1e3 if isinstance(b, (int, float)) and not isinstance(b, bool) else 0.0


def load(target: str | Path, *, max_bytes: int | None = None, max_depth: int | None = None) -> Trace:
    """Load a trace file or a directory of them (one rank per file) into a :class:`Trace`. ``max_bytes``
    and ``max_depth`` limit each file as in :func:`read_json`. Every string the trace supplies (names,
    categories, lane names, args, metadata) is :func:`printable`: control characters arrive escaped."""
    max_bytes = resolve_limit(max_bytes, ENV_MAX_BYTES, MAX_BYTES, "max_bytes")
    max_depth = resolve_limit(max_depth, ENV_MAX_DEPTH, MAX_DEPTH, "max_depth")
    files = _files(Path(target))
    raw = []
    seen: dict[int, Path] = {}
    for n, f in enumerate(files):
        data, control = parse(f, max_bytes, max_depth)
        if control:  # rare: only then is every string rebuilt
            try:
                data = printable_all(data)
            except RecursionError:  # a max_depth raised near the interpreter's recursion limit
                raise too_deep(f, max_depth) from None
        source = validate(data, f)
        rank = _rank_of(data, source, f, n)
        if rank in seen:
            raise TraceFormatError(f"{f}: rank {rank} appears twice ({seen[rank].name} and {f.name}); keep one trace "
                                   "per rank in the directory")  # fmt: skip
        seen[rank] = f
        raw.append((rank, f, data, source, _base_us(data, source)))
    origin = min((base + e["ts"] for _, _, data, _, base in raw for e in _events(data, Path()) if e.get("ph") in
                  ("X", "B") and isinstance(e.get("ts"), (int, float))), default=0.0)  # fmt: skip
    lanes: list[Lane] = []
    spans: list[Span] = []
    counters: list[tuple[int, str, float, dict]] = []
    ranks: dict[int, dict] = {}
    for rank, f, data, source, base in raw:
        meta = _rank_meta(data, source, f)
        ranks[rank] = meta
        _convert(rank, _events(data, f), source, base - origin, lanes, spans, counters, f, torsh_span_categories(data))
    spans.sort(key=lambda s: (s.start, -s.dur))
    if not spans:
        raise TraceFormatError(f"{target}: the trace holds no complete events to show")
    return Trace(spans=spans, lanes=lanes, ranks=dict(sorted(ranks.items())), origin_us=origin, counters=counters)


def _rank_meta(data: dict | list, source: str, f: Path) -> dict:
    meta: dict = {"source": source, "file": str(f)}
    if isinstance(data, dict):
        if source == "torsh":
            od = data["otherData"]
            meta.update({k: od.get(k) for k in ("world_size", "device", "versions", "host", "wire_bytes",
                                                "dropped_events")})  # fmt: skip
            di = data.get("distributedInfo")
            meta["backend"] = di.get("backend") if isinstance(di, dict) else None
        else:
            di = data.get("distributedInfo") or {}
            meta["world_size"] = di.get("world_size")
            props = data.get("deviceProperties") or []
            meta["device"] = props[0].get("name") if props and isinstance(props[0], dict) else None
            meta["backend"] = di.get("backend")
            meta["torsh_spans"] = bool(torsh_span_categories(data))
    return meta


def torsh_span_categories(data: dict | list) -> dict[str, str]:
    """A Kineto trace's map of torsh span names to torsh categories (its top-level ``torsh.categories``,
    written while a torch.profiler recorded torsh's spans); empty when absent."""
    t = data.get("torsh") if isinstance(data, dict) else None
    cats = t.get("categories") if isinstance(t, dict) else None
    if not isinstance(cats, dict):
        return {}
    return {k: v for k, v in cats.items() if isinstance(k, str) and isinstance(v, str)}


def _convert(rank: int, events: list, source: str, shift_us: float, lanes: list[Lane], spans: list[Span],
             counters: list, f: Path, torsh_spans: dict | None = None) -> None:  # fmt: skip
    names: dict[tuple, str] = {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "thread_name" and isinstance(e.get("args"), dict):
            names[(e.get("pid"), e.get("tid"))] = str(e["args"].get("name", ""))
    lane_of: dict[tuple, int] = {}

    def lane(key: tuple, cat: str) -> int:
        i = lane_of.get(key)
        if i is None:
            name = names.get(key) or f"{key[0]}:{key[1]}"
            if source == "torsh":
                kind = "inflight" if re.match(r"^(comm|bucket) \d+$", name) else (
                    "device" if name.startswith("cuda:") else "thread")  # fmt: skip
            else:
                kind = "device" if cat in _DEVICE_CATS else "thread"
                if kind == "device" and key not in names:
                    name = f"gpu {key[0]} stream {key[1]}"
            i = lane_of[key] = len(lanes)
            lanes.append(Lane(rank=rank, name=name, kind=kind, key=key))
        return i

    mine: list[tuple[Span, bool]] = []  # this file's spans, and whether torsh named their class

    def add(name: str, cat: str, key: tuple, ts: float, dur: float, args: dict) -> None:
        cls, named = _classify(cat, name, source, torsh_spans)
        s = Span(rank, lane(key, cat), name, cat, cls, (ts + shift_us) / 1e3, dur / 1e3, args)
        spans.append(s)
        mine.append((s, named))

    open_b: dict[tuple, list[dict]] = {}
    for e in events:
        ph = e.get("ph")
        if ph == "X":
            add(e["name"], str(e.get("cat", "")), (e["pid"], e["tid"]), e["ts"], e["dur"], e.get("args") or {})
        elif ph == "B":
            open_b.setdefault((e.get("pid"), e.get("tid")), []).append(e)
        elif ph == "E":
            st = open_b.get((e.get("pid"), e.get("tid")))
            if st:
                b = st.pop()
                add(b["name"], str(b.get("cat", "")), (b.get("pid"), b.get("tid")), b["ts"],
                    max(0.0, e["ts"] - b["ts"]), b.get("args") or {})  # fmt: skip
        elif ph == "C" and isinstance(e.get("args"), dict):
            counters.append((rank, e["name"], (e["ts"] + shift_us) / 1e3, e["args"]))
    if source == "torsh" or torsh_spans or any(named for _, named in mine):
        _inherit(mine, lanes)


def _inherit(mine: list[tuple[Span, bool]], lanes: list[Lane]) -> None:
    """Plain compute nested in a torsh span of an :data:`INHERITED` class takes that class, on thread lanes;
    then device spans take the class of the CPU op that launched them (Kineto's ``External id``)."""
    by_lane: dict[int, list[tuple[Span, bool]]] = {}
    for s, named in mine:
        if lanes[s.lane].kind == "thread" and s.cls != "step":
            by_lane.setdefault(s.lane, []).append((s, named))
    launched: dict[object, str] = {}  # External id -> class, for the CPU ops under a torsh span
    for items in by_lane.values():
        items.sort(key=lambda x: (x[0].start, -x[0].dur))
        stack: list[tuple[float, str | None]] = []  # (end, the class its children inherit)
        for s, named in items:
            while stack and stack[-1][0] <= s.start + EPS_US / 1e3:
                stack.pop()
            up = stack[-1][1] if stack else None
            if named:
                eff = s.cls if s.cls in INHERITED else None
            else:  # plain compute takes the class; other unnamed spans (Python frames with with_stack=True,
                # user annotations) pass it through to what they hold
                if s.cls == "compute" and up is not None:
                    s.cls = up
                eff = up
            stack.append((s.end, eff))
            if eff is not None:
                x = s.args.get("External id")
                if x is not None:
                    launched[x] = eff
    if not launched:
        return
    for s, named in mine:
        if not named and s.cls == "compute" and lanes[s.lane].kind == "device":
            c = launched.get(s.args.get("External id"))
            if c is not None:
                s.cls = c
