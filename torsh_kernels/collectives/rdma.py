"""RDMA through pyverbs: :class:`RdmaCommunicator`, a :class:`~torsh_kernels.collectives.Communicator` over
reliable-connected (RC) queue pairs of an InfiniBand or RoCE NIC, written against rdma-core's ``pyverbs``.

How it works:

- **Setup** (once): the device (``device=`` or ``TORSH_RDMA_DEVICE``, else the first with an active
  port) is opened; its port must be ACTIVE. One protection domain, one completion queue, one RC queue
  pair per peer. Each rank registers a *staging area* once: two slots of ``chunk_bytes`` per peer, which
  that peer writes into, plus a small control region.
- **Out-of-band exchange**: each rank publishes, per peer, its queue pair number, starting PSN, LID,
  GID, and the address and rkey of the staging slots meant for that peer, through the torch store
  (:mod:`.bootstrap`); then moves each queue pair RESET -> INIT -> RTR -> RTS with the peer's values
  (:class:`QueuePairState` keeps the order).
- **Data path**: a message is cut into chunks of at most ``chunk_bytes``; each chunk is an RDMA WRITE
  WITH IMMEDIATE from the sender's registered buffer into one of the receiver's two slots (the
  immediate value numbers it); the receiver consumes the chunk (copies or reduces it into its tensor)
  and returns a credit (a SEND WITH IMMEDIATE), so a slot is never overwritten before it is read and
  the next chunk travels while the previous one is reduced. Completions are polled from the CQ.
  Send-side buffers are registered once per buffer and cached (:class:`RegistrationCache`).
- **Collectives**: send/recv; all-reduce as a ring reduce-scatter then a ring all-gather
  (:func:`ring_plan`); all-gather and reduce-scatter as one ring phase each; broadcast as a ring pass;
  all-to-all as pairwise exchanges. Reductions run in torch on the received chunks. Every call runs
  to completion on the calling thread, polling the CQ; ``async_op=True`` returns an already completed
  handle (the protocol's form, without overlap with computation).
- **Failures**: a missing library, no device, a port down raise
  :class:`~torsh_kernels.errors.TransportUnavailableError` with the reason and the fix; a completion
  with an error status (a peer gone: retry exceeded, flushed) raises ``CollectiveError``; no progress
  within ``timeout`` raises ``CollectiveTimeoutError``. Either leaves the communicator failed.

Tensors are host (CPU) tensors: registering CUDA memory (GPUDirect RDMA) needs ``nvidia-peermem`` and
was never exercised, so CUDA tensors are refused with a typed error. No RDMA NIC was available where this
was written: the verbs calls are written against pyverbs' API and have not run; the planning, the
bookkeeping, the store exchange and every error path have (see ``docs/collectives.md``).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import math
import os
import struct
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from ..errors import (
    CollectiveError,
    CollectiveTimeoutError,
    InvalidArgumentError,
    TransportUnavailableError,
)
from . import bootstrap
from .communicator import CommunicatorBase, CompletedHandle
from .traffic import Traffic

__all__ = [
    "Endpoint",
    "QueuePairState",
    "RdmaCommunicator",
    "RegistrationCache",
    "chunk_spans",
    "load_verbs",
    "ring_plan",
    "sysfs_devices",
]

_IMM_CREDIT = 0x80000000  # immediate value of a credit (a slot freed); data chunks carry their 31-bit number
_REDUCIBLE = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.uint8,
                        torch.int16, torch.int32, torch.int64})  # fmt: skip
SYSFS = Path("/sys/class/infiniband")


# -- what runs without a NIC: planning, bookkeeping, connection data -----------------------------------------


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


_ENDPOINT = struct.Struct("<IIHB16sQII")


@dataclasses.dataclass(frozen=True, slots=True)
class Endpoint:
    """What a peer needs to reach one queue pair of this rank: its number and starting PSN, the port's
    LID and GID (and GID index), and the address, rkey and length of the staging slots it may write."""

    qp_num: int
    psn: int
    lid: int
    gid_index: int
    gid: bytes
    addr: int
    rkey: int
    length: int

    def __post_init__(self) -> None:
        if len(self.gid) != 16:
            raise InvalidArgumentError(f"Endpoint: a GID is 16 bytes, got {len(self.gid)}")
        if not 0 <= self.psn < (1 << 24):
            raise InvalidArgumentError(f"Endpoint: a PSN is 24 bits, got {self.psn}")

    def to_bytes(self) -> bytes:
        return _ENDPOINT.pack(self.qp_num, self.psn, self.lid, self.gid_index, self.gid, self.addr, self.rkey,
                              self.length)  # fmt: skip

    @classmethod
    def from_bytes(cls, b: bytes) -> Endpoint:
        if len(b) != _ENDPOINT.size:
            raise CollectiveError(f"Endpoint: {len(b)} bytes of connection data, expected {_ENDPOINT.size}")
        return cls(*_ENDPOINT.unpack(b))

    @property
    def gid_str(self) -> str:
        """The GID as verbs writes it (eight groups of four hex digits)."""
        h = self.gid.hex()
        return ":".join(h[i : i + 4] for i in range(0, 32, 4))


def pack_endpoints(eps: Sequence[Endpoint | None]) -> bytes:
    """One rank's endpoints, one per rank of the job (None, for itself, as zeros)."""
    zero = bytes(_ENDPOINT.size)
    return b"".join(zero if e is None else e.to_bytes() for e in eps)


