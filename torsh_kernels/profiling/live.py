"""Live metrics: who listens to the per-step records of a running job, and where they go.

::

    from torsh_kernels.profiling.live import watch

    with watch(dir="live/", prometheus=9400, job="gpt-small"):   # or TORSH_LIVE=live/ torchrun ...
        train()                                                     # then: torsh top live/

While a :class:`Publisher` is active (:func:`watch`, or ``TORSH_LIVE`` / ``TORSH_LIVE_PROMETHEUS`` /
``TORSH_LIVE_TENSORBOARD`` at import), the DDP hook, the gradient synchronizer, FSDP2's quantized comms and the
expert-parallel layer hand it one record per step and rank (:data:`torsh_kernels.live.FIELDS`; docs/profiling.md
says what each field means). It adds the job's name, the time and this rank's alerts
(:class:`~torsh_kernels.profiling.alerts.RankAlerts`: link drop, non-finite steps, compression error, auto's
switches) and sends it to its sinks:

- :class:`FileSink`: ``DIR/rank{R}.jsonl``, one JSON line per record, flushed per line, rotated at
  ``max_bytes`` to ``rank{R}.jsonl.1`` ... ``.{keep}`` (older ones deleted): append-only and bounded.
  ``torsh top DIR`` tails them.
- :class:`PrometheusSink`: ``prometheus_client`` (the ``live`` extra) serving ``/metrics`` on port
  ``prometheus + local rank`` (0: any free port), the metric names of docs/profiling.md with the labels
  job, rank, source, compressor; ``torsh top URL`` or Prometheus scrape it.
- :class:`TensorBoardSink`: ``torch.utils.tensorboard`` scalars under ``DIR/rank{R}`` (needs ``tensorboard``).

With no publisher the instrumented layers pay one global load per step (``torsh_kernels.live.publisher``).
A publisher's own cost is kept in ``Publisher.publish_s`` (seconds spent in :meth:`Publisher.publish`).
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import math
import os
import threading
import time

from .. import live
from ..checks import check_int, short
from ..errors import ArgumentTypeError, InvalidArgumentError, ProviderUnavailableError
from ..specs import Spec
from .alerts import KINDS, AlertSpec, RankAlerts

__all__ = ["ENV_DIR", "ENV_JOB", "ENV_PROMETHEUS", "ENV_TENSORBOARD", "FileSink", "LiveSpec", "PrometheusSink",
           "Publisher", "TensorBoardSink", "start_from_env", "watch"]  # fmt: skip

ENV_DIR = "TORSH_LIVE"
ENV_PROMETHEUS = "TORSH_LIVE_PROMETHEUS"
ENV_TENSORBOARD = "TORSH_LIVE_TENSORBOARD"
ENV_JOB = "TORSH_LIVE_JOB"


def _opt_str(v: object, name: str) -> str | None:
    if v is None:
        return None
    if not isinstance(v, (str, os.PathLike)) or not str(os.fspath(v)).strip():
        raise ArgumentTypeError(f"LiveSpec: {name} must be a non-empty path, got {type(v).__name__} {short(v)}")
    return str(os.fspath(v))


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class LiveSpec(Spec):
    """Where a job's live metrics go, and how often the expensive ones are measured."""

    dir: str | None = None
    """A directory for :class:`FileSink` (``DIR/rank{R}.jsonl``)."""
    prometheus: int | None = None
    """The base port of :class:`PrometheusSink` (rank r serves ``prometheus + local rank``; 0: a free port)."""
    addr: str = "0.0.0.0"
    """The address the Prometheus endpoint binds."""
    tensorboard: str | None = None
    """A log directory for :class:`TensorBoardSink`."""
    job: str = "torsh"
    """The job's name (the ``job`` field and label)."""
    max_bytes: int = 16 << 20
    """A rank's file is rotated when it would pass this size."""
    keep: int = 3
    """Rotated files kept per rank."""
    error_every: int = 25
    """Steps between measurements of the compression error (a norm of every gradient and residual)."""
    alerts: AlertSpec = dataclasses.field(default_factory=AlertSpec)
    """The per-rank alerts' thresholds."""

    def __post_init__(self) -> None:
        w = "LiveSpec"
        self.normalize("dir", _opt_str(self.dir, "dir"))
        self.normalize("tensorboard", _opt_str(self.tensorboard, "tensorboard"))
        if self.prometheus is not None:
            self.normalize("prometheus", check_int(self.prometheus, w, "prometheus", 0, 65535))
        if not isinstance(self.addr, str):
            raise ArgumentTypeError(f"LiveSpec: addr must be a str, got {type(self.addr).__name__}")
        if not isinstance(self.job, str) or not self.job.strip():
            raise ArgumentTypeError(f"LiveSpec: job must be a non-empty str, got {type(self.job).__name__} "
                                    f"{short(self.job)}")  # fmt: skip
        self.normalize("max_bytes", check_int(self.max_bytes, w, "max_bytes", 4096))
        self.normalize("keep", check_int(self.keep, w, "keep", 0, 1000))
        self.normalize("error_every", check_int(self.error_every, w, "error_every", 1))
        if not isinstance(self.alerts, AlertSpec):
            raise ArgumentTypeError(f"LiveSpec: alerts must be an AlertSpec, got {type(self.alerts).__name__}")
        if self.dir is None and self.prometheus is None and self.tensorboard is None:
            raise InvalidArgumentError("LiveSpec: nowhere to publish: give dir=, prometheus= or tensorboard=")


