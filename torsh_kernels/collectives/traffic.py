"""What a rank sends: :func:`wire_bytes`, the one definition of the bytes a collective puts on the wire, and
:class:`Traffic`, the counters every communicator keeps with it (the timeline, the DDP hook's and the
synchronizer's statistics, FSDP2's comm counters and ``torsh report`` all count by the same function)."""

from __future__ import annotations

import threading
import time

__all__ = ["Traffic", "wire_bytes"]

# Bytes each rank puts on the wire for an input of n bytes over w ranks, ring algorithms (what NCCL and gloo
# use for large messages; the factors of cost_model.py's ring times), in integers: all_reduce 2(w-1)/w,
# all_gather (w-1) (of the input), reduce_scatter (w-1)/w (of the input), all_to_all (w-1)/w, send 1,
# broadcast 1 of what the caller passes: the root passes its tensor, the others 0 (what enters the ring; a
# ring's non-root ranks also forward it, which is not charged to them), a receive 0.
_WIRE = {"all_reduce": lambda n, w: 2 * (w - 1) * n // w, "all_gather": lambda n, w: (w - 1) * n,
         "reduce_scatter": lambda n, w: (w - 1) * n // w, "all_to_all": lambda n, w: (w - 1) * n // w,
         "broadcast": lambda n, w: n, "send": lambda n, w: n, "barrier": lambda n, w: 2 * (w - 1) * n // w}  # fmt: skip


def wire_bytes(op: str, nbytes: int, world: int) -> int:
    """Bytes this rank sends for collective ``op`` on ``nbytes`` of input over ``world`` ranks (ring
    algorithms). The one definition of "bytes on the wire": the communicators' :class:`Traffic` counters,
    the DDP hook's and the synchronizer's statistics, FSDP2's comm counters and the timeline's ``wire
    bytes`` all use it. A receive, or an op not listed, sends nothing."""
    f = _WIRE.get(op)
    return f(int(nbytes), world) if f is not None and world > 1 else 0


class Traffic:
    """What a communicator has sent since it was made: collectives issued, their input bytes (payload)
    and the bytes this rank put on the wire for them (:func:`~torsh_kernels.collectives.wire_bytes`, the
    same figure the timeline records per collective). Read it before and after a step for that step's
    traffic (``comm.traffic.wire_bytes - before``).

    With ``timed`` set (the live metrics and ``compressor="auto"``'s link following set it; off by default,
    when it costs nothing), the communicator also reports when each collective is issued and when the
    backend completes it, and ``busy_s`` accumulates the seconds during which at least one collective was
    in flight (the union of their intervals, so collectives queued behind each other are not counted
    twice): ``wire bytes / busy seconds`` over a step is the rate the link delivered. It includes the
    time a collective waited for a slower peer to join, so it is a lower bound of the link's rate. The
    torch.distributed communicator times its collectives; one that does not leaves ``busy_s`` at 0."""

    __slots__ = ("_inflight", "_lock", "_since", "busy_s", "collectives", "payload_bytes", "timed", "wire_bytes")

    def __init__(self) -> None:
        self.collectives = 0
        self.payload_bytes = 0
        self.wire_bytes = 0
        self.timed = False
        self.busy_s = 0.0
        self._inflight = 0
        self._since = 0.0
        self._lock = threading.Lock()

    def add(self, op: str, nbytes: int, world: int) -> None:
        self.collectives += 1
        self.payload_bytes += nbytes
        self.wire_bytes += wire_bytes(op, nbytes, world)

    def issued(self) -> None:
        """A collective was issued (``timed`` only)."""
        with self._lock:
            if self._inflight == 0:
                self._since = time.perf_counter()
            self._inflight += 1

    def completed(self, _arg: object = None) -> None:
        """A collective issued with :meth:`issued` completed (or failed); callable as a future's callback."""
        with self._lock:
            if self._inflight > 0:
                self._inflight -= 1
                if self._inflight == 0:
                    self.busy_s += time.perf_counter() - self._since

    def busy(self) -> float:
        """``busy_s`` including the collectives in flight now."""
        with self._lock:
            return self.busy_s + (time.perf_counter() - self._since if self._inflight else 0.0)

    def __repr__(self) -> str:
        return (f"Traffic(collectives={self.collectives}, payload_bytes={self.payload_bytes}, "
                f"wire_bytes={self.wire_bytes})")  # fmt: skip
