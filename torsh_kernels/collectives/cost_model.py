"""An alpha-beta cost model for all-reduce algorithms and compressed all-reduce, with a link probe.

A message of ``n`` bytes over a link costs ``alpha + n * beta`` (``alpha``: latency per message,
``beta = 1 / bandwidth``). For ``p`` ranks and an ``n``-byte buffer per rank:

========================  =================================================  ==========================
algorithm                 time                                               source
========================  =================================================  ==========================
ring                      ``2 (p-1) alpha + 2 (p-1)/p n beta``               Patarasuk & Yuan 2009;
                                                                              Thakur et al. 2005, sec. 4
tree (recursive doubling) ``s (alpha + n beta)``, ``s = log2 p`` for a       Thakur et al. 2005, sec. 4
                          power of two, ``floor(log2 p) + 2`` otherwise
                          (the extra steps fold the surplus ranks in and out)
rabenseifner              ``2 s alpha + 2 (p-1)/p n beta`` (reduce-scatter   Rabenseifner 2004;
                          by recursive halving, all-gather by doubling)      Thakur et al. 2005, sec. 4
hierarchical              ``2 [(L-1) a_i + (L-1)/L n b_i]`` (reduce-scatter  Sanders et al. 2019 ch. 13;
                          and all-gather inside a node of L ranks)           NCCL/Horovod hierarchical
                          ``+ 2 (N-1) a_e + 2 (N-1)/N (n/L) b_e`` (ring      all-reduce
                          all-reduce of one shard across N nodes)
all-gather (ring)         ``(p-1) alpha + (p-1) m beta``, m bytes per rank   Thakur et al. 2005, sec. 3
all-to-all (pairwise)     ``(p-1) alpha + (p-1)/p n beta``, n bytes sent     Thakur et al. 2005, sec. 3
========================  =================================================  ==========================

References: R. Thakur, R. Rabenseifner, W. Gropp, "Optimization of Collective Communication Operations
in MPICH", IJHPCA 19(1), 2005. P. Patarasuk, X. Yuan, "Bandwidth optimal all-reduce algorithms for
clusters of workstations", JPDC 69(2), 2009. R. Rabenseifner, "Optimization of Collective Reduction
Operations", ICCS 2004. P. Sanders, K. Mehlhorn, M. Dietzfelbinger, R. Dementiev, "Sequential and
Parallel Algorithms and Data Structures", Springer 2019.

Flat algorithms on several nodes run at the pace of the slowest link they cross (the inter-node one).
The local reduction (gamma) term is left out: the reduction runs at memory speed, far above the link.

Compressed all-reduce moves each compressor's payload with the collective it needs (see
``compressed.py``): linear payloads (fp16, bf16, PowerSGD's P and Q, one all-reduce each) with the best
all-reduce above; top-k with an all-gather; quantized with an all-gather or with an all-reduce(max) of
the scales plus an integer all-reduce of the codes, whichever is cheaper; sign with an all-to-all and
an all-gather. With ``compute_bandwidth`` (bytes/s the device streams through memory) the compressor's
own passes over the data are added, ``passes * 4 n_elements / compute_bandwidth``; the pass counts
(``COMPUTE_PASSES``) are rough estimates of each compressor's memory traffic, in fp32 tensor sizes.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from ..compression import BF16, FP16, Compressor, NoCompression, PowerSGD, Quantize, Sign, TopK
from ..errors import ArgumentTypeError, InvalidArgumentError
from ..ops.compress import QMAX
from .communicator import Communicator

__all__ = [
    "COMPUTE_PASSES",
    "Link",
    "Plan",
    "Topology",
    "all_gather_time",
    "all_reduce_time",
    "all_to_all_time",
    "compressed_time",
    "plan",
    "probe",
    "probe_topology",
    "quantize_shared_scale_cheaper",
]

ALGORITHMS = ("ring", "tree", "rabenseifner", "hierarchical")

# fp32-tensor-sized passes over memory per compress + decompress (rough; see the module docstring)
COMPUTE_PASSES = {"NoCompression": 0.0, "FP16": 3.0, "BF16": 3.0, "TopK": 6.0, "Quantize": 5.0, "Sign": 5.0,
                  "PowerSGD": 7.0}  # fmt: skip


@dataclass(kw_only=True, slots=True, frozen=True)
class Link:
    """A link in the alpha-beta model."""

    latency: float
    """alpha: seconds per message, independent of its size."""
    bandwidth: float
    """1 / beta: bytes per second."""

    def __post_init__(self) -> None:
        if not isinstance(self.latency, (int, float)) or not math.isfinite(self.latency) or self.latency < 0:
            raise InvalidArgumentError(f"Link: latency must be a finite number of seconds >= 0, got {self.latency!r}")
        if not isinstance(self.bandwidth, (int, float)) or not self.bandwidth > 0:
            raise InvalidArgumentError(f"Link: bandwidth must be > 0 bytes/s, got {self.bandwidth!r}")

    def time(self, nbytes: float, messages: float = 1) -> float:
        """alpha * messages + nbytes / bandwidth."""
        return messages * self.latency + nbytes / self.bandwidth

    @classmethod
    def gbit(cls, gbits: float, latency: float = 50e-6) -> Link:
        """A link of ``gbits`` Gbit/s (e.g. ``Link.gbit(1)`` for the emulated 1 Gbit/s hosts)."""
        return cls(latency=latency, bandwidth=gbits * 1e9 / 8)


@dataclass(kw_only=True, slots=True, frozen=True)
class Topology:
    """Ranks grouped in nodes of equal size, numbered node-major."""

    world_size: int
    """Number of ranks."""
    local_size: int = 1
    """Ranks per node (1: every rank on its own node)."""
    intra: Link | None = None
    """Link between ranks of one node (None: as fast as the inter-node link)."""

    def __post_init__(self) -> None:
        for name in ("world_size", "local_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InvalidArgumentError(f"Topology: {name} must be an int >= 1, got {v!r}")
        if self.world_size % self.local_size:
            raise InvalidArgumentError(
                f"Topology: world_size={self.world_size} is not a multiple of local_size={self.local_size}"
            )
        if self.intra is not None and not isinstance(self.intra, Link):
            raise ArgumentTypeError(f"Topology: intra must be a Link or None, got {type(self.intra).__name__}")

    @property
    def nodes(self) -> int:
        return self.world_size // self.local_size


def _steps(p: int) -> int:
    if p <= 1:
        return 0
    lg = int(math.log2(p))
    return lg if 1 << lg == p else lg + 2


def all_reduce_time(nbytes: float, topology: Topology | int, link: Link, algorithm: str = "ring") -> float:
    """Predicted seconds for an all-reduce of ``nbytes`` per rank (see the table in the module docstring).
    ``topology`` may be a plain world size."""
    topo = topology if isinstance(topology, Topology) else Topology(world_size=topology)
    p, n = topo.world_size, float(nbytes)
    if p == 1:
        return 0.0
    a, b = link.latency, 1.0 / link.bandwidth
    if algorithm == "ring":
        return 2 * (p - 1) * a + 2 * (p - 1) / p * n * b
    if algorithm == "tree":
        return _steps(p) * (a + n * b)
    if algorithm == "rabenseifner":
        return 2 * _steps(p) * a + 2 * (p - 1) / p * n * b
    if algorithm == "hierarchical":
        L, N = topo.local_size, topo.nodes
        intra = topo.intra or link
        t = 2 * ((L - 1) * intra.latency + (L - 1) / L * n / intra.bandwidth) if L > 1 else 0.0
        return t + (2 * (N - 1) * a + 2 * (N - 1) / N * (n / L) * b if N > 1 else 0.0)
    raise InvalidArgumentError(f"all_reduce_time: algorithm must be one of {ALGORITHMS}, got {algorithm!r}")


def all_gather_time(nbytes_per_rank: float, world_size: int, link: Link) -> float:
    """Ring all-gather: every rank receives the other ``p - 1`` ranks' ``nbytes_per_rank``."""
    p = world_size
    return (p - 1) * link.latency + (p - 1) * nbytes_per_rank / link.bandwidth if p > 1 else 0.0