def unpack_endpoint(blob: bytes, index: int, world: int) -> Endpoint:
    """Endpoint ``index`` of a peer's packed list."""
    if len(blob) != world * _ENDPOINT.size:
        raise CollectiveError(
            f"RdmaCommunicator: a peer published {len(blob)} bytes of connection data, expected {world} x "
            f"{_ENDPOINT.size}: the ranks disagree on the world size or run different versions"
        )
    return Endpoint.from_bytes(blob[index * _ENDPOINT.size : (index + 1) * _ENDPOINT.size])


class QueuePairState:
    """The state of one RC queue pair as this side drives it: RESET -> INIT -> RTR -> RTS, or ERR from any
    state. A transition out of order raises ``InvalidArgumentError`` before verbs is called; posting needs
    RTS (sends) or at least INIT (receives)."""

    ORDER = ("RESET", "INIT", "RTR", "RTS")
    __slots__ = ("peer", "state")

    def __init__(self, peer: int) -> None:
        self.peer = peer
        self.state = "RESET"

    def advance(self, to: str) -> None:
        if to == "ERR":
            self.state = "ERR"
            return
        if to not in self.ORDER:
            raise InvalidArgumentError(f"QueuePairState: unknown state {to!r}; states: {(*self.ORDER, 'ERR')}")
        if self.state == "ERR" or self.ORDER.index(to) != self.ORDER.index(self.state) + 1:
            raise InvalidArgumentError(
                f"QueuePairState: the queue pair to rank {self.peer} is {self.state}; it cannot move to {to} "
                f"(RC queue pairs go {' -> '.join(self.ORDER)})"
            )
        self.state = to

    def check_can_send(self) -> None:
        if self.state != "RTS":
            raise CollectiveError(f"the queue pair to rank {self.peer} is {self.state}, not RTS: it cannot send")

    def check_can_receive(self) -> None:
        if self.state not in ("INIT", "RTR", "RTS"):
            raise CollectiveError(f"the queue pair to rank {self.peer} is {self.state}: it cannot post receives")


class RegistrationCache:
    """Memory regions registered once per buffer and kept (least recently used first out) up to
    ``max_entries`` and ``max_bytes``. A buffer is its storage's address and size: the cache holds a
    reference to the storage, so the memory cannot be freed and reused while it is registered.
    ``register(addr, nbytes)`` returns the region (with ``lkey``); ``deregister(region)`` releases it."""

    __slots__ = ("_bytes", "_dereg", "_entries", "_reg", "hits", "max_bytes", "max_entries", "misses")

    def __init__(self, register: Callable[[int, int], object], deregister: Callable[[object], None], *,
                 max_entries: int = 64, max_bytes: int = 8 << 30) -> None:  # fmt: skip
        if max_entries < 1 or max_bytes < 1:
            raise InvalidArgumentError("RegistrationCache: max_entries and max_bytes must be positive")
        self._reg, self._dereg = register, deregister
        self._entries: collections.OrderedDict = collections.OrderedDict()
        self._bytes = 0
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self.hits = self.misses = 0

    def lookup(self, t: torch.Tensor) -> tuple[object, int]:
        """(the region covering ``t``'s storage, ``t``'s byte offset into it)."""
        st = t.untyped_storage()
        key = (st.data_ptr(), st.nbytes())
        e = self._entries.get(key)
        if e is not None:
            self._entries.move_to_end(key)
            self.hits += 1
        else:
            self.misses += 1
            e = (self._reg(key[0], max(1, key[1])), st)
            self._entries[key] = e
            self._bytes += key[1]
            while len(self._entries) > 1 and (len(self._entries) > self.max_entries or self._bytes > self.max_bytes):
                (_, n), (region, _) = self._entries.popitem(last=False)
                self._bytes -= n
                self._dereg(region)
        return e[0], t.data_ptr() - key[0]

    def drop(self, t: torch.Tensor) -> None:
        """Deregister ``t``'s storage now (a buffer about to be released)."""
        st = t.untyped_storage()
        e = self._entries.pop((st.data_ptr(), st.nbytes()), None)
        if e is not None:
            self._bytes -= st.nbytes()
            self._dereg(e[0])

    def clear(self) -> None:
        while self._entries:
            _, (region, _) = self._entries.popitem(last=False)
            self._dereg(region)
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._entries)


