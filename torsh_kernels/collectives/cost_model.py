"""The alpha-beta cost of plain collectives (all-reduce algorithms, all-gather, all-to-all), with a link probe.

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

A communication scheme is a sequence of :class:`Round` s (a collective and the bytes each rank puts in);
:func:`rounds_time` prices one. The compression layer describes each compressor's schemes that way and
its planner prices them here; this module knows nothing of compressors.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from ..errors import ArgumentTypeError, InvalidArgumentError
from .protocol import Communicator

__all__ = [
    "ALGORITHMS",
    "COLLECTIVES",
    "Link",
    "Round",
    "Topology",
    "algorithms_for",
    "all_gather_time",
    "all_reduce_time",
    "all_to_all_time",
    "probe",
    "probe_topology",
    "rounds_time",
]

ALGORITHMS = ("ring", "tree", "rabenseifner", "hierarchical")
COLLECTIVES = ("all_reduce", "all_gather", "all_to_all")


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


def _best_all_reduce(nbytes: float, topo: Topology, link: Link, algorithms) -> tuple[str, float]:
    return min(((a, all_reduce_time(nbytes, topo, link, a)) for a in algorithms), key=lambda x: x[1])


def algorithms_for(topology: Topology) -> tuple[str, ...]:
    """The all-reduce algorithms worth pricing on ``topology`` (hierarchical only across several nodes of
    several ranks)."""
    return ALGORITHMS if topology.local_size > 1 and topology.nodes > 1 else ALGORITHMS[:3]


@dataclass(frozen=True, slots=True)
class Round:
    """One collective of a communication scheme and the bytes each rank puts into it."""

    collective: str
    """'all_reduce', 'all_gather' or 'all_to_all'."""
    nbytes: float
    """Bytes of this rank's input: the buffer all-reduced, its own all-gather segment, or all it sends in
    the all-to-all."""

    def __post_init__(self) -> None:
        if self.collective not in COLLECTIVES:
            raise InvalidArgumentError(f"Round: collective must be one of {COLLECTIVES}, got {self.collective!r}")


def rounds_time(
    rounds: tuple[Round, ...] | list[Round], topology: Topology | int, link: Link, algorithms=None
) -> tuple[str | None, float]:
    """(all-reduce algorithm, predicted seconds) of a sequence of collectives run one after another. The
    all-reduce rounds share the one algorithm, of ``algorithms`` (default: those worth pricing on the
    topology), that is cheapest for the first of them; the algorithm is None when no round is an
    all-reduce. Gathers and all-to-alls are priced as ring / pairwise over all ranks."""
    topo = topology if isinstance(topology, Topology) else Topology(world_size=topology)
    p = topo.world_size
    algos = tuple(algorithms) if algorithms else algorithms_for(topo)
    algo, total = None, 0.0
    for r in rounds:
        if r.collective == "all_reduce":
            if algo is None:
                algo, t = _best_all_reduce(r.nbytes, topo, link, algos)
            else:
                t = all_reduce_time(r.nbytes, topo, link, algo)
        elif r.collective == "all_gather":
            t = all_gather_time(r.nbytes, p, link)
        else:
            t = all_to_all_time(r.nbytes, p, link)
        total += t
    return algo, total


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
        # where load on a shared machine slowed every small exchange below the large one, the large one
        # alone bounds the bandwidth from below (as if it had no latency), instead of a 1/0 estimate
        beta = (t_large - t_small) / (large - small) if t_large > t_small else t_large / large
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
