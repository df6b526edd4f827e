"""How a gradient bucket is reduced: :class:`BucketSpec`, the settings the DDP hook and the gradient
synchronizer share (their engine, :mod:`torsh_kernels.parallel.engine`, runs them).

The compressor is not among them: it is a spec of its own (a :class:`~torsh_kernels.compression.Compressor`,
its wire scheme included); the bucket settings say which gradients of a bucket go through it, from which
step, and what a non-finite gradient does::

    hook = CompressionHookState(compressor=PowerSGD(rank=4), bucket=BucketSpec(min_numel=4096))
    # the same, built from keywords once:
    hook = CompressionHookState(compressor=PowerSGD(rank=4), min_numel=4096)
"""

from __future__ import annotations

from dataclasses import dataclass

from ..checks import check_choice, check_int, check_number
from ..specs import Spec

__all__ = ["AUTO_START_ITER", "NONFINITE", "POLICIES", "BucketSpec"]

POLICIES = ("layerwise", "bucket")
"""``BucketSpec.policy``: each gradient compressed on its own, or a bucket's eligible gradients as one tensor."""
NONFINITE = ("auto", "propagate", "raise")
"""``BucketSpec.nonfinite``: what a NaN/Inf gradient does."""
AUTO_START_ITER = 2
"""``compressor="auto"``'s default warm-up: DDP rebuilds its buckets after the first iteration, so the
second one shows the layout the job keeps; the choice is made as the third begins."""


@dataclass(frozen=True, kw_only=True, slots=True)
class BucketSpec(Spec):
    """Which gradients of a bucket are compressed, from when, and what a non-finite one does."""

    start_iter: int | None = None
    """Iterations of plain all-reduce before compression starts (None: the compressor's own, e.g.
    PowerSGD's ``start_iter``; 2 for ``compressor="auto"``; else 0)."""
    min_compression_rate: float | None = None
    """Compress a gradient only if its bytes over its payload's bytes reach this (None: the compressor's own,
    PowerSGD's; else 2.0)."""
    min_numel: int = 1024
    """Gradients with fewer elements are sent uncompressed."""
    policy: str = "layerwise"
    """"layerwise" (each gradient on its own) or "bucket" (the bucket's eligible gradients as one tensor)."""
    nonfinite: str = "auto"
    """What a NaN/Inf gradient does. "propagate": every rank's gradient receives it (the bucket is averaged
    uncompressed), so ``torch.amp.GradScaler`` skips the step, and the compressor states are left exactly as
    before that iteration. "raise": the compressor raises ``NonFiniteError`` on the rank that holds it.
    "auto": "propagate" when the process holds an enabled ``torch.amp.GradScaler`` at the first bucket, else
    "raise"."""

    def __post_init__(self) -> None:
        what = "BucketSpec"
        if self.start_iter is not None:
            self.normalize("start_iter", check_int(self.start_iter, what, "start_iter", 0))
        if self.min_compression_rate is not None:
            self.normalize(
                "min_compression_rate", check_number(self.min_compression_rate, what, "min_compression_rate", lo=0.0)
            )
        self.normalize("min_numel", check_int(self.min_numel, what, "min_numel", 0))
        check_choice(self.policy, what, "policy", POLICIES)
        check_choice(self.nonfinite, what, "nonfinite", NONFINITE)

    def resolved(self, warmup: tuple[int, float], auto: bool) -> BucketSpec:
        """This spec with ``start_iter`` and ``min_compression_rate`` decided: the compressor's own
        (``warmup``: its ``Compressor.warmup()``) where None, ``AUTO_START_ITER`` for ``compressor="auto"``."""
        start = self.start_iter
        if start is None:
            start = AUTO_START_ITER if auto else warmup[0]
        rate = self.min_compression_rate if self.min_compression_rate is not None else float(warmup[1])
        if start == self.start_iter and rate == self.min_compression_rate:
            return self
        return self.replace(start_iter=start, min_compression_rate=rate)