# -- the library and the devices ------------------------------------------------------------------------------

_PYVERBS_FIX = (
    "Debian/Ubuntu: apt-get install python3-pyverbs (for the system Python); any Python: apt-get install "
    "libibverbs-dev librdmacm-dev cython3 && pip install 'torsh-kernels[rdma]' (pyverbs from PyPI builds "
    "rdma-core; it needs Cython < 3.1 and imports only where the system's libibverbs is the same rdma-core release)"
)


def load_verbs():
    """The pyverbs modules used here, or TransportUnavailableError saying why they do not import and how
    to install them. pyverbs' constants are ``pyverbs.enums`` up to rdma-core 5x, ``pyverbs.libibverbs_enums``
    in the PyPI builds of rdma-core 59."""
    try:
        try:
            import pyverbs.enums as enums
        except ImportError:
            import pyverbs.libibverbs_enums as enums
        from pyverbs import addr, cq, device, mr, pd, qp, wr
    except ImportError as e:
        missing = isinstance(e, ModuleNotFoundError) and (e.name or "").split(".")[0] == "pyverbs"
        raise TransportUnavailableError(
            f"RdmaCommunicator: pyverbs (rdma-core's Python binding) "
            f"{'is not installed' if missing else 'does not import'} ({e})",
            reason="pyverbs is not installed" if missing else f"pyverbs does not import: {e}",
            fix=_PYVERBS_FIX
            if missing
            else "install the pyverbs built for this system's rdma-core (its "
            "libibverbs must be the same rdma-core release): apt-get install python3-pyverbs",
        ) from e
    return dataclasses.make_dataclass("Verbs", ["enums", "addr", "cq", "device", "mr", "pd", "qp", "wr"])(
        enums, addr, cq, device, mr, pd, qp, wr
    )


_PORT_STATES = {1: "DOWN", 2: "INIT", 3: "ARMED", 4: "ACTIVE", 5: "ACTIVE_DEFER"}


def sysfs_devices(root: Path = SYSFS) -> list[dict]:
    """The RDMA devices and ports the kernel exposes (``/sys/class/infiniband``), read without verbs:
    device, port, state, physical state, link layer, rate."""
    out = []
    if not root.is_dir():
        return out
    for dev in sorted(root.iterdir()):
        ports = dev / "ports"
        for port in sorted(ports.iterdir(), key=lambda p: int(p.name)) if ports.is_dir() else []:

            def read(name: str, port=port) -> str:
                try:
                    return (port / name).read_text().strip()
                except OSError:
                    return ""

            state = read("state")  # e.g. "4: ACTIVE"
            out.append({"device": dev.name, "port": int(port.name), "state": state.split(":")[-1].strip() or "?",
                        "phys_state": read("phys_state").split(":")[-1].strip(), "link_layer": read("link_layer"),
                        "rate": read("rate")})  # fmt: skip
    return out


PORT_DOWN_FIX = (
    "check the cable and the subnet manager (ibstat; opensm for InfiniBand) or the netdev's link (ip link) for RoCE"
)
NO_DEVICE_FIX = (
    "load the NIC's RDMA driver (mlx5_ib, ...), or soft-RoCE over an Ethernet interface: modprobe rdma_rxe && rdma "
    "link add rxe0 type rxe netdev <interface> (needs the rdma_rxe kernel module)"
)


# -- verbs objects: queue-pair attributes and work requests (pyverbs objects, built without a device) ---------


def init_attributes(v, port: int):
    """RESET -> INIT: the port, partition key 0, local and remote write access."""
    attr = v.qp.QPAttr()
    attr.qp_access_flags = v.enums.IBV_ACCESS_LOCAL_WRITE | v.enums.IBV_ACCESS_REMOTE_WRITE
    attr.port_num = port
    attr.pkey_index = 0
    return attr


def rtr_attributes(v, port: int, mtu: int, gid_index: int, remote: Endpoint):
    """INIT -> RTR: the path MTU and the peer's queue pair number, PSN and address (LID; a global route
    to its GID where it has one, as RoCE always does)."""
    attr = init_attributes(v, port)
    attr.path_mtu = mtu
    attr.dest_qp_num = remote.qp_num
    attr.rq_psn = remote.psn
    attr.max_dest_rd_atomic = 1
    attr.min_rnr_timer = 12
    is_global = int(any(remote.gid))
    gr = v.addr.GlobalRoute(dgid=v.addr.GID(remote.gid_str), sgid_index=gid_index) if is_global else None
    attr.ah_attr = v.addr.AHAttr(dlid=remote.lid, is_global=is_global, port_num=port, gr=gr)
    return attr


