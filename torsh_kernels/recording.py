"""The recording interface the lower layers call for the profiling layer (layer 5): one module-level slot.

``recorder`` is None unless a :class:`~torsh_kernels.profiling.timeline.Recorder` is active; then the
op dispatcher, the communicators, the compressed all-reduce, the DDP hook and the synchronizer report
their spans to it. Every call site first reads ``recording.recorder`` and does nothing else when it is None,
so instrumentation costs one global load and a comparison when no recorder is active (``torsh bench
trace`` measures it). This module imports nothing from the package, so every layer may import it.

**torch.profiler interop.** torsh's spans also reach torch.profiler (Kineto) traces, as
``record_function`` ranges of the same names (Kineto writes them as ``user_annotation`` events):

- This module wraps the two functions every torch profiler calls when it starts and stops recording,
  ``torch.autograd.profiler._run_on_profiler_start`` and ``_run_on_profiler_stop`` (``profile``,
  ``torch.profiler.profile`` and each cycle of its schedule, ``emit_nvtx``, ``emit_itt``). On start, if
  no recorder is active, a :class:`Bridge` goes into the slot: the recorder's interface, opening a range
  for each thread span and op launch and doing nothing for the rest (collectives and buckets in
  flight end on other threads, where a range cannot end; torch records the collectives itself). On
  stop it leaves. With no profiler running the slot holds what it held before, so the instrumented
  layers pay what they paid before.
- An active recorder mirrors its own thread spans itself while :data:`profiler` says a profiler records
  (one attribute load per span); it takes the slot from the bridge on start and gives it back on stop.
- Kineto exports a range's name but not its arguments (without ``record_shapes``), so each span's
  torsh category goes into the trace's top-level metadata through ``torch.autograd._add_metadata_json``:
  ``"torsh": {"schema": "torsh-kineto/1", "categories": {"PowerSGD round 1": "compression", ...}}``,
  which ``profiling.traces`` reads. Step markers are left out (their names say what they are).
"""

from __future__ import annotations

import contextlib
import json
import threading

__all__ = ["KINETO_SCHEMA", "NULL", "Bridge", "profiler", "range_enter", "range_exit", "recorder", "span"]

recorder = None
"""The active recorder (a ``profiling.timeline.Recorder``), or None."""


class _Null:
    """What span() returns when no recorder is active: a context manager and handle that does nothing."""

    __slots__ = ()

    def __enter__(self) -> _Null:
        return self

    def __exit__(self, *exc: object) -> bool:
        return False

    def end(self, **args: object) -> None:
        return None


NULL = _Null()


def span(name: str, cat: str, args: dict | None = None, *, device=None):
    """A span on the calling thread from ``__enter__`` to ``__exit__`` (a no-op when no recorder is active).
    ``device``: a CUDA device makes it also time the current stream's work with CUDA events."""
    r = recorder
    if r is None:
        return NULL
    return r.span(name, cat, args, device=device)


def flush() -> None:
    """Write the active recorder's trace now if ``TORSH_TRACE`` started it (for processes that leave
    through ``os._exit`` and so skip the ``atexit`` writer, like ``run_local``'s ranks)."""
    r = recorder
    if r is not None and getattr(r, "from_env", False) and (r._events or r._gpu):
        r.write()


# -- torch.profiler interop ---------------------------------------------------------------------------


class _NoProfiler:
    _is_profiler_enabled = False


profiler = _NoProfiler
"""``torch.autograd.profiler`` once hooked: ``profiler._is_profiler_enabled`` is torch's own flag, true
while a profiler records (a stand-in that is always false where torch has no such profiler)."""

KINETO_SCHEMA = "torsh-kineto/1"
_categories: dict[str, str] = {}  # name -> torsh category, in the current profiler session's metadata
_lock = threading.Lock()
_ops: tuple | None = None  # torch.ops.profiler's range enter and exit, and _add_metadata_json, on first use


def _torch_ops() -> tuple:
    global _ops
    if _ops is None:
        import torch

        _ops = (torch.ops.profiler._record_function_enter_new, torch.ops.profiler._record_function_exit._RecordFunction,
                torch.autograd._add_metadata_json, torch._C.DisableTorchFunctionSubclass)  # fmt: skip
    return _ops


