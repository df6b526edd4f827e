"""The plan of the RDMA transport's data path (:mod:`.rdma`), which runs without a NIC: how a message is
cut into chunks of at most one staging slot (:func:`chunk_spans`), the segments and steps of a ring
collective on one rank (:func:`segments`, :func:`ring_plan`), and what a receive does with a chunk that
landed in a slot (:func:`copier`: copy it into place or reduce it into what is there).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from ..errors import InvalidArgumentError

__all__ = ["RingStep", "chunk_spans", "copier", "ring_plan", "segments"]


def chunk_spans(nelem: int, itemsize: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """(element offset, element count) of each chunk of a message of ``nelem`` elements, each at most
    ``chunk_bytes`` bytes and a whole number of elements; a message of no elements is one empty chunk
    (it still travels, so both sides agree on the count)."""
    if chunk_bytes < itemsize:
        raise InvalidArgumentError(f"chunk_spans: chunk_bytes={chunk_bytes} is below one element ({itemsize} B)")
    per = chunk_bytes // itemsize
    if nelem == 0:
        return [(0, 0)]
    return [(o, min(per, nelem - o)) for o in range(0, nelem, per)]


def segments(numel: int, world: int) -> list[tuple[int, int]]:
    """(offset, count) of the ``world`` ring segments of ``numel`` elements, the first ``numel % world``
    one element longer."""
    base, extra = divmod(numel, world)
    out, off = [], 0
    for i in range(world):
        n = base + (i < extra)
        out.append((off, n))
        off += n
    return out


@dataclasses.dataclass(frozen=True, slots=True)
class RingStep:
    """One step of a ring collective on one rank: send segment ``send`` to the right neighbour, receive
    segment ``recv`` from the left one and reduce it into place (``reduce``) or copy it (all-gather)."""

    phase: str
    step: int
    send: int
    recv: int
    reduce: bool


def ring_plan(world: int, rank: int, phases: str = "all_reduce") -> list[RingStep]:
    """The steps of a ring ``"all_reduce"`` (reduce-scatter then all-gather), ``"reduce_scatter"`` (rank r
    ends holding the full reduction of segment r) or ``"all_gather"`` (rank r starts with segment r)."""
    if phases not in ("all_reduce", "reduce_scatter", "all_gather"):
        raise InvalidArgumentError(
            f"ring_plan: phases must be all_reduce, reduce_scatter or all_gather, got {phases!r}"
        )
    if not 0 <= rank < world:
        raise InvalidArgumentError(f"ring_plan: rank {rank} is not in [0, {world})")
    steps = []
    if phases in ("all_reduce", "reduce_scatter"):
        for s in range(world - 1):
            steps.append(RingStep("reduce_scatter", s, (rank - s - 1) % world, (rank - s - 2) % world, True))
    if phases in ("all_reduce", "all_gather"):
        for s in range(world - 1):
            steps.append(RingStep("all_gather", s, (rank - s) % world, (rank - s - 1) % world, False))
    return steps


def copier(flat: torch.Tensor, base: int = 0, op: str | None = None) -> Callable[[torch.Tensor, int], None]:
    """What a receive does with a chunk of bytes landing at element ``eoff`` of a message placed at element
    ``base`` of ``flat``: copy it there, or with ``op`` reduce it into what is there."""

    def consume(chunk: torch.Tensor, eoff: int) -> None:
        vals = chunk.view(flat.dtype)
        dst = flat[base + eoff : base + eoff + vals.numel()]
        if op is None:
            dst.copy_(vals)
        elif op in ("sum", "avg"):
            dst.add_(vals)
        elif op == "max":
            torch.maximum(dst, vals, out=dst)
        elif op == "min":
            torch.minimum(dst, vals, out=dst)
        else:
            dst.mul_(vals)

    return consume
