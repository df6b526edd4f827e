"""One component's steps as the live metrics and ``auto``'s link following see them: :class:`StepMeter`.

The DDP hook, the gradient synchronizer, FSDP2's quantized comms and the expert-parallel layer each keep a
meter. At the end of each step the component asks it for the step's time, the bytes its communicator put on
the wire and the seconds collectives were in flight then (the communicator's :class:`~torsh_kernels.collectives.
Traffic`, timed once someone listens or ``auto`` follows the link), and hands the record it builds
(:meth:`StepMeter.record`) to :data:`torsh_kernels.live.publisher`. Nothing here runs while nobody listens and
no ``auto`` follows: a component checks ``live.publisher`` (and its follower) first.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable

import torch

__all__ = ["StepMeter", "compressor_label", "end_step", "residual_norm2"]


class StepMeter:
    """Per component and communicator: the step clock and the traffic since the last step."""

    __slots__ = ("_busy", "_t", "_traffic", "_wire", "cost_s", "gnorm2", "sampling", "source", "steps")

    def __init__(self, source: str) -> None:
        self.source = source
        self._t: float | None = None
        self._traffic = None
        self._wire = 0
        self._busy = 0.0
        self.steps = 0
        """Records built."""
        self.sampling = False
        """Whether this step measures the compression error (the gradient norm is accumulated in ``gnorm2``)."""
        self.gnorm2: torch.Tensor | None = None
        self.cost_s = 0.0
        """Host seconds the component spent on the live metrics and the link following (measuring, sampling
        the error, building and publishing records), on its own thread: what ``torsh bench live`` reports per
        step."""

    def watch(self, comm) -> None:
        """Time ``comm``'s collectives from now on (its :class:`Traffic` counters, where it keeps them)."""
        t = getattr(comm, "traffic", None)
        if t is None or t is self._traffic:
            return
        t.timed = True
        self._traffic = t
        self._wire = t.wire_bytes
        self._busy = t.busy()

    @property
    def watched(self) -> bool:
        """Whether a communicator's collectives are being timed for this meter."""
        return self._traffic is not None

    def unwatch(self) -> None:
        """Nobody listens any more (and no ``auto`` follows the link): stop timing the communicator's collectives."""
        if self._traffic is not None:
            self._traffic.timed = False
            self._traffic = None
            self._t = None
            self.sampling = False
            self.gnorm2 = None

    def traffic(self) -> tuple[int, float]:
        """Wire bytes and seconds with a collective in flight since the last call."""
        t = self._traffic
        if t is None:
            return 0, 0.0
        w, b = t.wire_bytes, t.busy()
        dw, db = w - self._wire, b - self._busy
        self._wire, self._busy = w, b
        return dw, db

    def lap(self) -> float | None:
        """Seconds since the last call (None the first time)."""
        now = time.perf_counter()
        prev, self._t = self._t, now
        return None if prev is None else now - prev

    def add_gradients(self, tensors: Iterable[torch.Tensor]) -> None:
        """On a sampling step: add the squared norms of this rank's gradients (before they are reduced)."""
        t0 = time.perf_counter()
        for g in tensors:
            if g.layout == torch.strided and g.is_floating_point() and g.numel():
                n2 = torch.linalg.vector_norm(g, dtype=torch.float32).square()
                self.gnorm2 = n2 if self.gnorm2 is None else self.gnorm2 + n2
        self.cost_s += time.perf_counter() - t0

    def error(self, residual2: float | None) -> float | None:
        """``sqrt(residual2) / ||gradient||`` for a sampling step (None otherwise, or without residuals)."""
        g2, self.gnorm2 = self.gnorm2, None
        if not self.sampling or residual2 is None or g2 is None:
            return None
        g2 = float(g2)
        return math.sqrt(residual2 / g2) if g2 > 0 else None

    def record(self, *, step: int, rank: int, world_size: int, step_s: float | None, comm_s: float | None,
               compress_s: float | None, payload_bytes: int, sent_bytes: int, wire_bytes: int, busy_s: float,
               nonfinite: bool, compressor: str, error: float | None = None,
               switch: dict | None = None) -> dict:  # fmt: skip
        """The step's record (the fields of :data:`torsh_kernels.live.FIELDS` a component knows; the publisher
        adds the schema, time, job and alerts)."""
        self.steps += 1
        compute = None if step_s is None else max(0.0, step_s - (comm_s or 0.0) - (compress_s or 0.0))
        return {
            "rank": rank,
            "world_size": world_size,
            "source": self.source,
            "step": step,
            "step_s": step_s,
            "compute_s": compute,
            "comm_s": comm_s,
            "compress_s": compress_s,
            "wire_bytes": int(wire_bytes),
            "payload_bytes": int(payload_bytes),
            "sent_bytes": int(sent_bytes),
            "link_Bps": wire_bytes / busy_s if busy_s > 0 and wire_bytes > 0 else None,
            "ratio": payload_bytes / sent_bytes if sent_bytes else 1.0,
            "error": error,
            "nonfinite": int(bool(nonfinite)),
            "compressor": compressor,
            "switch": switch,
        }


def end_step(meter: StepMeter, engine, comm, *, step: int, comm_s: float, compress_s: float, payload_bytes: int,
             sent_bytes: int, undone: bool) -> dict | None:  # fmt: skip
    """The end of a step of a bucket engine's component (the DDP hook, the synchronizer): auto's check (a collective,
    with ``comm``; None where not every rank is at this point), then the live record when someone listens; when
    nobody listens and no auto follows, the meter stops timing. Returns auto's switch, if it made one."""
    from .. import live
    from .auto_follow import follow_step

    pub = live.publisher
    if pub is None and engine.follow is None:
        meter.unwatch()  # (the publisher closed: back to paying nothing)
        return None
    t0 = time.perf_counter()
    step_s = meter.lap()
    wire, busy = meter.traffic()
    error = meter.error(residual_norm2(engine.states.values()) if meter.sampling else None)
    label = compressor_label(engine)
    switch = None
    if comm is not None and engine.follow is not None and not undone:
        switch = follow_step(engine, comm, wire, busy, compress_s)
    if pub is not None and comm is not None:
        pub.publish(meter.record(
            step=step, rank=comm.rank, world_size=comm.world_size, step_s=step_s, comm_s=comm_s,
            compress_s=compress_s, payload_bytes=payload_bytes, sent_bytes=sent_bytes, wire_bytes=wire, busy_s=busy,
            nonfinite=undone, compressor=label, error=error, switch=switch,
        ))  # fmt: skip
    meter.sampling = pub is not None and pub.sampling(step + 1)
    meter.cost_s += time.perf_counter() - t0
    return switch


def residual_norm2(states: Iterable) -> float | None:
    """The summed squared norm of the error-feedback residuals in compressor states (None: none holds one)."""
    total = None
    for st in states:
        r = st.tensors.get("residual")
        if r is not None and r.numel():
            n2 = torch.linalg.vector_norm(r, dtype=torch.float32).square()
            total = n2 if total is None else total + n2
    return None if total is None else float(total)


def compressor_label(engine) -> str:
    """The compressor that reduced the iteration a ``BucketCompressor`` just ended ("none" in the warm-up)."""
    if engine.auto is not None:
        return engine.auto.decision.choice if engine.auto.decision is not None else "none"
    c = engine.compressor
    return "none" if c.identity or engine.iteration <= engine.spec.start_iter else c.label()