def _local_rank(rank: int) -> int:
    v = os.environ.get("LOCAL_RANK", "")
    return int(v) if v.isdigit() else rank


class FileSink:
    """``DIR/rank{R}.jsonl``: one JSON line per record, flushed, rotated at ``max_bytes`` (see the module docstring)."""

    def __init__(self, directory: str, max_bytes: int, keep: int) -> None:
        try:
            os.makedirs(directory, exist_ok=True)
        except OSError as e:
            raise InvalidArgumentError(f"live metrics: cannot create the directory {directory!r}: {e}") from None
        self.dir = directory
        self.max_bytes = max_bytes
        self.keep = keep
        self._files: dict[int, tuple[object, int]] = {}  # rank -> (file, bytes written)

    def path(self, rank: int) -> str:
        return os.path.join(self.dir, f"rank{rank}.jsonl")

    def write(self, rec: dict) -> None:
        rank = rec["rank"]
        line = (json.dumps(rec, separators=(",", ":"), allow_nan=False, default=str) + "\n").encode()
        f, size = self._files.get(rank) or self._open(rank)
        if size and size + len(line) > self.max_bytes:
            f.close()
            self._rotate(rank)
            f, size = self._open(rank)
        f.write(line)
        f.flush()
        self._files[rank] = (f, size + len(line))

    def _open(self, rank: int):
        f = open(self.path(rank), "ab", buffering=0)  # noqa: SIM115 (kept open; closed in close())
        return f, f.tell()

    def _rotate(self, rank: int) -> None:
        p = self.path(rank)
        if self.keep == 0:
            os.remove(p)
            return
        for i in range(self.keep, 0, -1):
            src = p if i == 1 else f"{p}.{i - 1}"
            if os.path.exists(src):
                os.replace(src, f"{p}.{i}")

    def close(self) -> None:
        for f, _ in self._files.values():
            f.close()
        self._files = {}


_GAUGES = {
    "torsh_step": ("step", "The step number of the last record"),
    "torsh_step_seconds": ("step_s", "Seconds of the last step"),
    "torsh_compute_seconds": ("compute_s", "Seconds of the last step not blocked on, nor compressing for, comms"),
    "torsh_comm_seconds": ("comm_s", "Seconds the last step was blocked waiting for collectives"),
    "torsh_compress_seconds": ("compress_s", "Seconds the last step spent compressing and decoding"),
    "torsh_link_bytes_per_second": ("link_Bps", "Wire bytes over the seconds collectives were in flight, last step"),
    "torsh_compression_ratio": ("ratio", "Payload bytes over compressed bytes, last step"),
    "torsh_compression_error": ("error", "Error-feedback residual norm over gradient norm, last measured"),
    "torsh_world_size": ("world_size", "Ranks of the job"),
}  # fmt: skip
_COUNTERS = {
    "torsh_steps": ("", "Steps recorded"),
    "torsh_wire_bytes": ("wire_bytes", "Bytes this rank put on the wire"),
    "torsh_payload_bytes": ("payload_bytes", "Uncompressed bytes handed to the component"),
    "torsh_sent_bytes": ("sent_bytes", "Compressed payload bytes handed to collectives"),
    "torsh_nonfinite_steps": ("nonfinite", "Steps that held NaN/Inf"),
    "torsh_auto_switches": ("", "Compressor switches made by compressor='auto' following the link"),
}


