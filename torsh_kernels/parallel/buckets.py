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

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..checks import check_choice, check_int, check_number
from ..compression import CompressionState, Compressor
from ..specs import Spec

__all__ = [
    "AUTO_START_ITER",
    "GATHER_PLAIN_BYTES",
    "NONFINITE",
    "POLICIES",
    "BucketPlan",
    "BucketSpec",
    "carries_plain",
    "contiguous_span",
    "flat_view",
]

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


# -- what one bucket layout gets, worked out once ----------------------------------------------------


def contiguous_span(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether the tensors lie back to back in memory, in order (views of one flat buffer)."""
    for a, b in itertools.pairwise(tensors):
        if b.data_ptr() != a.data_ptr() + a.numel() * a.element_size() or a.dtype != b.dtype:
            return False
    return all(t.is_contiguous() for t in tensors)


def flat_view(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """A flat view covering ``tensors`` when they lie back to back, else None."""
    if not contiguous_span(tensors):
        return None
    first = tensors[0]
    total = sum(t.numel() for t in tensors)
    return torch.as_strided(first, (total,), (1,), first.storage_offset())


@dataclasses.dataclass(slots=True)
class BucketPlan:
    """What one bucket layout gets, worked out once (shapes checked, eligibility, round structure) and
    reused every step."""

    compressed: list[list[int]]
    """Groups of tensor positions compressed together (one group per tensor: layerwise)."""
    plain: list[int]
    """Positions sent uncompressed, in one batched all-reduce."""
    single_round: bool = True
    """Every reduction of the bucket has one round (see the module docstring)."""
    state_keys: list[tuple[int, ...]] = dataclasses.field(default_factory=list)
    """The compressor state of each compressed group."""
    states: list[CompressionState] | None = None
    """Those states, looked up once (reset when the states change)."""
    work: CompressionState = dataclasses.field(default_factory=CompressionState)
    """The state a stateless compressor (a cast) gets for this bucket: it keeps the wire buffer."""
    carry: bool | None = None
    """The plain tensors ride in the compressed tensors' first collective (decided at the first step)."""


GATHER_PLAIN_BYTES = 64 << 10
"""Uncompressed tensors ride in an all-gather (top-k's) only while the extra bytes every rank receives
over a plain all-reduce of them, about ``(world_size - 2) * their bytes``, stay below this: about a
collective's latency on a 10 Gbit/s link, the cost of the all-reduce the ride saves. An all-reduce (PowerSGD's
P) carries them at no extra cost at any world size."""


def carries_plain(c: Compressor, plan: BucketPlan, plain: list[torch.Tensor], world_size: int) -> bool:
    """Whether the plan's plain tensors ride in the compressed tensors' first collective (see
    :data:`GATHER_PLAIN_BYTES`)."""
    if not (plan.compressed and c.carries_plain and len({t.dtype for t in plain}) == 1):
        return False
    if c.is_linear or world_size <= 2:
        return True
    return (world_size - 2) * sum(t.numel() * t.element_size() for t in plain) <= GATHER_PLAIN_BYTES
