"""What :func:`~torsh_kernels.parallel.hooks.compression_hook` reports: :class:`HookStats` (totals since
the state was made, and the last iterations' figures) and :class:`Turn`, the accounting of one iteration as
its buckets finish (from DDP's thread or the backend's completion thread); and per bucket, its timeline
interval (:func:`bucket_span`), its cost (:func:`totals`) and the statistics chained to its future
(:func:`recorded`, :func:`chained`)."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .. import recording
from ..compression import CompressedReduction, Compressor
from ..env import fmt_bytes

__all__ = ["HookStats", "Turn", "bucket_span", "chained", "recorded", "totals"]


@dataclass(slots=True)
class HookStats:
    """What the hook did since the state was made (or ``reset()``)."""

    iterations: int = 0
    """Iterations completed (the last bucket's hook ran)."""
    buckets: int = 0
    """Buckets reduced."""
    bytes_before: int = 0
    """Bytes of the gradient buckets handed to the hook."""
    bytes_after: int = 0
    """Payload bytes this rank handed to collectives for them (each collective's input; the compression
    ratio is ``bytes_before / bytes_after``)."""
    wire_bytes: int = 0
    """Bytes this rank put on the wire, every collective of the hook counted (payload rounds, PowerSGD's
    seed broadcast, non-finite flags) by :func:`~torsh_kernels.collectives.wire_bytes`, the figure the
    timeline and ``torsh report`` show as wire bytes. 0 with a communicator that keeps no
    :class:`~torsh_kernels.collectives.Traffic` counters."""
    compress_s: float = 0.0
    """Seconds spent compressing and decompressing (wall clock, this rank). For one-round buckets the
    decode runs in the collective's completion callback (gloo's thread) and is counted there."""
    wait_s: float = 0.0
    """Seconds the hook waited for collectives (communication not hidden behind backward). Only
    buckets with several rounds are counted; one-round buckets return the collective's future, which the
    last bucket's call waits for at the end of backward (where DDP would wait for it), not counted here
    (it shows in the step time)."""
    async_buckets: int = 0
    """Buckets returned as the collective's own future (one round: no wait in the hook)."""
    sparse_buckets: int = 0
    """Buckets of sparse gradients (``nn.Embedding(sparse=True)``): averaged uncompressed, as DDP does
    (:func:`~torsh_kernels.collectives.all_reduce_sparse`), never compressed."""
    nonfinite_steps: int = 0
    """Iterations where some rank's gradients held NaN/Inf under ``nonfinite="propagate"``: delivered to
    every rank uncompressed, and undone in the hook's state (the GradScaler skips them)."""
    signature_checks: int = 0
    """Signature exchanges with the other ranks (one all-gather each, once per new bucket layout or
    compressor configuration; see ``check_signatures``)."""
    signature_s: float = 0.0
    """Seconds they took (this rank, wall clock)."""
    auto: dict | None = field(default=None, repr=False)
    """With ``compressor="auto"``, once it has chosen: the choice and why (``AutoDecision.as_dict()``:
    the probed link, each candidate's measured compute, bytes, predicted wire time and break-even
    bandwidth). Kept by ``reset()``."""
    per_iteration: list[dict] = field(default_factory=list, repr=False)
    """Per iteration: bytes before/after, wire bytes, compress and wait seconds, signature exchanges and
    their seconds (the last 100)."""

    @property
    def compression_ratio(self) -> float:
        return self.bytes_before / self.bytes_after if self.bytes_after else 1.0

    def __repr__(self) -> str:
        """One line of totals; the per-iteration figures and the ``auto`` decision are attributes."""
        auto = f", auto={self.auto['choice']!r}" if self.auto else ""
        return (
            f"HookStats(iterations={self.iterations}, buckets={self.buckets} ({self.async_buckets} async, "
            f"{self.sparse_buckets} sparse), payload {fmt_bytes(self.bytes_after)} of {fmt_bytes(self.bytes_before)} "
            f"({self.compression_ratio:.3g}x), wire {fmt_bytes(self.wire_bytes)}, compress {self.compress_s:.3g} s, "
            f"wait {self.wait_s:.3g} s, signature_checks={self.signature_checks}, "
            f"nonfinite_steps={self.nonfinite_steps}{auto})"
        )

    def reset(self) -> None:
        self.iterations = self.buckets = self.bytes_before = self.bytes_after = self.async_buckets = 0
        self.wire_bytes = 0
        self.sparse_buckets = self.nonfinite_steps = self.signature_checks = 0
        self.compress_s = self.wait_s = self.signature_s = 0.0
        self.per_iteration.clear()

    def as_dict(self) -> dict:
        return {
            "iterations": self.iterations,
            "buckets": self.buckets,
            "bytes_before": self.bytes_before,
            "bytes_after": self.bytes_after,
            "wire_bytes": self.wire_bytes,
            "compression_ratio": self.compression_ratio,
            "compress_s": self.compress_s,
            "wait_s": self.wait_s,
            "async_buckets": self.async_buckets,
            "sparse_buckets": self.sparse_buckets,
            "nonfinite_steps": self.nonfinite_steps,
            "signature_checks": self.signature_checks,
            "signature_s": self.signature_s,
            "auto": self.auto,
        }


class Turn:
    """One iteration's figures, filled by each bucket as it finishes, from DDP's thread or the backend's
    completion thread; appended to ``stats.per_iteration`` once the last bucket was handed to the hook and
    every bucket has finished."""

    __slots__ = ("closed", "figures", "lock", "pending", "stats", "traffic", "wire0")

    def __init__(self, stats: HookStats) -> None:
        self.stats = stats
        self.lock = threading.Lock()
        self.pending = 0
        self.closed = False
        self.figures = {"bytes_before": 0, "bytes_after": 0, "wire_bytes": 0, "compress_s": 0.0, "wait_s": 0.0,
                        "signature_checks": 0, "signature_s": 0.0}  # fmt: skip
        self.traffic = None  # the communicator's Traffic counters, and where they stood when the iteration began
        self.wire0 = 0

    def begin(self, comm) -> None:
        """A bucket starts (before any of its collectives)."""
        with self.lock:
            self.pending += 1
            if self.traffic is None and (t := getattr(comm, "traffic", None)) is not None:
                self.traffic, self.wire0 = t, t.wire_bytes

    def record(self, before: int, cost: dict, one_round: bool) -> None:
        st = self.stats
        with self.lock:
            st.buckets += 1
            st.async_buckets += one_round
            st.bytes_before += before
            st.bytes_after += cost["bytes_sent"]
            st.compress_s += cost["compress_s"]
            st.wait_s += cost["wait_s"]
            f = self.figures
            f["bytes_before"] += before
            f["bytes_after"] += cost["bytes_sent"]
            f["compress_s"] += cost["compress_s"]
            f["wait_s"] += cost["wait_s"]
            self.pending -= 1
            self._flush()

    def close(self) -> None:
        with self.lock:
            self.closed = True
            self._flush()

    def _flush(self) -> None:
        if self.closed and self.pending == 0:
            if self.traffic is not None:  # every collective of the iteration was issued and has completed
                wire = self.traffic.wire_bytes - self.wire0
                self.figures["wire_bytes"] = wire
                self.stats.wire_bytes += wire
            self.stats.per_iteration.append(dict(self.figures))
            del self.stats.per_iteration[:-100]
            self.closed = False  # once


# -- a bucket: its timeline interval, its cost, the statistics chained to its future --------------------


def bucket_span(index: int, grads: Sequence[torch.Tensor], compressor: Compressor):
    """A timeline interval for one bucket, from now until its reductions are done (None without a recorder)."""
    rec = recording.recorder
    if rec is None:
        return None
    nbytes = sum(g.nbytes for g in grads)
    name = compressor.kind
    dev = grads[0].device if grads else None
    return rec.begin(f"bucket {index}", "bucket", {"bucket": index, "bytes": nbytes, "tensors": len(grads),
                                                   "compressor": name}, lane="bucket", device=dev)  # fmt: skip


def totals(reductions: Sequence[CompressedReduction]) -> dict[str, float]:
    """What a bucket's reductions cost: bytes this rank sent, compute and wait seconds."""
    return {
        "bytes_sent": sum(r.bytes_sent for r in reductions),
        "compress_s": sum(r.compute_s for r in reductions),
        "wait_s": sum(r.wait_s for r in reductions),
    }


def recorded(buf: torch.Tensor, r, before: int, turn: Turn, span):
    """What runs once a one-round bucket with a single reduction is decoded (in its completion callback):
    the statistics, then the bucket's buffer as the future's value."""

    def finished() -> torch.Tensor:
        turn.record(before, {"bytes_sent": r.bytes_sent, "compress_s": r.compute_s, "wait_s": r.wait_s}, True)
        if span is not None:
            span.end()
        return buf

    return finished


def chained(futs: list, buf: torch.Tensor, reductions: list, before: int, turn: Turn, span):
    """The future DDP waits on for a one-round bucket: the collectives' own, the decode chained to it
    (inside each reduction's future), then the statistics; its value is the bucket's buffer."""

    def finished(f: torch.futures.Future) -> torch.Tensor:
        t0 = time.perf_counter()
        v = f.value()  # raises the collective's (or the decode's) error
        if len(futs) > 1:
            for x in v:
                x.value()
        cost = totals(reductions)
        cost["compress_s"] += time.perf_counter() - t0
        turn.record(before, cost, True)
        if span is not None:
            span.end()
        return buf

    f = futs[0] if len(futs) == 1 else torch.futures.collect_all(futs)
    return f.then(finished)
