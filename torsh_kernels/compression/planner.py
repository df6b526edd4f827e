"""The planner: the predicted time of a compressed all-reduce, and the cheapest compressor for a buffer.

Each compressor lists the ways its payload can travel (``compressor.schemes``: the collectives and the
bytes each rank puts in); the alpha-beta model of plain collectives
(:mod:`~torsh_kernels.collectives.cost_model`) prices each, and the cheapest is the compressor's time.
With ``compute_bandwidth`` (bytes/s the device streams through memory) the compressor's own passes over
the data are added, ``compressor.passes * 4 n_elements / compute_bandwidth``; the pass counts are rough
estimates of each compressor's memory traffic, in fp32 tensor sizes, and miss what is not memory-bound
(PowerSGD's matrix products and orthogonalisation, top-k's selection, per-call host time). Measured
costs are better: :func:`measure_compute` times each compressor's real reduction of a tensor of the given
shape on this device (over a :class:`~torsh_kernels.collectives.replica.ReplicaCommunicator`, so decoding
``world_size`` payloads is included and the network is not), and ``plan(compute_seconds=...)`` uses those
seconds instead. Without either, compute is free and the most compressing candidate wins on every link.
``plan`` prices a list of candidates and picks the cheapest. For a training job,
``compressor="auto"`` in the DDP hook and the synchronizer measures on the job's own buckets and link
(:mod:`torsh_kernels.parallel.auto`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from ..collectives.cost_model import Link, Topology, algorithms_for, rounds_time
from ..collectives.replica import ReplicaCommunicator
from ..errors import ArgumentTypeError, InvalidArgumentError
from .allreduce import start_compressed_all_reduce
from .base import Compressor, itemsize, numel_of
from .cast import NoCompression
from .names import DEFAULT_CANDIDATE_NAMES, as_compressor, compressor_from_name

__all__ = ["DEFAULT_CANDIDATES", "Plan", "compressed_time", "measure_compute", "plan"]


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


DEFAULT_CANDIDATES = tuple(None if n == "none" else compressor_from_name(n) for n in DEFAULT_CANDIDATE_NAMES)
""":data:`~torsh_kernels.compression.names.DEFAULT_CANDIDATE_NAMES` as compressors (None: uncompressed)."""


def plan(
    nbytes: int,
    topology: Topology | int,
    link: Link,
    *,
    shape: tuple[int, ...] | None = None,
    compressors: tuple[Compressor | str | None, ...] | None = None,
    compute_bandwidth: float | None = None,
    compute_seconds: Mapping[str, float] | None = None,
    dtype: torch.dtype = torch.float32,
) -> Plan:
    """The cheapest (algorithm, compressor) for an all-reduce of ``nbytes`` of ``dtype`` (``shape``
    matters to PowerSGD; default: a flat tensor). ``compressors`` defaults to no compression, fp16,
    bf16, top-k 1%, int8, int4, sign and PowerSGD rank 4; ``None`` in it means uncompressed, a string is a
    compressor's name (``"int8"``, ``"topk:0.01"``: :mod:`~torsh_kernels.compression.names`).

    Compute: ``compute_seconds`` maps each candidate's name (``"none"`` for uncompressed; as
    :func:`measure_compute` returns) to its measured seconds, and must cover every candidate; else
    ``compute_bandwidth`` estimates it from the pass counts; else it is left out."""
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise InvalidArgumentError(f"plan: nbytes must be an int >= 0, got {nbytes!r}")
    if not isinstance(link, Link):
        raise ArgumentTypeError(f"plan: link must be a Link, got {type(link).__name__}")
    numel = nbytes // itemsize(dtype)
    shp = shape if shape is not None else (numel,)
    cands = []
    for c in compressors if compressors is not None else DEFAULT_CANDIDATES:
        c = as_compressor(c, "plan: compressors")
        if c is not None and not isinstance(c, Compressor):
            raise ArgumentTypeError(f"plan: compressors must hold Compressors or None, got {type(c).__name__}")
        if compute_seconds is not None:
            label = _label(c)
            if label not in compute_seconds:
                raise InvalidArgumentError(
                    f"plan: compute_seconds has no entry for {label!r}; give one per candidate "
                    f"(measure_compute returns them), got {sorted(compute_seconds)}"
                )
            extra = compute_seconds[label]
            if not isinstance(extra, (int, float)) or not math.isfinite(extra) or extra < 0:
                raise InvalidArgumentError(f"plan: compute_seconds[{label!r}] must be finite and >= 0, got {extra!r}")
            a, s = compressed_time(c, shp, topology, link, dtype=dtype)
            s += extra
        else:
            a, s = compressed_time(c, shp, topology, link, compute_bandwidth=compute_bandwidth, dtype=dtype)
        cands.append((c, a, s))
    cands.sort(key=lambda x: x[2])
    best = cands[0]
    return Plan(best[1], best[0], best[2], [(_label(c), a, s) for c, a, s in cands])


def _label(c: Compressor | None) -> str:
    return "none" if c is None else c.name


def measure_compute(
    shape: int | tuple[int, ...],
    world_size: int,
    *,
    compressors: Sequence[Compressor | None] | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    repeats: int = 3,
) -> dict[str, float]:
    """Seconds each compressor's ``compressed_all_reduce`` of a ``shape`` tensor of ``dtype`` computes on
    ``device`` at ``world_size`` ranks, the network left out: the real reduction over a
    :class:`~torsh_kernels.collectives.replica.ReplicaCommunicator` (compress, decode ``world_size``
    payloads, the host work around them), on random values; the fastest of ``repeats`` runs after one
    untimed run (state set-up). Returns ``{label: seconds}`` for :func:`plan`'s ``compute_seconds``."""
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise InvalidArgumentError(f"measure_compute: repeats must be an int >= 1, got {repeats!r}")
    device = torch.device(device)
    shp = (shape,) if isinstance(shape, int) else tuple(shape)
    gen = torch.Generator().manual_seed(0)
    out: dict[str, float] = {}
    for c in compressors if compressors is not None else DEFAULT_CANDIDATES:
        c = as_compressor(c, "plan: compressors")
        if c is not None and not isinstance(c, Compressor):
            raise ArgumentTypeError(
                f"measure_compute: compressors must hold Compressors or None, got {type(c).__name__}"
            )
        comp = c if c is not None else NoCompression()
        state = comp.new_state()
        best = math.inf
        for run in range(repeats + 1):
            x = torch.randn(shp, generator=gen).mul_(1e-3).to(device=device, dtype=dtype)
            comm = ReplicaCommunicator(world_size, device)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            start_compressed_all_reduce(x, comm, comp, state).wait()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if run:
                best = min(best, time.perf_counter() - t0)
        out[_label(c)] = best
    return out
