"""The verbs side of the RDMA transport (:mod:`.rdma`), written against rdma-core's ``pyverbs``: loading
the library, finding the devices and their ports (``/sys/class/infiniband``, then verbs), the connection
data each rank publishes out of band (:class:`Endpoint`), the state of a reliable-connected queue pair
(:class:`QueuePairState`), the cache of registered memory regions (:class:`RegistrationCache`), and the
queue-pair attributes and work requests the communicator posts (pyverbs objects, built without a device).

Everything here but :func:`open_device` runs without a NIC; :func:`load_verbs` raises
:class:`~torsh_kernels.errors.TransportUnavailableError` with the reason and the fix where pyverbs does not
import.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import struct
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from ..errors import CollectiveError, InvalidArgumentError, TransportUnavailableError

__all__ = [
    "IMM_CREDIT",
    "NO_DEVICE_FIX",
    "PORT_DOWN_FIX",
    "SYSFS",
    "Endpoint",
    "QueuePairState",
    "RegistrationCache",
    "close_quietly",
    "credit_request",
    "init_attributes",
    "load_verbs",
    "open_device",
    "pack_endpoints",
    "recv_request",
    "rtr_attributes",
    "rts_attributes",
    "sysfs_devices",
    "unpack_endpoint",
    "write_request",
]

IMM_CREDIT = 0x80000000  # immediate value of a credit (a slot freed); data chunks carry their 31-bit number
SYSFS = Path("/sys/class/infiniband")


# -- connection data, queue-pair state, registered memory ----------------------------------------------------


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
                       send_flags=e.IBV_SEND_SIGNALED, imm_data=IMM_CREDIT)  # fmt: skip


def recv_request(v, wr_id: int, addr: int, length: int, lkey: int):
    """A receive for one incoming immediate (a written chunk or a credit); the data lands in the control
    region (credits carry none; written chunks land where they were written)."""
    return v.wr.RecvWR(wr_id=wr_id, num_sge=1, sg=[v.wr.SGE(addr, length, lkey)])


def close_quietly(obj) -> None:
    """``obj.close()``, whatever it raises (a verbs object being released)."""
    with contextlib.suppress(Exception):
        obj.close()


def open_device(v, name: str | None, port: int, what: str):
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
            close_quietly(ctx)
            raise TransportUnavailableError(
                f"{what}: {n} has no port {port} ({type(e).__name__}: {e})",
                reason=f"{n} has no port {port}",
                fix="pass port= an existing port",
            ) from e
        if state == v.enums.IBV_PORT_ACTIVE:
            return ctx
        states[n] = _PORT_STATES.get(int(state), str(state))
        close_quietly(ctx)
    raise TransportUnavailableError(
        f"{what}: port {port} is not ACTIVE on {states}",
        reason=f"port {port} down ({', '.join(f'{k}: {s}' for k, s in states.items())})",
        fix=PORT_DOWN_FIX,
    )
