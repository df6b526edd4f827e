"""The timeline recorder: Chrome Trace Event JSON, one file per rank, loadable in Perfetto and ``torsh timeline``.

Usage::

    from torsh_kernels.profiling import timeline

    with timeline.Recorder("traces/"):          # writes traces/rank{R}.json on exit
        for i, batch in enumerate(loader):
            with timeline.step(i):               # step markers: `torsh timeline --step N`
                with timeline.record("forward"):
                    loss = model(batch)
                with timeline.record("backward"):
                    loss.backward()
                opt.step()

or ``TORSH_TRACE=traces/ torchrun ...``: importing torsh_kernels starts a recorder that writes its file
when the process exits (``run_local``'s ranks write theirs before they leave).

Where the trace goes is checked when recording starts, not when it ends: ``start()`` (and so ``with
Recorder(dir)``) and ``import torsh_kernels`` under ``TORSH_TRACE`` create the directory and prove it
writable, raising :class:`~torsh_kernels.errors.FileAccessError` if it is not, before any work is done.
Files are written whole through an exclusive, symlink-safe temporary file (:mod:`torsh_kernels.files`).
If writing at exit still fails (the disk filled up, the directory was removed), the error is printed on
stderr and the trace is written to a new directory under the system's temporary directory instead, whose
path is printed. (Python's ``atexit`` cannot change the exit status: only ``os._exit`` could, and it would
skip the exit handlers registered before torsh_kernels was imported, such as logging's final flush.)

What is recorded while a recorder is active (each event's ``cat``):

- ``op``: every fused-op launch, from the provider dispatcher: name, provider, shapes, bytes of tensor
  arguments; compression kernels are ``compression``;
- ``collective``: every collective of a :class:`~torsh_kernels.collectives.TorchCommunicator`, from
  issue to completion (gloo: the moment the backend completes it; CUDA: events on the current stream,
  from issue to the point where that stream may use the result): op, bytes, estimated bytes on the
  wire, group, sequence number, and the algorithm and compressor of the compressed all-reduce that
  issued it; plus a ``wire bytes`` counter;
- ``bucket``: a DDP hook's or GradientSynchronizer's bucket from submission to completion;
- ``compression``: compressing, issuing and decompressing one round of a compressed all-reduce;
- ``wait``: a thread blocked on a collective;
- ``user`` and ``step``: :func:`record` and :func:`step`;
- ``module``: with ``Recorder(model=net)`` (or :meth:`Recorder.watch`), the model's forward (``forward``)
  and backward (``backward``, from the first gradient reaching the model's output to the end of that
  backward pass), and the forward of its submodules down to ``module_depth`` (``forward a.b``), from
  module and autograd hooks installed while recording and removed when it stops.

While a torch.profiler records, the spans on threads are also ``record_function`` ranges in its trace
(see :mod:`torsh_kernels.recording`).

Lanes (``tid``) never hold partially overlapping complete events, so Perfetto accepts the file: spans
on one thread nest; spans that outlive their caller (collectives and buckets in flight) are packed
into ``comm N`` / ``bucket N`` lanes where each is free; GPU spans (CUDA events, read back when the
trace is written, so recording adds no synchronisation) get one lane per stream. Timestamps are
microseconds on one axis for all ranks: a monotonic clock (``time.perf_counter_ns``) anchored to the
wall clock once, when the recorder is created, counted from midnight UTC of that day
(``otherData.clock.base_unix_us``; readers add it to align ranks). Ranks on one host share the clock;
across hosts the alignment is as good as the hosts' clock synchronisation (NTP/PTP).

The file's first entry is ``distributedInfo`` (backend, rank, world size, process groups), in the form
Kineto writes it and with the spacing Holistic Trace Analysis looks for, so HTA tells the ranks apart.
That file form (lanes, metadata, ``distributedInfo``, :func:`dumps`) is
:mod:`~torsh_kernels.profiling.trace_format`.
"""

from __future__ import annotations