class PrometheusSink:
    """The records as Prometheus metrics on ``/metrics`` (``prometheus_client``'s own registry and HTTP server)."""

    def __init__(self, base_port: int, addr: str) -> None:
        try:
            import prometheus_client as pc
        except ImportError:
            raise ProviderUnavailableError(
                "live metrics: prometheus= needs prometheus_client: pip install 'torsh-kernels[live]' "
                "(or pip install prometheus_client)"
            ) from None
        self._pc = pc
        self.base_port = base_port
        self.addr = addr
        self.registry = pc.CollectorRegistry()
        labels = ["job", "rank", "source", "compressor"]
        self._gauges = {n: pc.Gauge(n, doc, labels, registry=self.registry) for n, (_, doc) in _GAUGES.items()}
        self._counters = {n: pc.Counter(n, doc, labels, registry=self.registry) for n, (_, doc) in _COUNTERS.items()}
        self._alert = pc.Gauge("torsh_alert", "1 while an alert of this kind is active on this rank",
                               ["job", "rank", "source", "kind"], registry=self.registry)  # fmt: skip
        self._labels: dict[tuple, tuple] = {}  # (job, rank, source) -> (its label values, its metric children)
        self.server = None
        self.port: int | None = None

    @property
    def url(self) -> str | None:
        """Where this process serves its metrics (None until the first record)."""
        if self.port is None:
            return None
        host = "127.0.0.1" if self.addr in ("", "0.0.0.0") else self.addr
        return f"http://{host}:{self.port}/metrics"

    def _serve(self, rank: int) -> None:
        port = self.base_port + _local_rank(rank) if self.base_port else 0
        try:
            self.server, _ = self._pc.start_http_server(port, addr=self.addr, registry=self.registry)
        except OSError as e:
            raise InvalidArgumentError(
                f"live metrics: cannot serve Prometheus metrics on {self.addr}:{port}: {e}"
            ) from None
        self.port = self.server.server_port

    def _children(self, base: tuple, labels: tuple) -> tuple[list, list, list]:
        """The metric children of one (job, rank, source) under ``labels`` (made once; when auto switches, the
        gauges move to the new compressor's series)."""
        got = self._labels.get(base)
        if got is not None and got[0] == labels:
            return got[1]
        if got is not None:
            for g in self._gauges.values():
                g.remove(*got[0])
        kids = (
            [(field, self._gauges[n].labels(*labels)) for n, (field, _) in _GAUGES.items()],
            [(n, field, self._counters[n].labels(*labels)) for n, (field, _) in _COUNTERS.items()],
            [(kind, self._alert.labels(*base, kind)) for kind in KINDS if kind != "straggler"],
        )
        self._labels[base] = (labels, kids)
        return kids

    def write(self, rec: dict) -> None:
        if self.server is None:
            self._serve(rec["rank"])
        base = (rec["job"], str(rec["rank"]), rec["source"])
        gauges, counters, alerts = self._children(base, (*base, rec["compressor"]))
        for field, g in gauges:
            v = rec.get(field)
            if v is not None:
                g.set(v)
        for name, field, c in counters:
            if name == "torsh_steps":
                c.inc()
            elif name == "torsh_auto_switches":
                if rec.get("switch"):
                    c.inc()
            elif v := rec.get(field):
                c.inc(v)
        active = {a["kind"] for a in rec.get("alerts") or ()}
        for kind, g in alerts:  # (the straggler is judged across ranks: torsh top's)
            g.set(1.0 if kind in active else 0.0)

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None


class TensorBoardSink:
    """The records as ``torch.utils.tensorboard`` scalars, ``torsh/{source}/{field}`` under ``DIR/rank{R}``."""

    FIELDS = ("step_s", "compute_s", "comm_s", "compress_s", "wire_bytes", "link_Bps", "ratio", "error", "nonfinite")

    def __init__(self, directory: str) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ProviderUnavailableError(
                "live metrics: tensorboard= needs TensorBoard: pip install 'torsh-kernels[live]' (or pip install "
                "tensorboard)"
            ) from None
        self._writer_cls = SummaryWriter
        self.dir = directory
        self._writers: dict[int, object] = {}

    def write(self, rec: dict) -> None:
        rank = rec["rank"]
        w = self._writers.get(rank)
        if w is None:
            w = self._writers[rank] = self._writer_cls(log_dir=os.path.join(self.dir, f"rank{rank}"), flush_secs=10)
        step, src = rec["step"], rec["source"]
        for f in self.FIELDS:
            v = rec.get(f)
            if v is not None:
                w.add_scalar(f"torsh/{src}/{f}", v, step, walltime=rec["time"])
        if rec.get("switch"):
            w.add_text(f"torsh/{src}/switch", json.dumps(rec["switch"]), step)

    def close(self) -> None:
        for w in self._writers.values():
            w.close()
        self._writers = {}