def rts_attributes(v, me: Endpoint):
    """RTR -> RTS: this side's starting PSN, 67 ms ack timeout (4.096 us * 2^14), 7 retries, 7 RNR retries."""
    attr = v.qp.QPAttr()
    attr.sq_psn = me.psn
    attr.timeout = 14
    attr.retry_cnt = 7
    attr.rnr_retry = 7
    attr.max_rd_atomic = 1
    return attr


def write_request(v, wr_id: int, addr: int, nbytes: int, lkey: int, imm: int, rkey: int, remote_addr: int):
    """A signalled RDMA WRITE WITH IMMEDIATE of ``nbytes`` at ``addr`` to ``remote_addr`` (``rkey``)."""
    e = v.enums
    wr = v.wr.SendWR(wr_id=wr_id, opcode=e.IBV_WR_RDMA_WRITE_WITH_IMM, num_sge=1, sg=[v.wr.SGE(addr, nbytes, lkey)],
                     send_flags=e.IBV_SEND_SIGNALED, imm_data=imm)  # fmt: skip
    wr.set_wr_rdma(rkey, remote_addr)
    return wr


def credit_request(v, wr_id: int, addr: int, lkey: int):
    """A signalled zero-byte SEND WITH IMMEDIATE: a slot of the peer's is free again."""
    e = v.enums
    return v.wr.SendWR(wr_id=wr_id, opcode=e.IBV_WR_SEND_WITH_IMM, num_sge=1, sg=[v.wr.SGE(addr, 0, lkey)],
                       send_flags=e.IBV_SEND_SIGNALED, imm_data=_IMM_CREDIT)  # fmt: skip


def recv_request(v, wr_id: int, addr: int, length: int, lkey: int):
    """A receive for one incoming immediate (a written chunk or a credit); the data lands in the control
    region (credits carry none; written chunks land where they were written)."""
    return v.wr.RecvWR(wr_id=wr_id, num_sge=1, sg=[v.wr.SGE(addr, length, lkey)])


# -- the communicator --------------------------------------------------------------------------------------------


class _Peer:
    """One RC queue pair to one peer and the flow-control state of its two slots in each direction."""

    __slots__ = ("arrived", "credits", "ep", "index", "qp", "recv_seq", "send_seq", "state")

    def __init__(self, index: int, qp) -> None:
        self.index, self.qp = index, qp
        self.state = QueuePairState(index)
        self.ep: Endpoint | None = None
        self.credits = 2  # slots of the peer this rank may write
        self.send_seq = 0
        self.recv_seq = 0
        self.arrived: collections.deque = collections.deque()  # (seq, nbytes) of chunks in my slots