import atexit
import os
import platform
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from .. import recording
from ..collectives.traffic import wire_bytes
from ..errors import ArgumentTypeError, InvalidArgumentError
from ..files import check_writable_dir, write_atomic
from .trace_format import chrome_events, collect_dist_info, distributed_info, dumps, metadata_events
from .traces import TORSH_OPS

__all__ = ["ENV_VAR", "SCHEMA", "Recorder", "current", "record", "start_from_env", "step"]

ENV_VAR = "TORSH_TRACE"
SCHEMA = "torsh-trace/1"

# ops whose launches are recorded as compression (the rest are "op"; the loader classifies those by TORSH_OPS)
COMPRESSION_OPS = frozenset(name for name, cls in TORSH_OPS.items() if cls == "compression")


def _now() -> int:
    return time.perf_counter_ns()


class _Span:
    """A complete event on the thread that opens it (and, with a CUDA device, on its current stream); while
    a torch profiler records, also a ``record_function`` range."""

    __slots__ = ("args", "cat", "dev", "ev0", "lane", "name", "rec", "rf", "st", "t0")

    def __init__(self, rec: Recorder, name: str, cat: str, args: dict | None, dev) -> None:
        self.rec, self.name, self.cat, self.args, self.dev = rec, name, cat, args, dev
        self.ev0 = self.rf = None

    def __enter__(self) -> _Span:
        rec = self.rec
        self.st = st = rec._stack()
        st.append(self)
        self.lane = rec._thread_lane()
        if self.dev is not None:
            self.ev0 = rec._cuda_event(self.dev)
        if recording.profiler._is_profiler_enabled:
            self.rf = recording.range_enter(self.name, self.cat)
        self.t0 = _now()
        return self

    def __exit__(self, *exc: object) -> bool:
        t1 = _now()
        rec = self.rec
        st = self.st
        if st and st[-1] is self:
            st.pop()
        if self.rf is not None:
            recording.range_exit(self.rf)
            self.rf = None
        rec._add(("X", self.name, self.cat, self.t0, t1, self.lane, self.args))
        if self.ev0 is not None:
            rec._gpu_span(self.name, self.cat, self.ev0, self.dev, self.args)
        return False

    def end(self, **args: object) -> None:
        if args:
            self.args = {**(self.args or {}), **args}
        self.__exit__(None, None, None)


class _Interval:
    """An event that outlives the call that started it (a collective or a bucket in flight); ``end()``
    may come from any thread, once."""

    __slots__ = ("args", "cat", "dev", "done", "ev0", "lane", "name", "rec", "t0")

    def __init__(self, rec: Recorder, name: str, cat: str, args: dict, lane: str, dev) -> None:
        self.rec, self.name, self.cat, self.args, self.lane, self.dev = rec, name, cat, args, lane, dev
        self.ev0 = rec._cuda_event(dev) if dev is not None else None
        self.done = False
        self.t0 = _now()

    def end(self, **args: object) -> None:
        with self.rec._lock:  # the backend's completion callback and wait() may race to end it
            if self.done:
                return
            self.done = True
        t1 = _now()
        if args:
            self.args = {**self.args, **args}
        rec = self.rec
        if self.ev0 is not None:
            rec._gpu_span(self.name, self.cat, self.ev0, self.dev, self.args, lane=self.lane)
        else:
            rec._add(("A", self.name, self.cat, self.t0, t1, self.lane, self.args))