class Publisher:
    """Adds the job, the time and this rank's alerts to each record and sends it to the sinks (thread-safe)."""

    def __init__(self, spec: LiveSpec) -> None:
        if not isinstance(spec, LiveSpec):
            raise ArgumentTypeError(f"Publisher: spec must be a LiveSpec, got {type(spec).__name__}")
        self.spec = spec
        sinks: list = []
        try:
            if spec.dir is not None:
                sinks.append(FileSink(spec.dir, spec.max_bytes, spec.keep))
            if spec.prometheus is not None:
                sinks.append(PrometheusSink(spec.prometheus, spec.addr))
            if spec.tensorboard is not None:
                sinks.append(TensorBoardSink(spec.tensorboard))
        except BaseException:
            for s in sinks:
                s.close()
            raise
        self.sinks = sinks
        self._alerts: dict[tuple[int, str], RankAlerts] = {}
        self._lock = threading.Lock()
        self.records = 0
        """Records published."""
        self.publish_s = 0.0
        """Seconds spent publishing them (this process)."""
        self.errors: list[str] = []
        """Sink failures (the first few): a failing sink never stops training; reported here and once on stderr."""
        self.closed = False

    @property
    def prometheus_url(self) -> str | None:
        return next((s.url for s in self.sinks if isinstance(s, PrometheusSink)), None)

    def sampling(self, step: int) -> bool:
        """Whether step ``step`` measures the compression error."""
        return step % self.spec.error_every == 0

    def publish(self, rec: dict) -> dict:
        """Complete ``rec`` (a component's step) and send it to every sink; returns the complete record."""
        t0 = time.perf_counter()
        with self._lock:
            key = (rec["rank"], rec["source"])
            ra = self._alerts.get(key)
            if ra is None:
                ra = self._alerts[key] = RankAlerts(self.spec.alerts)
            full = {"schema": live.SCHEMA, "time": time.time(), "job": self.spec.job}
            for k in live.FIELDS[3:-1]:
                v = rec.get(k)
                full[k] = None if isinstance(v, float) and not math.isfinite(v) else v
            full["alerts"] = []
            full["alerts"] = [{"kind": a["kind"], "message": a["message"]} for a in ra.update(full)]
            if not self.closed:
                for s in self.sinks:
                    try:
                        s.write(full)
                    except Exception as e:  # a full disk, a closed port: reported, never raised into the step
                        if len(self.errors) < 10:
                            self.errors.append(f"{type(s).__name__}: {type(e).__name__}: {e}")
                            if len(self.errors) == 1:
                                import sys

                                print(f"torsh live metrics: {self.errors[0]}", file=sys.stderr)
            self.records += 1
            self.publish_s += time.perf_counter() - t0
        return full

    def close(self) -> None:
        """Close the sinks (the Prometheus server stops) and leave the slot if this publisher holds it."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            for s in self.sinks:
                s.close()
        if live.publisher is self:
            live.publisher = None

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, *exc: object) -> bool:
        self.close()
        return False

    def __repr__(self) -> str:
        where = [type(s).__name__ for s in self.sinks]
        return f"Publisher({', '.join(where)}, job={self.spec.job!r}, records={self.records})"


def watch(spec: LiveSpec | None = None, **options: object) -> Publisher:
    """Start publishing this process's live metrics (``spec`` and/or :class:`LiveSpec`'s fields as keywords);
    returns the :class:`Publisher`, a context manager that stops it. One publisher per process."""
    spec = LiveSpec.build(spec, options, "watch")
    if live.publisher is not None and not live.publisher.closed:
        raise InvalidArgumentError(f"watch: this process already publishes live metrics ({live.publisher!r}); close "
                                   "it first")  # fmt: skip
    pub = Publisher(spec)
    live.publisher = pub
    return pub


def start_from_env() -> Publisher | None:
    """Start a publisher from ``TORSH_LIVE`` (a directory), ``TORSH_LIVE_PROMETHEUS`` (a base port),
    ``TORSH_LIVE_TENSORBOARD`` (a log directory) and ``TORSH_LIVE_JOB`` (the job's name), if any is set and no
    publisher is active; it closes at exit."""
    d = os.environ.get(ENV_DIR, "").strip() or None
    tb = os.environ.get(ENV_TENSORBOARD, "").strip() or None
    port = os.environ.get(ENV_PROMETHEUS, "").strip() or None
    if d is None and tb is None and port is None:
        return None
    if live.publisher is not None:
        return live.publisher
    if port is not None:
        if not port.isdigit():
            raise InvalidArgumentError(f"{ENV_PROMETHEUS}={port!r}: expected a port number (0: any free port)")
        port = int(port)
    job = os.environ.get(ENV_JOB, "").strip() or "torsh"
    pub = watch(dir=d, prometheus=port, tensorboard=tb, job=job)
    atexit.register(pub.close)
    return pub