def range_enter(name: str, cat: str):
    """Open a ``record_function`` range named ``name`` on this thread and put its torsh category ``cat``
    into the profiler session's metadata; returns the handle :func:`range_exit` closes."""
    enter, _, add_metadata, _ = _torch_ops()
    if cat != "step" and _categories.get(name) is None:
        with _lock:
            _categories.setdefault(name, cat)
            payload = json.dumps({"schema": KINETO_SCHEMA, "categories": _categories})
        # the last value written under a key is the one in the trace; a profiler that keeps no metadata
        # must not break the job
        with contextlib.suppress(Exception):
            add_metadata("torsh", payload)
    return enter(name, None)


def range_exit(handle) -> None:
    """Close a range :func:`range_enter` opened (with torch-function handling off, as ``record_function``
    does: it makes the exit twice as slow)."""
    _, exit_, _, no_torch_function = _torch_ops()
    with no_torch_function():
        exit_(handle)


class _Range:
    """A thread span under the bridge: a ``record_function`` range."""

    __slots__ = ("cat", "h", "name")

    def __init__(self, name: str, cat: str) -> None:
        self.name, self.cat, self.h = name, cat, None

    def __enter__(self) -> _Range:
        self.h = range_enter(self.name, self.cat)
        return self

    def __exit__(self, *exc: object) -> bool:
        h, self.h = self.h, None
        if h is not None:
            range_exit(h)
        return False

    def end(self, **args: object) -> None:
        self.__exit__(None, None, None)


class Bridge:
    """What occupies the slot while a torch profiler records and no recorder is active (see the module
    docstring): thread spans and op launches become ``record_function`` ranges; intervals in flight and
    counters, nothing. It keeps no events and writes no file."""

    from_env = False
    _cuda = False
    _events: tuple = ()
    _gpu: tuple = ()

    def __repr__(self) -> str:
        return "Bridge(torch.profiler)"

    def span(self, name: str, cat: str, args: dict | None = None, *, device=None) -> _Range:
        return _Range(name, cat)

    def op(self, name: str, provider: str, args) -> _Range:
        return _Range(name, "op")  # the reader classifies ops by its table of torsh ops

    def begin(self, name: str, cat: str, args: dict | None = None, *, lane: str = "comm", device=None) -> _Null:
        return NULL

    def collective(self, op: str, *, group, nbytes: int, device) -> _Null:
        return NULL

    def counter(self, name: str, **values: float) -> None:
        return None

    def context(self, key: str) -> None:
        return None


def _profiler_started() -> None:
    global recorder
    with _lock:
        _categories.clear()  # a new session: its metadata starts empty
    if recorder is None:
        recorder = Bridge()


def _profiler_stopped() -> None:
    global recorder
    if isinstance(recorder, Bridge):
        recorder = None


def _hook_torch_profiler() -> None:
    """Wrap torch's profiler start/stop functions (once; a torch without them is left alone)."""
    global profiler
    import logging

    try:
        import torch.autograd.profiler as tap
    except Exception:  # no profiler, nothing to bridge
        return
    start, stop = getattr(tap, "_run_on_profiler_start", None), getattr(tap, "_run_on_profiler_stop", None)
    if not callable(start) or not callable(stop) or not hasattr(tap, "_is_profiler_enabled"):
        return
    profiler = tap
    if getattr(start, "_torsh", False):
        return
    log = logging.getLogger("torsh_kernels.profiling")

    def _run_on_profiler_start() -> None:
        start()
        try:
            _profiler_started()
        except Exception as e:  # the user's profiler must start whatever happens here
            log.warning("torsh_kernels: torsh spans will not reach this torch profiler's trace (%s)", e)

    def _run_on_profiler_stop() -> None:
        stop()
        _profiler_stopped()

    _run_on_profiler_start._torsh = _run_on_profiler_stop._torsh = True
    tap._run_on_profiler_start, tap._run_on_profiler_stop = _run_on_profiler_start, _run_on_profiler_stop
    if tap._is_profiler_enabled:  # imported while a profiler records: the bridge too
        _profiler_started()


_hook_torch_profiler()