def all_to_all_time(nbytes_sent: float, world_size: int, link: Link) -> float:
    """Pairwise all-to-all: each rank sends ``(p - 1) / p`` of its ``nbytes_sent`` to the others."""
    p = world_size
    return (p - 1) * link.latency + (p - 1) / p * nbytes_sent / link.bandwidth if p > 1 else 0.0


def quantize_codes_dtype(bits: int, world_size: int) -> torch.dtype:
    """Narrowest integer dtype both gloo and NCCL reduce that holds the sum of ``world_size`` codes."""
    qmax = QMAX[bits]
    return torch.int8 if qmax * world_size <= 127 else torch.int32


def _quantize_shared_time(numel: int, q: Quantize, world_size: int, link: Link) -> float:
    scales = 4 * -(-numel // q.block)
    codes = numel * torch.empty((), dtype=quantize_codes_dtype(q.bits, world_size)).element_size()
    return all_reduce_time(scales, world_size, link) + all_reduce_time(codes, world_size, link)


def quantize_shared_scale_cheaper(numel: int, q: Quantize, world_size: int, link: Link | None = None) -> bool:
    """Whether the shared-scale integer all-reduce beats the all-gather of (codes, scales) for a
    quantized all-reduce of ``numel`` elements over ``world_size`` ranks (ring model)."""
    link = link or Link.gbit(10)
    gather = all_gather_time(q.payload_nbytes(numel), world_size, link)
    return _quantize_shared_time(numel, q, world_size, link) < gather


def _best_all_reduce(nbytes: float, topo: Topology, link: Link, algorithms) -> tuple[str, float]:
    best = min(((a, all_reduce_time(nbytes, topo, link, a)) for a in algorithms), key=lambda x: x[1])
    return best


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

    Linear compressors use ``algorithm`` (default: the cheapest all-reduce for the topology); the
    others use the collectives their scheme needs (named in the returned algorithm)."""
    topo = topology if isinstance(topology, Topology) else Topology(world_size=topology)
    p = topo.world_size
    numel = math.prod(shape) if isinstance(shape, (tuple, list, torch.Size)) else int(shape)
    algos = (algorithm,) if algorithm else _algorithms(topo)
    c = compressor if compressor is not None else NoCompression()
    name = type(c).__name__
    compute = 0.0
    if compute_bandwidth:
        compute = COMPUTE_PASSES.get(name, 5.0) * 4 * numel / compute_bandwidth
    if p == 1:
        return "none", compute
    if isinstance(c, PowerSGD):
        t = torch.empty(shape, device="meta")
        plan_ = c._plan(t)
        if plan_ is None:
            a, s = _best_all_reduce(4 * numel, topo, link, algos)
            return a, s + compute
        rows, cols, r = plan_
        a, s1 = _best_all_reduce(4 * rows * r, topo, link, algos)
        _, s2 = _best_all_reduce(4 * cols * r, topo, link, (a,))
        return a, s1 + s2 + compute
    if isinstance(c, (NoCompression, FP16, BF16)):
        a, s = _best_all_reduce(c.payload_nbytes(numel, dtype), topo, link, algos)
        return a, s + compute
    if isinstance(c, TopK):
        return "all_gather", all_gather_time(c.payload_nbytes(numel, dtype), p, link) + compute
    if isinstance(c, Quantize):
        gather = all_gather_time(c.payload_nbytes(numel, dtype), p, link)
        shared = _quantize_shared_time(numel, c, p, link)
        if shared < gather:
            return "shared_scale_all_reduce", shared + compute
        return "all_gather", gather + compute
    if isinstance(c, Sign):
        seg = sign_segment_bytes(numel, p)
        return "all_to_all+all_gather", all_to_all_time(p * seg, p, link) + all_gather_time(seg, p, link) + compute
    # an unknown compressor: gathered if not linear
    nb = c.payload_nbytes(numel, dtype)
    if c.is_linear:
        a, s = _best_all_reduce(nb, topo, link, algos)
        return a, s + compute
    return "all_gather", all_gather_time(nb, p, link) + compute


def sign_chunk(numel: int, world_size: int) -> int:
    """Elements per server chunk of the two-phase sign all-reduce (a multiple of 32)."""
    per = -(-numel // world_size)
    return max(32, -(-per // 32) * 32)


def sign_segment_bytes(numel: int, world_size: int) -> int:
    """Bytes per destination in the two-phase sign all-reduce: a chunk's sign bits plus its fp32 scale."""
    return sign_chunk(numel, world_size) // 8 + 4


def _algorithms(topo: Topology) -> tuple[str, ...]:
    return ALGORITHMS if topo.local_size > 1 and topo.nodes > 1 else ALGORITHMS[:3]


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
    esize = torch.empty((), dtype=dtype).element_size()
    numel = nbytes // esize
    shp = shape if shape is not None else (numel,)
    cands = []
    for c in compressors if compressors is not None else DEFAULT_CANDIDATES:
        a, s = compressed_time(c, shp, topology, link, compute_bandwidth=compute_bandwidth, dtype=dtype)
        cands.append((c, a, s))
    cands.sort(key=lambda x: x[2])
    best = cands[0]
    return Plan(best[1], best[0], best[2], [(_describe(c), a, s) for c, a, s in cands])


def _describe(c: Compressor | None) -> str:
    if c is None:
        return "none"
    if isinstance(c, TopK):
        return f"topk({c.ratio:g})"
    if isinstance(c, Quantize):
        return f"int{c.bits}" + ("-stochastic" if c.stochastic else "")
    if isinstance(c, PowerSGD):
        return f"powersgd(rank={c.rank})"
    return type(c).__name__.lower()


# -- probing -------------------------------------------------------------------------------------------


def _pingpong(comm: Communicator, peer: int, first: bool, nbytes: int, repeats: int) -> list[float]:
    buf = torch.zeros(max(1, nbytes), dtype=torch.uint8, device=comm.device)
    times = []
    for _ in range(repeats + 1):  # the first exchange warms the connection up
        t0 = time.perf_counter()
        if first:
            comm.send(buf, peer)
            comm.recv(buf, peer)
        else:
            comm.recv(buf, peer)
            comm.send(buf, peer)
        times.append((time.perf_counter() - t0) / 2)
    return times[1:]


def _probe_pairs(comm: Communicator, pairs: list[tuple[int, int]], small: int, large: int, repeats: int) -> Link:
    mine = [(a, b) for a, b in pairs if comm.rank in (a, b)]
    res = torch.zeros(2, dtype=torch.float64, device=comm.device)
    for a, b in mine:  # a rank sits in at most one pair per call
        peer, first = (b, True) if comm.rank == a else (a, False)
        # the fastest exchange of each size: scheduling noise only ever adds time, and a noisy small-message
        # time above the large one's would make the bandwidth estimate meaningless
        t_small = min(_pingpong(comm, peer, first, small, 4 * repeats))
        t_large = min(_pingpong(comm, peer, first, large, repeats))
        beta = max(t_large - t_small, 1e-12) / (large - small)
        res[0], res[1] = t_small - small * beta, beta
    comm.all_reduce(res, "max")  # the slowest pair's latency and inverse bandwidth
    return Link(latency=max(0.0, float(res[0])), bandwidth=1.0 / float(res[1]))


def _check_probe(comm: Communicator, small: int, large: int, repeats: int) -> None:
    if comm.world_size < 2:
        raise InvalidArgumentError("probe: needs at least two ranks")
    if not 0 < small < large:
        raise InvalidArgumentError(f"probe: need 0 < small_bytes < large_bytes, got {small} and {large}")
    if repeats < 1:
        raise InvalidArgumentError(f"probe: repeats must be >= 1, got {repeats}")


def probe(comm: Communicator, *, small_bytes: int = 8, large_bytes: int = 8 << 20, repeats: int = 5) -> Link:
    """Measure latency and bandwidth by ping-pong between rank pairs (0, 1), (2, 3), ... at the same time,
    and return the slowest pair's :class:`Link` on every rank. Latency is the fitted one-way time of an
    empty message; bandwidth comes from the difference between a ``large_bytes`` and a ``small_bytes``
    message (the fastest of ``repeats`` resp. ``4 * repeats`` round trips)."""
    _check_probe(comm, small_bytes, large_bytes, repeats)
    p = comm.world_size
    pairs = [(i, i + 1) for i in range(0, p - 1, 2)]
    return _probe_pairs(comm, pairs, small_bytes, large_bytes, repeats)


def probe_topology(
    comm: Communicator, local_size: int, *, small_bytes: int = 8, large_bytes: int = 8 << 20, repeats: int = 5
) -> tuple[Topology, Link]:
    """Probe intra-node pairs and inter-node pairs separately: returns (Topology with the intra link,
    inter-node link)."""
    _check_probe(comm, small_bytes, large_bytes, repeats)
    topo = Topology(world_size=comm.world_size, local_size=local_size)
    L, N = local_size, topo.nodes
    intra = None
    if L > 1:
        pairs = [(g * L + i, g * L + i + 1) for g in range(N) for i in range(0, L - 1, 2)]
        intra = _probe_pairs(comm, pairs, small_bytes, large_bytes, repeats)
    inter = intra
    if N > 1:
        pairs = [(g * L + i, (g + 1) * L + i) for g in range(0, N - 1, 2) for i in range(L)]
        inter = _probe_pairs(comm, pairs, small_bytes, large_bytes, repeats)
    return Topology(world_size=comm.world_size, local_size=L, intra=intra), inter
