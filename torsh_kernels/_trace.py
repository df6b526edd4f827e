"""The recording interface the lower layers call for the profiling layer (layer 5): one module-level slot.

``recorder`` is None unless a :class:`~torsh_kernels.profiling.timeline.Recorder` is active; then the
op dispatcher, the communicators, the compressed all-reduce, the DDP hook and the synchronizer report
their spans to it. Every call site first reads ``_trace.recorder`` and does nothing else when it is None,
so instrumentation costs one global load and a comparison when no recorder is active (``torsh bench
trace`` measures it). This module imports nothing from the package, so every layer may import it.
"""

from __future__ import annotations

__all__ = ["NULL", "recorder", "span"]

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