class Recorder:
    """Records spans from every layer while active; writes ``rank{R}.json`` (see the module docstring).

    ``directory``: where :meth:`write` (and leaving the ``with`` block) puts the file; None: call
    ``write(directory)`` yourself. ``rank``/``world_size``: default to torch.distributed's once it is
    initialised (else ``RANK``/``WORLD_SIZE``, else 0/1). ``cuda``: time GPU work with CUDA events
    (default: when CUDA is available). ``max_events``: recording stops adding events past this many
    (the trace then says how many were dropped) so a forgotten recorder cannot exhaust memory.
    ``model``: a module (or several) whose forward and backward the recorder records itself
    (:meth:`watch`); ``module_depth``: also the forward of submodules that many levels down (0: the model
    only). One recorder is active per process at a time; ``start()``/``stop()`` may alternate to record
    several windows into one trace.
    """

    def __init__(
        self,
        directory: str | os.PathLike | None = None,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        cuda: bool | None = None,
        max_events: int = 2_000_000,
        model: torch.nn.Module | Sequence[torch.nn.Module] | None = None,
        module_depth: int = 0,
    ) -> None:
        for name, v, lo in (("rank", rank, 0), ("world_size", world_size, 1)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < lo):
                raise InvalidArgumentError(f"Recorder: {name} must be an int >= {lo}, got {v!r}")
        if isinstance(max_events, bool) or not isinstance(max_events, int) or max_events < 1:
            raise InvalidArgumentError(f"Recorder: max_events must be an int >= 1, got {max_events!r}")
        if directory is not None and not isinstance(directory, (str, os.PathLike)):
            raise ArgumentTypeError(f"Recorder: directory must be a path or None, got {type(directory).__name__}")
        self.directory = Path(directory) if directory is not None else None
        self.rank = rank
        self.world_size = world_size
        self.max_events = max_events
        self.from_env = False
        self.dropped = 0
        self._events: list[tuple] = []
        self._gpu: list[tuple] = []
        self._lock = threading.Lock()
        self._local = threading.local()
        self._threads: dict[int, tuple[int, str]] = {}
        self._seq: dict[str, int] = {}
        self._wire = 0
        self._cuda = torch.cuda.is_available() if cuda is None else bool(cuda)
        self._cuda_ref: dict[int, tuple[object, int]] = {}  # device index -> (reference event, its clock ns)
        # one clock for every rank: the monotonic clock, anchored to the wall clock here
        self._origin_wall_ns = time.time_ns()
        self._origin_ns = _now()
        # timestamps count from midnight UTC of that day: small numbers keep nanoseconds exact in a double
        self._base_ns = self._origin_wall_ns - self._origin_wall_ns % (86_400 * 10**9)
        self._dist: dict | None = None  # torch.distributed's backend and process groups, once seen
        self._watched: list = []  # profiling.modules.ModuleSpans, installed while active
        if model is not None:
            for m in model if isinstance(model, (list, tuple)) else (model,):
                self.watch(m, depth=module_depth)
        elif isinstance(module_depth, bool) or not isinstance(module_depth, int) or module_depth != 0:
            raise InvalidArgumentError(f"Recorder: module_depth={module_depth!r} without a model; pass model= too")

    # -- activation ---------------------------------------------------------------------------------

    @property
    def active(self) -> bool:
        return recording.recorder is self

    def __repr__(self) -> str:
        where = str(self.directory) if self.directory is not None else None
        return (
            f"Recorder(directory={where!r}, rank={self.rank}, world_size={self.world_size}, active={self.active}, "
            f"events={len(self._events) + len(self._gpu)}, dropped={self.dropped})"
        )

    def start(self) -> Recorder:
        """Make this the process's active recorder (and install its module hooks). With a directory, the
        directory is made and proved writable first (:class:`FileAccessError` if it is not)."""
        cur = recording.recorder
        if cur is self:
            return self
        if cur is not None and not isinstance(cur, recording.Bridge):  # the bridge steps aside: we mirror
            raise InvalidArgumentError(
                "Recorder.start: another recorder is already active in this process; stop() it first "
                f"(it writes to {cur.directory})"
            )
        if self.directory is not None:
            check_writable_dir(
                self.directory,
                what="Recorder: the trace directory",
                fix="pass a writable directory (or None and call write(directory) later)",
            )
        self._resolve_rank()
        recording.recorder = self
        for w in self._watched:
            w.install()
        return self

    def stop(self) -> None:
        """Stop recording (events so far are kept; ``start()`` resumes); the module hooks are removed."""
        if recording.recorder is self:
            for w in self._watched:
                w.remove()
            recording.recorder = recording.Bridge() if recording.profiler._is_profiler_enabled else None

    def watch(self, model: torch.nn.Module, *, depth: int = 0) -> Recorder:
        """Record ``model``'s forward and backward (and its submodules' forward down to ``depth`` levels)
        while this recorder is active: hooks installed at ``start()`` (now, if active) and removed at
        ``stop()``. See :mod:`~torsh_kernels.profiling.modules`."""
        from .modules import ModuleSpans

        w = ModuleSpans(self, model, depth=depth)
        self._watched.append(w)
        if self.active:
            w.install()
        return self

    def __enter__(self) -> Recorder:
        return self.start()

    def __exit__(self, *exc: object) -> bool:
        self.stop()
        if self.directory is not None:
            self.write()
        return False

    def _resolve_rank(self) -> None:
        import torch.distributed as dist

        if self._dist is None and dist.is_available() and dist.is_initialized():
            self._dist = collect_dist_info(dist)
        if self.rank is not None and self.world_size is not None:
            return
        if dist.is_available() and dist.is_initialized():
            r, w = dist.get_rank(), dist.get_world_size()
        elif "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            try:
                r, w = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            except ValueError:
                return
        else:
            return
        if self.rank is None:
            self.rank = r
        if self.world_size is None:
            self.world_size = w

    # -- recording (called by the instrumented layers through torsh_kernels.recording) --------------------

    def _add(self, ev: tuple) -> None:
        if len(self._events) >= self.max_events:
            self.dropped += 1
            return
        self._events.append(ev)  # list.append is atomic under the GIL: no lock on the hot path

    def _stack(self) -> list:
        try:
            return self._local.stack
        except AttributeError:
            self._local.stack = []
            return self._local.stack

    def _thread_lane(self) -> int:
        try:
            return self._local.lane
        except AttributeError:
            pass
        ident = threading.get_ident()
        with self._lock:
            lane = self._threads.get(ident)
            if lane is None:
                t = threading.current_thread()
                name = "main" if t is threading.main_thread() else t.name
                lane = self._threads[ident] = (len(self._threads), name)
        self._local.lane = lane[0]
        return lane[0]

    def _cuda_event(self, dev: torch.device):
        idx = dev.index if dev.index is not None else torch.cuda.current_device()
        if idx not in self._cuda_ref:
            # once per device: align the GPU's clock with ours (the only synchronisation the recorder makes)
            torch.cuda.synchronize(idx)
            ref = torch.cuda.Event(enable_timing=True)
            ref.record(torch.cuda.current_stream(idx))
            ref.synchronize()
            self._cuda_ref[idx] = (ref, _now())
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(torch.cuda.current_stream(idx))
        return ev

    def _gpu_span(self, name: str, cat: str, ev0, dev: torch.device, args: dict | None,
                  lane: str | None = None) -> None:  # fmt: skip
        idx = dev.index if dev.index is not None else torch.cuda.current_device()
        stream = torch.cuda.current_stream(idx)
        ev1 = torch.cuda.Event(enable_timing=True)
        ev1.record(stream)
        if len(self._gpu) + len(self._events) >= self.max_events:
            self.dropped += 1
            return
        self._gpu.append((name, cat, ev0, ev1, idx, lane or f"stream {stream.stream_id}", args))

    def _cuda_target(self, device) -> torch.device | None:
        """The CUDA device to time with events, or None (CPU work, or CUDA timing off)."""
        if not self._cuda or device is None:
            return None
        dev = torch.device(device)
        return dev if dev.type == "cuda" else None

    def span(self, name: str, cat: str, args: dict | None = None, *, device=None) -> _Span:
        return _Span(self, name, cat, args, self._cuda_target(device))

    def begin(self, name: str, cat: str, args: dict | None = None, *, lane: str = "comm", device=None) -> _Interval:
        """An interval that ends with ``.end()`` (from any thread), drawn in the first free ``{lane} N`` lane."""
        return _Interval(self, name, cat, dict(args or {}), lane, self._cuda_target(device))

    def counter(self, name: str, **values: float) -> None:
        self._add(("C", name, "counter", _now(), 0, None, values))

    def context(self, key: str):
        """The innermost value of ``key`` among the calling thread's open spans' args, or None."""
        for s in reversed(self._stack()):
            if s.args and key in s.args:
                return s.args[key]
        return None

    def op(self, name: str, provider: str, args: Sequence[object]) -> _Span:
        """The span of one fused-op launch: shapes and bytes of its tensor arguments."""
        shapes, nbytes, dev = [], 0, None
        for a in args:
            if isinstance(a, torch.Tensor):
                shapes.append(tuple(a.shape))
                nbytes += a.nbytes
                if dev is None and self._cuda:
                    dev = a.device
            elif isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor):
                shapes.append(f"{len(a)} tensors, {sum(t.numel() for t in a)} elements")
                nbytes += sum(t.nbytes for t in a)
                if dev is None and self._cuda:
                    dev = a[0].device
        cat = "compression" if name in COMPRESSION_OPS else "op"
        return self.span(name, cat, {"provider": provider, "shapes": shapes, "bytes": nbytes}, device=dev)

    def collective(self, op: str, *, group: Sequence[int], nbytes: int, device: torch.device) -> _Interval:
        """An issued collective, from now until ``.end()`` (its completion)."""
        if self.rank is None:
            self._resolve_rank()
        key = ",".join(map(str, group))
        seq = self._seq[key] = self._seq.get(key, 0) + 1
        wire = wire_bytes(op, nbytes, len(group))
        args = {"op": op, "bytes": nbytes, "wire_bytes": wire, "group": key, "seq": seq}
        for k in ("algorithm", "compressor"):
            v = self.context(k)
            if v is not None:
                args[k] = v
        with self._lock:
            self._wire += wire
            total = self._wire
        self.counter("wire bytes", sent=total)
        return self.begin(op, "collective", args, lane="comm", device=device)

    # -- output ---------------------------------------------------------------------------------------

    def _us(self, t_ns: int) -> float:
        return round((self._origin_wall_ns - self._base_ns + (t_ns - self._origin_ns)) / 1e3, 3)

    def _resolve_gpu(self) -> list[tuple]:
        """GPU spans as ("G", name, cat, t0, t1, lane, args), waiting for events still pending (at write time)."""
        out = []
        for name, cat, ev0, ev1, idx, lane, args in self._gpu:
            ref, ref_ns = self._cuda_ref[idx]
            ev1.synchronize()
            t0 = ref_ns + int(ref.elapsed_time(ev0) * 1e6)
            t1 = ref_ns + int(ref.elapsed_time(ev1) * 1e6)
            out.append(("G", name, cat, t0, max(t0, t1), (idx, lane), args))
        return out

    def trace(self) -> dict:
        """The Chrome trace (a JSON-ready dict) of everything recorded so far."""
        self._resolve_rank()
        rank = self.rank if self.rank is not None else 0
        world = self.world_size if self.world_size is not None else 1
        pid = rank
        threads, raw = dict(self._threads), list(self._events)
        events, lane_names = chrome_events(raw, self._resolve_gpu() if self._gpu else [], threads, self._us, pid)
        return {
            "distributedInfo": distributed_info(self._dist, rank, world),
            "traceEvents": metadata_events(pid, rank, lane_names) + events,
            "displayTimeUnit": "ms",
            "otherData": self._other_data(rank, world),
        }

    def _other_data(self, rank: int, world: int) -> dict:
        """The trace's ``otherData``: schema, rank, device, versions, the clock, the totals."""
        from ..env import device_name, versions

        cuda = self._cuda and torch.cuda.is_available()
        dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        return {
            "schema": SCHEMA,
            "rank": rank,
            "world_size": world,
            "device": device_name(dev),
            "versions": versions(),
            "host": platform.node(),
            "pid": os.getpid(),
            "clock": {
                "source": "time.perf_counter_ns (monotonic), GPU spans by CUDA events",
                "origin_unix_ns": self._origin_wall_ns,
                "origin_monotonic_ns": self._origin_ns,
                "base_unix_us": self._base_ns // 1000,
                "ts_unit": "microseconds since base_unix_us (midnight UTC of the day recording began)",
            },
            "wire_bytes": self._wire,
            "dropped_events": self.dropped,
        }

    def write(self, directory: str | os.PathLike | None = None) -> Path:
        """Write ``rank{R}.json`` into ``directory`` (default: the recorder's); returns its path."""
        d = Path(directory) if directory is not None else self.directory
        if d is None:
            raise InvalidArgumentError("Recorder.write: no directory; pass one here or to Recorder(directory)")
        data = self.trace()
        # whole or not at all, through an exclusive temporary file: a reader never sees half a file, and a
        # symlink planted at any name in the directory redirects nothing
        return write_atomic(d / f"rank{data['otherData']['rank']}.json", dumps(data), fsync=False, what="trace")