class RdmaCommunicator(CommunicatorBase):
    """A :class:`~torsh_kernels.collectives.Communicator` over RDMA RC queue pairs (see the module docstring).

    Args:
        group: a ``torch.distributed`` group (None: the default one), DeviceMesh (with ``mesh_dim``) or
            ``(mesh, dim)`` whose store carries the connection data; ignored when ``store`` is given.
        store, rank, world_size: a Store and this process's place, without a process group.
        device: RDMA device name (``mlx5_0``, ``rxe0``); default ``TORSH_RDMA_DEVICE`` or the first device
            with an active port.
        port: the device port (default 1).
        gid_index: the GID table index (RoCE needs one; default ``TORSH_RDMA_GID_INDEX`` or 0).
        chunk_bytes: the largest piece a message travels in (one staging slot), default 1 MiB.
        timeout: seconds without progress before ``CollectiveTimeoutError``.
    """

    __slots__ = ("_cache", "_chunk", "_cq", "_ctl", "_ctl_mr", "_ctx", "_error", "_gid_index", "_lock", "_mtu",
                 "_pd", "_peers", "_port", "_qpn_peer", "_scratch", "_staging", "_staging_mr", "_timeout",
                 "_v")  # fmt: skip

    def __init__(
        self,
        group: object = None,
        *,
        mesh_dim: str | int | None = None,
        store: dist.Store | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        device: str | None = None,
        port: int = 1,
        gid_index: int | None = None,
        chunk_bytes: int = 1 << 20,
        timeout: float = 300.0,
    ) -> None:
        what = "RdmaCommunicator"
        bootstrap.check_timeout(timeout, what)
        if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes < 64:
            raise InvalidArgumentError(f"{what}: chunk_bytes must be an int >= 64, got {chunk_bytes!r}")
        if isinstance(port, bool) or not isinstance(port, int) or port < 1:
            raise InvalidArgumentError(f"{what}: port must be an int >= 1, got {port!r}")
        if gid_index is None:
            gid_index = int(os.environ.get("TORSH_RDMA_GID_INDEX", "0"))
        if isinstance(gid_index, bool) or not isinstance(gid_index, int) or gid_index < 0:
            raise InvalidArgumentError(f"{what}: gid_index must be an int >= 0, got {gid_index!r}")
        rank, world_size, ranks, root_store = bootstrap.identity(group, mesh_dim, store, rank, world_size, what)
        v = load_verbs()
        self._v = v
        self._rank, self._world, self._ranks = rank, world_size, ranks
        self._traffic = Traffic()
        self._device = torch.device("cpu")
        self._backend = "rdma"
        self._reduce_dtypes = _REDUCIBLE
        self._timeout, self._chunk, self._port, self._gid_index = float(timeout), chunk_bytes, port, gid_index
        self._error: CollectiveError | None = None
        self._lock = threading.Lock()
        self._peers: dict[int, _Peer] = {}
        self._qpn_peer: dict[int, int] = {}
        self._cache = None
        self._scratch = torch.empty(0, dtype=torch.uint8)
        self._ctx = _open_device(v, device or os.environ.get("TORSH_RDMA_DEVICE"), port, what)
        try:
            self._setup(v, root_store, what)
        except TransportUnavailableError:
            raise
        except CollectiveError:
            self.close()
            raise
        except Exception as e:
            self.close()
            raise self._failure(f"{what} (setup)", e) from e

    # -- setup -------------------------------------------------------------------------------------------------

    def _setup(self, v, root_store, what: str) -> None:
        e = v.enums
        pattr = self._ctx.query_port(self._port)
        self._mtu = pattr.active_mtu
        lid = pattr.lid
        if pattr.link_layer == e.IBV_LINK_LAYER_ETHERNET or lid == 0:
            gid = bytes.fromhex(self._ctx.query_gid(self._port, self._gid_index).gid.replace(":", ""))
        else:
            gid = bytes(16)
        self._pd = v.pd.PD(self._ctx)
        npeers = self._world - 1
        depth = 4 * max(1, npeers) + 16
        self._cq = v.cq.CQ(self._ctx, 2 * depth * max(1, npeers))
        # staging: two slots per peer, written by that peer; control: credits and the receives they land in
        self._staging = torch.empty(max(1, 2 * npeers) * self._chunk, dtype=torch.uint8)
        access = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE
        self._staging_mr = v.mr.MR(self._pd, self._staging.nbytes, access, address=self._staging.data_ptr())
        self._ctl = torch.zeros(64, dtype=torch.uint8)
        self._ctl_mr = v.mr.MR(self._pd, self._ctl.nbytes, e.IBV_ACCESS_LOCAL_WRITE, address=self._ctl.data_ptr())
        self._cache = RegistrationCache(
            lambda addr, n: v.mr.MR(self._pd, n, e.IBV_ACCESS_LOCAL_WRITE, address=addr), lambda mr: mr.close()
        )
        mine: list[Endpoint | None] = []
        for p in range(self._world):
            if p == self._rank:
                mine.append(None)
                continue
            cap = v.qp.QPCap(max_send_wr=depth, max_recv_wr=depth, max_send_sge=1, max_recv_sge=1)
            init = v.qp.QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self._cq, rcq=self._cq, cap=cap, sq_sig_all=1)
            peer = _Peer(p, v.qp.QP(self._pd, init))
            self._peers[p] = peer
            self._qpn_peer[peer.qp.qp_num] = p
            slot = self._slot_index(p)
            psn = int.from_bytes(os.urandom(3), "little")  # a random 24-bit starting PSN
            mine.append(Endpoint(peer.qp.qp_num, psn, lid, self._gid_index, gid,
                                 self._staging.data_ptr() + slot * 2 * self._chunk, self._staging_mr.rkey,
                                 2 * self._chunk))  # fmt: skip
        ns = bootstrap.namespace(root_store, "rdma", self._ranks, what)
        blobs = bootstrap.all_gather_bytes(ns, self._rank, self._world, pack_endpoints(mine), timeout=self._timeout,
                                           what=what)  # fmt: skip
        for p, peer in self._peers.items():
            peer.ep = unpack_endpoint(blobs[p], self._rank, self._world)
            self._connect(peer, mine[p])
            for _ in range(depth):
                self._post_recv(peer)
        # every queue pair is RTS with receives posted before anyone writes
        bootstrap.all_gather_bytes(ns, self._rank, self._world, b"ready", timeout=self._timeout, what=what,
                                   key="ready")  # fmt: skip

    def _slot_index(self, peer: int) -> int:
        """Where ``peer``'s two slots sit in this rank's staging area."""
        return peer if peer < self._rank else peer - 1

    def _connect(self, peer: _Peer, me: Endpoint) -> None:
        """RESET -> INIT -> RTR -> RTS with the peer's queue pair number, PSN, LID and GID."""
        v = self._v
        peer.state.advance("INIT")
        peer.qp.to_init(init_attributes(v, self._port))
        peer.state.advance("RTR")
        peer.qp.to_rtr(rtr_attributes(v, self._port, self._mtu, self._gid_index, peer.ep))
        peer.state.advance("RTS")
        peer.qp.to_rts(rts_attributes(v, me))

    def close(self) -> None:
        """Release the queue pairs, regions, CQ, PD and device context."""
        for peer in self._peers.values():
            _close(peer.qp)
            peer.state.advance("ERR")
        self._peers.clear()
        if self._cache is not None:
            self._cache.clear()
        for name in ("_staging_mr", "_ctl_mr", "_cq", "_pd", "_ctx"):
            obj = getattr(self, name, None)
            if obj is not None:
                _close(obj)
                setattr(self, name, None)

    def __enter__(self) -> RdmaCommunicator:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- the data path -------------------------------------------------------------------------------------------

    def _post_recv(self, peer: _Peer) -> None:
        v = self._v
        peer.state.check_can_receive()
        peer.qp.post_recv(recv_request(v, peer.index, self._ctl.data_ptr(), self._ctl.nbytes, self._ctl_mr.lkey))

    def _write_chunk(self, peer: _Peer, src: torch.Tensor, off: int, nbytes: int) -> None:
        """RDMA-write ``nbytes`` at byte ``off`` of ``src`` into the peer's next slot, with its number."""
        peer.state.check_can_send()
        slot = peer.send_seq % 2
        if nbytes:
            mr, _ = self._cache.lookup(src)
            addr, lkey = src.data_ptr() + off, mr.lkey
        else:
            addr, lkey = self._ctl.data_ptr(), self._ctl_mr.lkey
        peer.qp.post_send(write_request(self._v, peer.index, addr, nbytes, lkey, peer.send_seq & 0x7FFFFFFF,
                                        peer.ep.rkey, peer.ep.addr + slot * self._chunk))  # fmt: skip
        peer.credits -= 1
        peer.send_seq += 1

    def _credit(self, peer: _Peer) -> None:
        peer.qp.post_send(credit_request(self._v, peer.index, self._ctl.data_ptr(), self._ctl_mr.lkey))

    def _poll(self, what: str, deadline: float) -> bool:
        """Take what the CQ holds: credits and arrived chunks go to their peers. False if nothing came."""
        e = self._v.enums
        n, wcs = self._cq.poll(32)
        if n <= 0:
            if time.monotonic() > deadline:
                err = CollectiveTimeoutError(f"{what}: no completion for {self._timeout:g} s on rank {self._rank}")
                self._error = err
                raise err
            return False
        for wc in wcs[:n]:
            if wc.status != e.IBV_WC_SUCCESS:
                peer = self._qpn_peer.get(wc.qp_num, wc.wr_id)
                err = CollectiveError(
                    f"{what}: a work request to/from rank {peer} completed with status {wc.status} (vendor error "
                    f"{wc.vendor_err}) on rank {self._rank}: the peer is gone or its queue pair failed "
                    "(retry exceeded, flushed)"
                )
                self._error = err
                raise err
            if wc.opcode == e.IBV_WC_RECV_RDMA_WITH_IMM:
                peer = self._peers[self._qpn_peer[wc.qp_num]]
                peer.arrived.append((wc.imm_data, wc.byte_len))
                self._post_recv(peer)
            elif wc.opcode == e.IBV_WC_RECV:
                peer = self._peers[self._qpn_peer[wc.qp_num]]
                peer.credits += 1
                self._post_recv(peer)
        return True

    def _transfer(self, what: str, sends: list, recvs: list) -> None:
        """Run point-to-point messages to completion: ``sends`` of (peer, source tensor, element offset,
        element count), ``recvs`` of (peer, element count, itemsize, consume(chunk bytes, element offset)).
        Messages to one peer go in list order; chunks of all messages progress together."""
        if self._error is not None:
            raise type(self._error)(f"{what}: this communicator failed earlier: {self._error}")
        out = collections.deque()
        for p, src, off, n in sends:
            isz = src.element_size()
            for co, cn in chunk_spans(n, isz, self._chunk):
                out.append((self._peers[p], src, (off + co) * isz, cn * isz))
        inq = collections.deque()
        for p, n, isz, consume in recvs:
            for co, cn in chunk_spans(n, isz, self._chunk):
                inq.append((self._peers[p], co, cn * isz, consume))
        deadline = time.monotonic() + self._timeout
        while out or inq:
            progressed = False
            blocked: set[int] = set()
            for _ in range(len(out)):
                peer, src, boff, nb = out[0]
                if peer.index in blocked or peer.credits <= 0:
                    blocked.add(peer.index)
                    out.rotate(-1)
                    continue
                out.popleft()
                self._write_chunk(peer, src, boff, nb)
                progressed = True
            for _ in range(len(inq)):
                peer, eoff, nb, consume = inq[0]
                if not peer.arrived:
                    inq.rotate(-1)
                    continue
                seq, got = peer.arrived[0]
                if seq != peer.recv_seq & 0x7FFFFFFF or got != nb:
                    err = CollectiveError(
                        f"{what}: rank {peer.index} sent chunk #{seq} of {got} B where chunk #{peer.recv_seq} of "
                        f"{nb} B was expected: the ranks issued different collectives"
                    )
                    self._error = err
                    raise err
                peer.arrived.popleft()
                inq.popleft()
                slot = peer.recv_seq % 2
                base = (self._slot_index(peer.index) * 2 + slot) * self._chunk
                consume(self._staging[base : base + nb], eoff)
                peer.recv_seq += 1
                self._credit(peer)
                progressed = True
            if self._poll(what, deadline) or progressed:
                deadline = time.monotonic() + self._timeout
        # drain: every write acknowledged by the peer's credit (slots free again, nothing in flight)
        while any(p.credits < 2 for p in self._peers.values()):
            if self._poll(what, deadline):
                deadline = time.monotonic() + self._timeout

    # -- collectives -----------------------------------------------------------------------------------------------

    def _work(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A scratch buffer of ``numel`` elements, the same registered memory call after call."""
        nbytes = numel * dtype.itemsize
        if self._scratch.numel() < nbytes:
            if self._cache is not None and self._scratch.numel():
                self._cache.drop(self._scratch)
            self._scratch = torch.empty(max(nbytes, 2 * self._scratch.numel()), dtype=torch.uint8)
        return self._scratch[:nbytes].view(dtype)

    def _done(self, async_op: bool):
        return CompletedHandle() if async_op else None

    def _ring(self, what: str, flat: torch.Tensor, phases: str, op: str | None) -> None:
        segs = segments(flat.numel(), self._world)
        right, left = (self._rank + 1) % self._world, (self._rank - 1) % self._world
        isz = flat.element_size()
        for st in ring_plan(self._world, self._rank, phases):
            so, sn = segs[st.send]
            ro, rn = segs[st.recv]
            consume = _copier(flat, ro, op if st.reduce else None)
            self._transfer(what, [(right, flat, so, sn)], [(left, rn, isz, consume)])

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", *, async_op: bool = False):
        what = "all_reduce"
        op = self._check_op(op, what)
        t = self._check_tensor(tensor, what, "tensor", reduce=True, op=op)
        self._traffic.add(what, t.nbytes, self._world)
        if self._world > 1 and t.numel():
            self._ring(what, t.view(-1), "all_reduce", op)
        if op == "avg":
            t.div_(self._world)
        return self._done(async_op)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: str = "sum", *, async_op: bool = False):
        what = "reduce_scatter"
        out, x, op = self._check_reduce_scatter(output, input, op, what)
        self._traffic.add(what, x.nbytes, self._world)
        work = self._work(x.numel(), x.dtype)  # the ring reduces in place; the input stays as given
        work.copy_(x.view(-1))
        n = out.numel()
        if self._world > 1 and n:
            # segments of exactly n elements (the input is world * n): the plan's segment r is rank r's
            self._ring(what, work, "reduce_scatter", op)
        out.view(-1).copy_(work[self._rank * n : (self._rank + 1) * n])
        if op == "avg":
            out.div_(self._world)
        return self._done(async_op)

    def all_gather(self, output, input: torch.Tensor, *, async_op: bool = False):
        what = "all_gather"
        out, x = self._check_all_gather(output, input, what)
        self._traffic.add(what, x.nbytes, self._world)
        flat = self._work(self._world * x.numel(), x.dtype) if isinstance(out, list) else out.view(-1)
        n = x.numel()
        flat[self._rank * n : (self._rank + 1) * n].copy_(x.view(-1))
        if self._world > 1 and n:
            self._ring(what, flat, "all_gather", None)
        if isinstance(out, list):
            for r, o in enumerate(out):
                o.view(-1).copy_(flat[r * n : (r + 1) * n])
        return self._done(async_op)

    def broadcast(self, tensor: torch.Tensor, src: int, *, async_op: bool = False):
        what = "broadcast"
        t = self._check_tensor(tensor, what, "tensor")
        src = self._check_peer(src, what, "src")
        self._traffic.add(what, t.nbytes if src == self._rank else 0, self._world)
        flat = t.view(-1)
        # a ring pass: src sends to its right neighbour, each rank forwards what it received (store and forward)
        pos = (self._rank - src) % self._world
        right, left = (self._rank + 1) % self._world, (self._rank - 1) % self._world
        if pos > 0:
            self._transfer(what, [], [(left, flat.numel(), flat.element_size(), _copier(flat))])
        if pos < self._world - 1:
            self._transfer(what, [(right, flat, 0, flat.numel())], [])
        return self._done(async_op)

    def all_to_all(self, output, input, output_splits=None, input_splits=None, *, async_op: bool = False):
        what = "all_to_all"
        out, x, outs, ins = self._check_all_to_all(output, input, output_splits, input_splits, what)
        self._traffic.add(what, x.nbytes, self._world)
        w = self._world
        row = math.prod(x.shape[1:])
        ins = ins or [x.shape[0] // w] * w
        outs = outs or [out.shape[0] // w] * w
        xo = [sum(ins[:p]) for p in range(w)]
        oo = [sum(outs[:p]) for p in range(w)]
        fx, fo = x.view(-1), out.view(-1)
        fo[oo[self._rank] * row : (oo[self._rank] + outs[self._rank]) * row].copy_(
            fx[xo[self._rank] * row : (xo[self._rank] + ins[self._rank]) * row]
        )
        sends = [(p, fx, xo[p] * row, ins[p] * row) for p in range(w) if p != self._rank]

        recvs = [(p, outs[p] * row, fo.element_size(), _copier(fo, oo[p] * row)) for p in range(w) if p != self._rank]
        self._transfer(what, sends, recvs)
        return self._done(async_op)

    def send(self, tensor: torch.Tensor, dst: int, *, tag: int = 0, async_op: bool = False):
        what = "send"
        t = self._check_tensor(tensor, what, "tensor")
        dst = self._check_peer(dst, what, "dst")
        self._check_no_tag(tag, what)
        self._traffic.add(what, t.nbytes, self._world)
        self._transfer(what, [(dst, t.view(-1), 0, t.numel())], [])
        return self._done(async_op)

    def recv(self, tensor: torch.Tensor, src: int, *, tag: int = 0, async_op: bool = False):
        what = "recv"
        t = self._check_tensor(tensor, what, "tensor")
        src = self._check_peer(src, what, "source")
        self._check_no_tag(tag, what)
        self._traffic.add(what, 0, self._world)  # counted, sending nothing (as every transport counts a receive)
        flat = t.view(-1)
        self._transfer(what, [], [(src, flat.numel(), flat.element_size(), _copier(flat))])
        return self._done(async_op)

    def barrier(self) -> None:
        self.all_reduce(torch.zeros(1, dtype=torch.int32))

    def split(self, groups: Sequence[Sequence[int]]) -> RdmaCommunicator:
        raise InvalidArgumentError(
            "RdmaCommunicator.split: not supported; create an RdmaCommunicator over the subgroup's process group "
            "(dist.new_group) instead"
        )


def _copier(flat: torch.Tensor, base: int = 0, op: str | None = None) -> Callable[[torch.Tensor, int], None]:
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


def _close(obj) -> None:
    with contextlib.suppress(Exception):
        obj.close()


def _open_device(v, name: str | None, port: int, what: str):
    """The verbs context of the device ``name`` (or the first with an active ``port``), its port active."""
    try:
        devs = v.device.get_device_list()
    except Exception as e:  # pyverbs raises when the kernel exposes no RDMA subsystem at all
        devs = []
        cause = f" ({type(e).__name__}: {e})"
    else:
        cause = ""
    names = [d.name.decode() if isinstance(d.name, bytes) else str(d.name) for d in devs]
    if not names:
        raise TransportUnavailableError(
            f"{what}: no RDMA device{cause}; /sys/class/infiniband "
            f"{'lists ' + str([d['device'] for d in sysfs_devices()]) if SYSFS.is_dir() else 'does not exist'}",
            reason="no RDMA device",
            fix=NO_DEVICE_FIX,
        )
    if name is not None and name not in names:
        raise TransportUnavailableError(f"{what}: no RDMA device named {name!r}; devices here: {names}",
                                        reason=f"no device {name!r}", fix=f"pass device= one of {names}")  # fmt: skip
    states = {}
    for n in [name] if name is not None else names:
        ctx = v.device.Context(name=n)
        try:
            state = ctx.query_port(port).state
        except Exception as e:
            _close(ctx)
            raise TransportUnavailableError(
                f"{what}: {n} has no port {port} ({type(e).__name__}: {e})",
                reason=f"{n} has no port {port}",
                fix="pass port= an existing port",
            ) from e
        if state == v.enums.IBV_PORT_ACTIVE:
            return ctx
        states[n] = _PORT_STATES.get(int(state), str(state))
        _close(ctx)
    raise TransportUnavailableError(
        f"{what}: port {port} is not ACTIVE on {states}",
        reason=f"port {port} down ({', '.join(f'{k}: {s}' for k, s in states.items())})",
        fix=PORT_DOWN_FIX,
    )
