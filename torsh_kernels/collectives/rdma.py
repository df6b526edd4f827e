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

The verbs side (library, devices, connection data, queue-pair state, registered memory, the attributes and
work requests posted) is :mod:`.rdma_verbs`; the chunk and ring planning and what a receive does with a
chunk is :mod:`.rdma_ring`. Their public names are importable from here as well.
"""

from __future__ import annotations

import collections
import math
import os
import threading
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..checks import env_int
from ..errors import (
    CollectiveError,
    CollectiveTimeoutError,
    InvalidArgumentError,
    TransportUnavailableError,
)
from . import bootstrap
from .protocol import CommunicatorBase, CompletedHandle
from .rdma_ring import RingStep as RingStep  # (defined in .rdma_ring, importable from here as before)
from .rdma_ring import chunk_spans, copier, ring_plan, segments
from .rdma_verbs import NO_DEVICE_FIX as NO_DEVICE_FIX  # (defined in .rdma_verbs, importable from here as before)
from .rdma_verbs import PORT_DOWN_FIX as PORT_DOWN_FIX
from .rdma_verbs import SYSFS as SYSFS
from .rdma_verbs import (
    Endpoint,
    QueuePairState,
    RegistrationCache,
    close_quietly,
    credit_request,
    init_attributes,
    load_verbs,
    open_device,
    pack_endpoints,
    recv_request,
    rtr_attributes,
    rts_attributes,
    sysfs_devices,
    unpack_endpoint,
    write_request,
)
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

_REDUCIBLE = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.uint8,
                        torch.int16, torch.int32, torch.int64})  # fmt: skip


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
            gid_index = env_int("TORSH_RDMA_GID_INDEX", 0, what, lo=0, hi=65535)
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
        self._ctx = open_device(v, device or os.environ.get("TORSH_RDMA_DEVICE"), port, what)
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
            close_quietly(peer.qp)
            peer.state.advance("ERR")
        self._peers.clear()
        if self._cache is not None:
            self._cache.clear()
        for name in ("_staging_mr", "_ctl_mr", "_cq", "_pd", "_ctx"):
            obj = getattr(self, name, None)
            if obj is not None:
                close_quietly(obj)
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
            consume = copier(flat, ro, op if st.reduce else None)
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
            self._transfer(what, [], [(left, flat.numel(), flat.element_size(), copier(flat))])
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

        recvs = [(p, outs[p] * row, fo.element_size(), copier(fo, oo[p] * row)) for p in range(w) if p != self._rank]
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
        self._transfer(what, [], [(src, flat.numel(), flat.element_size(), copier(flat))])
        return self._done(async_op)

    def barrier(self) -> None:
        self.all_reduce(torch.zeros(1, dtype=torch.int32))

    def split(self, groups: Sequence[Sequence[int]]) -> RdmaCommunicator:
        raise InvalidArgumentError(
            "RdmaCommunicator.split: not supported; create an RdmaCommunicator over the subgroup's process group "
            "(dist.new_group) instead"
        )