def current() -> Recorder | None:
    """The active recorder, or None (also while only a torch profiler's bridge occupies the slot)."""
    r = recording.recorder
    return r if isinstance(r, Recorder) else None


def record(name: str, **args: object):
    """A user span around a block: ``with record("forward"): ...`` (nothing when no recorder is active).
    On a CUDA job the span is also timed on the current stream with CUDA events."""
    r = recording.recorder
    if r is None:
        return recording.NULL
    if not isinstance(name, str) or not name:
        raise ArgumentTypeError(f"record: name must be a non-empty string, got {name!r}")
    return r.span(name, "user", args or None, device="cuda" if r._cuda and torch.cuda.is_available() else None)


def step(n: int, **args: object):
    """A step marker around one training step: ``with step(i): ...``; ``torsh timeline --step N`` and
    ``torsh report`` use them. Extra ``args`` (e.g. ``label="powersgd"``) are kept; the report groups
    steps by ``label``."""
    r = recording.recorder
    if r is None:
        return recording.NULL
    if isinstance(n, bool) or not isinstance(n, int):
        raise ArgumentTypeError(f"step: n must be an int, got {n!r}")
    return r.span(f"step {n}", "step", {"step": n, **args})


def start_from_env() -> Recorder | None:
    """Start a recorder writing to ``$TORSH_TRACE`` (if set and none is active); it writes at exit. The
    directory is made and proved writable now: :class:`FileAccessError` if it cannot take the trace."""
    d = os.environ.get(ENV_VAR, "").strip()
    if not d or (recording.recorder is not None and not isinstance(recording.recorder, recording.Bridge)):
        return None
    check_writable_dir(d, what=f"{ENV_VAR}: the trace directory",
                       fix=f"point {ENV_VAR} at a writable directory, or unset it to record nothing")  # fmt: skip
    rec = Recorder(d)
    rec.from_env = True
    rec.start()

    def _at_exit() -> None:
        if rec._events or rec._gpu:
            rec.stop()
            write_or_rescue(rec)

    atexit.register(_at_exit)
    return rec


def write_or_rescue(rec: Recorder) -> Path | None:
    """Write a ``TORSH_TRACE`` recorder's trace; if that fails, say so on stderr and write it to a new
    directory under the temporary directory instead (the trace is not lost). Returns where it went."""
    try:
        return rec.write()
    except Exception as e:  # at exit: nothing above us would report it
        err = f"{type(e).__name__}: {e}"
    try:
        rescue = rec.write(tempfile.mkdtemp(prefix="torsh-trace-"))
        where = f"; it was written to {rescue} instead"
    except Exception as e2:
        rescue, where = None, f", nor to a temporary directory ({type(e2).__name__}: {e2}): the trace is lost"
    print(f"torsh_kernels: error: {ENV_VAR}: could not write this process's trace to {rec.directory} ({err}){where}",
          file=sys.stderr, flush=True)  # fmt: skip
    return rescue
