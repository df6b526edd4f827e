"""The planner: the predicted time of a compressed all-reduce, and the cheapest compressor for a buffer.

Each compressor lists the ways its payload can travel (``compressor.schemes``: the collectives and the
bytes each rank puts in); the alpha-beta model of plain collectives
(:mod:`~torsh_kernels.collectives.cost_model`) prices each, and the cheapest is the compressor's time.
With ``compute_bandwidth`` (bytes/s the device streams through memory) the compressor's own passes over
the data are added, ``compressor.passes * 4 n_elements / compute_bandwidth``; the pass counts are rough
estimates of each compressor's memory traffic, in fp32 tensor sizes. ``plan`` prices a list of
candidates and picks the cheapest (``auto``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..collectives.cost_model import Link, Topology, algorithms_for, rounds_time
from ..errors import ArgumentTypeError, InvalidArgumentError
from .base import Compressor, itemsize, numel_of
from .cast import BF16, FP16, NoCompression
from .powersgd import PowerSGD
from .quantize import Quantize
from .sign import Sign
from .topk import TopK

__all__ = ["DEFAULT_CANDIDATES", "Plan", "compressed_time", "plan"]


def compressed_time(
    compressor: Compressor | None,
    shape: int | tuple[int, ...],
    topology: Topology | int,
    link: Link,
    *,
    algorithm: str | None = None,
    compute_bandwidth: float | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[str, float]:
    """(algorithm, predicted seconds) of ``compressed_all_reduce`` for a tensor of ``shape``.

    All-reduce rounds use ``algorithm`` (default: the cheapest all-reduce for the topology), and a linear
    compressor's result is named after it; the other schemes are named after the collectives they run
    (e.g. 'all_gather'). A compressor with several schemes is priced by its cheapest."""
    topo = topology if isinstance(topology, Topology) else Topology(world_size=topology)
    algos = (algorithm,) if algorithm else algorithms_for(topo)
    c = compressor if compressor is not None else NoCompression()
    compute = c.passes * 4 * numel_of(shape) / compute_bandwidth if compute_bandwidth else 0.0
    if topo.world_size == 1:
        return "none", compute
    best = None
    for name, rounds in c.schemes(shape, dtype, topo.world_size).items():
        algo, seconds = rounds_time(rounds, topo, link, algos)
        label = algo if name == "all_reduce" and algo is not None else name
        if best is None or seconds < best[1]:
            best = (label, seconds)
    if best is None:
        raise InvalidArgumentError(f"compressed_time: {type(c).__name__}.schemes() lists no scheme")
    return best[0], best[1] + compute


@dataclass(slots=True)
class Plan:
    """The cheapest (algorithm, compressor) for a buffer, with every candidate's prediction."""

    algorithm: str
    """Collective scheme: an all-reduce algorithm, or the gather scheme of a non-linear compressor."""
    compressor: Compressor | None
    """The compressor (None: uncompressed)."""
    seconds: float
    """Predicted time of the whole compressed all-reduce."""
    candidates: list[tuple[str, str, float]] = field(default_factory=list)
    """(compressor, algorithm, seconds) of every candidate, cheapest first."""


DEFAULT_CANDIDATES = (None, FP16(), BF16(), TopK(0.01), Quantize(8), Quantize(4), Sign(), PowerSGD(4))


def plan(
    nbytes: int,
    topology: Topology | int,
    link: Link,
    *,
    shape: tuple[int, ...] | None = None,
    compressors: tuple[Compressor | None, ...] | None = None,
    compute_bandwidth: float | None = None,
    dtype: torch.dtype = torch.float32,
) -> Plan:
    """The cheapest (algorithm, compressor) for an all-reduce of ``nbytes`` of ``dtype`` (``shape``
    matters to PowerSGD; default: a flat tensor). ``compressors`` defaults to no compression, fp16,
    bf16, top-k 1%, int8, int4, sign and PowerSGD rank 4; ``None`` in it means uncompressed."""
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise InvalidArgumentError(f"plan: nbytes must be an int >= 0, got {nbytes!r}")
    if not isinstance(link, Link):
        raise ArgumentTypeError(f"plan: link must be a Link, got {type(link).__name__}")
    numel = nbytes // itemsize(dtype)
    shp = shape if shape is not None else (numel,)
    cands = []
    for c in compressors if compressors is not None else DEFAULT_CANDIDATES:
        if c is not None and not isinstance(c, Compressor):
            raise ArgumentTypeError(f"plan: compressors must hold Compressors or None, got {type(c).__name__}")
        a, s = compressed_time(c, shp, topology, link, compute_bandwidth=compute_bandwidth, dtype=dtype)
        cands.append((c, a, s))
    cands.sort(key=lambda x: x[2])
    best = cands[0]
    return Plan(best[1], best[0], best[2], [("none" if c is None else c.label(), a, s) for c, a, s in cands])
