"""The transports beyond torch.distributed, as far as a machine without a GPU or an RDMA NIC can run them.

What runs here for real: the dtype and byte-range conversions of the NCCL path (checked against CuPy's
own NCCL constants where CuPy is installed), the ring plans of the RDMA path (executed on fresh random
data across every rank of worlds of 1 to 5, chunk by chunk), the queue-pair state bookkeeping, the
registration cache, the connection-data encoding, the exchange of connection data and of an NCCL unique
id through the torch store between real processes, ``make_communicator`` and every error path when a
library, a device or a port is missing (with the real pyverbs where Debian's python3-pyverbs is
installed, with CuPy's real NCCL module where CuPy is installed). What does not: any NCCL or verbs
operation (no GPU, no RDMA device here); tests/collectives/test_cupy_nccl_gpu.py holds the GPU part.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from torsh_kernels.collectives import Communicator, TorchCommunicator, bootstrap, run_local
from torsh_kernels.collectives.cupy_nccl import (
    CupyNcclCommunicator,
    byte_ranges,
    nccl_datatype,
    reducible_dtypes,
    uid_from_bytes,
    uid_to_bytes,
    version_tuple,
)
from torsh_kernels.collectives.rdma import (
    Endpoint,
    QueuePairState,
    RdmaCommunicator,
    RegistrationCache,
    chunk_spans,
    pack_endpoints,
    ring_plan,
    segments,
    sysfs_devices,
    unpack_endpoint,
)
from torsh_kernels.collectives.rdma_verbs import open_device
from torsh_kernels.collectives.transports import KINDS, make_communicator, namespaces_supported, transports
from torsh_kernels.errors import (
    ArgumentTypeError,
    CollectiveError,
    CollectiveTimeoutError,
    DTypeError,
    InvalidArgumentError,
    TransportUnavailableError,
)

ROOT = Path(__file__).resolve().parents[2]
SYSTEM_PYVERBS = Path("/usr/lib/python3/dist-packages/pyverbs")


def _has(mod: str) -> bool:
    try:
        __import__(mod)
        return True
    except Exception:
        return False


HAS_CUPY = _has("cupy")


# -- the NCCL path: versions, dtypes, byte ranges ------------------------------------------------------------


def test_version_tuple_both_encodings():
    assert version_tuple(23203) == (2, 32, 3)
    assert version_tuple(21003) == (2, 10, 3)
    assert version_tuple(2708) == (2, 7, 8)  # before 2.9: X*1000 + Y*100 + Z
    for bad in (0, -1, True, "2.18", 2.5):
        with pytest.raises(InvalidArgumentError):
            version_tuple(bad)


def test_reducible_dtypes_and_bf16_gate():
    new, old = reducible_dtypes((2, 18, 1)), reducible_dtypes((2, 9, 9))
    assert torch.bfloat16 in new and torch.bfloat16 not in old
    for d in (torch.float16, torch.float32, torch.float64, torch.int8, torch.uint8, torch.int32, torch.int64):
        assert d in new and d in old
    for d in (torch.bool, torch.int16, torch.complex64):
        assert d not in new
        with pytest.raises(DTypeError, match="cannot reduce"):
            nccl_datatype(d, (2, 18, 1))
    with pytest.raises(DTypeError, match=r"NCCL >= 2\.10"):
        nccl_datatype(torch.bfloat16, (2, 9, 0))
    with pytest.raises(ArgumentTypeError):
        nccl_datatype("float32", (2, 18, 1))


def test_nccl_datatype_matches_nccl_h():
    # ncclDataType_t values from nccl.h
    expected = {torch.int8: 0, torch.uint8: 1, torch.int32: 2, torch.int64: 4, torch.float16: 6, torch.float32: 7,
                torch.float64: 8, torch.bfloat16: 9}  # fmt: skip
    for d, code in expected.items():
        assert nccl_datatype(d, (2, 18, 1)) == code


@pytest.mark.skipif(not HAS_CUPY, reason="CuPy is not installed")
def test_nccl_datatype_matches_cupys_constants():
    from cupy.cuda import nccl

    if not nccl.available:
        pytest.skip("CuPy has no NCCL library")
    names = {torch.int8: "NCCL_INT8", torch.uint8: "NCCL_UINT8", torch.int32: "NCCL_INT32", torch.int64: "NCCL_INT64",
             torch.float16: "NCCL_FLOAT16", torch.float32: "NCCL_FLOAT32", torch.float64: "NCCL_FLOAT64",
             torch.bfloat16: "NCCL_BFLOAT16"}  # fmt: skip
    v = version_tuple(nccl.get_version())
    for d, name in names.items():
        if hasattr(nccl, name):
            assert nccl_datatype(d, v) == getattr(nccl, name), name
    for op, name in (("sum", "NCCL_SUM"), ("product", "NCCL_PROD"), ("max", "NCCL_MAX"), ("min", "NCCL_MIN"),
                     ("avg", "NCCL_AVG")):  # fmt: skip
        if hasattr(nccl, name):
            from torsh_kernels.collectives.cupy_nccl import NCCL_OPS

            assert NCCL_OPS[op] == getattr(nccl, name)


def test_unique_id_forms_round_trip():
    """CuPy 14's ids are bytes, CuPy 13's tuples of 128 signed chars: both travel as the same bytes."""
    raw = bytes(range(128))
    as_tuple = tuple(x - 256 if x > 127 else x for x in os.urandom(128))
    assert uid_to_bytes(raw) == raw and uid_from_bytes(raw, False) == raw
    assert uid_from_bytes(uid_to_bytes(as_tuple), True) == as_tuple
    assert all(-128 <= x < 128 for x in uid_from_bytes(bytes(range(128, 256)) * 1, True))
    for bad in (b"short", (1,) * 127, "x" * 128, (300,) * 128):
        with pytest.raises((InvalidArgumentError, ArgumentTypeError)):
            uid_to_bytes(bad)
    with pytest.raises(InvalidArgumentError):
        uid_from_bytes(b"x", True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.bool, torch.int16, torch.complex64])
@pytest.mark.parametrize(("rows", "splits"), [(12, None), (7, [3, 0, 4]), (0, [0, 0, 0]), (5, [0, 5, 0])])
def test_byte_ranges_cover_the_rows_exactly(dtype, rows, splits):
    """The (offset, bytes) each peer's rows occupy, as all_to_all hands them to NCCL: contiguous,
    covering the tensor's bytes exactly, each range the bytes of that peer's rows."""
    world = 3
    if splits is None and rows % world:
        pytest.skip("even splits need a multiple")
    t = torch.zeros(rows, 5, 3, dtype=dtype)
    r = byte_ranges(splits, t, world)
    assert len(r) == world
    row_bytes = 5 * 3 * t.element_size()
    counts = splits or [rows // world] * world
    off = 0
    for (o, n), c in zip(r, counts):
        assert (o, n) == (off, c * row_bytes)
        off += n
    assert off == t.nbytes


def test_moved_bytes_are_the_tensor_bytes_zero_copy():
    """The NCCL path passes data pointers: a view's pointer is its first element's address in the
    storage, and a bf16 tensor moves as its raw bytes (2 per element) whatever CuPy calls bf16."""
    base = torch.randn(40).to(torch.bfloat16)
    view = base[3:20]
    assert view.data_ptr() == base.data_ptr() + 3 * 2
    assert view.nbytes == 17 * 2
    as_bytes = view.view(torch.uint8)  # what ncclUint8 moves
    assert as_bytes.data_ptr() == view.data_ptr() and as_bytes.numel() == view.nbytes
    assert torch.equal(as_bytes.view(torch.bfloat16), view)


# -- the RDMA path: chunks, segments, ring plans ------------------------------------------------------------


@pytest.mark.parametrize(("nelem", "itemsize", "chunk"), [(0, 4, 64), (1, 4, 64), (16, 4, 64), (17, 4, 64),
                                                          (1001, 2, 100), (5, 8, 8), (3, 1, 1 << 20)])  # fmt: skip
def test_chunk_spans(nelem, itemsize, chunk):
    spans = chunk_spans(nelem, itemsize, chunk)
    assert spans[0][0] == 0
    off = 0
    for o, n in spans:
        assert o == off and n * itemsize <= chunk
        off += n
    assert off == nelem
    assert all(n > 0 for _, n in spans) or nelem == 0
    with pytest.raises(InvalidArgumentError):
        chunk_spans(4, 8, 7)


@pytest.mark.parametrize("world", [1, 2, 3, 5])
@pytest.mark.parametrize("numel", [0, 1, 7, 1000])
def test_segments_partition(world, numel):
    s = segments(numel, world)
    assert len(s) == world and sum(n for _, n in s) == numel
    assert all(s[i][0] + s[i][1] == s[i + 1][0] for i in range(world - 1))
    assert max(n for _, n in s) - min(n for _, n in s) <= 1


def _run_ring(bufs: list[torch.Tensor], phases: str, op: str, chunk_bytes: int) -> None:
    """Execute every rank's ring plan in lock step on in-memory buffers: at each step rank r's send segment
    (as it was when the step began) goes, chunk by chunk, to rank r + 1, which reduces or copies it into
    its receive segment. This runs the plans and the chunking; no transport is involved."""
    world = len(bufs)
    plans = [ring_plan(world, r, phases) for r in range(world)]
    assert len({len(p) for p in plans}) == 1
    segs = segments(bufs[0].numel(), world)
    for k in range(len(plans[0])):
        outgoing = []
        for r in range(world):
            st = plans[r][k]
            right = plans[(r + 1) % world][k]
            assert right.recv == st.send and right.phase == st.phase and right.reduce == st.reduce
            o, n = segs[st.send]
            outgoing.append(bufs[r][o : o + n].clone())
        for r in range(world):
            src = outgoing[(r - 1) % world]
            st = plans[r][k]
            o, n = segs[st.recv]
            for co, cn in chunk_spans(n, src.element_size(), chunk_bytes):
                dst, val = bufs[r][o + co : o + co + cn], src[co : co + cn]
                if not st.reduce:
                    dst.copy_(val)
                elif op == "sum":
                    dst.add_(val)
                elif op == "max":
                    torch.maximum(dst, val, out=dst)
                else:
                    dst.mul_(val)


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("numel", [1, 7, 1000])
@pytest.mark.parametrize("op", ["sum", "max", "product"])
def test_ring_all_reduce_plan(world, numel, op):
    g = torch.Generator().manual_seed(world * 1000 + numel)
    inputs = [torch.randn(numel, generator=g, dtype=torch.float64) for _ in range(world)]
    bufs = [x.clone() for x in inputs]
    _run_ring(bufs, "all_reduce", op, chunk_bytes=24)
    stack = torch.stack(inputs)
    ref = {"sum": stack.sum(0), "max": stack.max(0).values, "product": stack.prod(0)}[op]
    for r in range(world):
        torch.testing.assert_close(bufs[r], ref, rtol=1e-12, atol=1e-12, msg=f"rank {r}")


@pytest.mark.parametrize("world", [2, 3, 5])
def test_ring_reduce_scatter_and_all_gather_plans(world):
    n = 11
    g = torch.Generator().manual_seed(world)
    inputs = [torch.randn(world * n, generator=g, dtype=torch.float64) for _ in range(world)]
    bufs = [x.clone() for x in inputs]
    _run_ring(bufs, "reduce_scatter", "sum", chunk_bytes=16)
    total = torch.stack(inputs).sum(0)
    for r in range(world):  # rank r holds the full reduction of segment r
        torch.testing.assert_close(bufs[r][r * n : (r + 1) * n], total[r * n : (r + 1) * n])
    gathered = [torch.full((world * n,), float("nan"), dtype=torch.float64) for _ in range(world)]
    for r in range(world):
        gathered[r][r * n : (r + 1) * n] = inputs[r][:n]
    _run_ring(gathered, "all_gather", "sum", chunk_bytes=40)
    ref = torch.cat([inputs[r][:n] for r in range(world)])
    for r in range(world):
        assert torch.equal(gathered[r], ref)


@pytest.mark.parametrize("op", [None, "sum", "avg", "max", "min", "product"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32])
def test_receive_side_consumes_chunks_as_bytes(op, dtype):
    """What the RDMA receive path does with each chunk landing in a staging slot (raw bytes): copy or
    reduce it into place at the message's offset; nothing outside the message is touched."""
    from torsh_kernels.collectives.rdma_ring import copier

    g = torch.Generator().manual_seed(7)
    flat = (torch.randn(50, generator=g) * 10).to(dtype)
    before = flat.clone()
    msg = (torch.randn(23, generator=g) * 10).to(dtype)
    consume = copier(flat, 11, op)
    for eoff, n in chunk_spans(23, msg.element_size(), 24):
        consume(msg[eoff : eoff + n].clone().view(torch.uint8), eoff)  # the bytes a slot holds
    part = before[11:34]
    ref = {None: msg, "sum": part + msg, "avg": part + msg, "max": torch.maximum(part, msg),
           "min": torch.minimum(part, msg), "product": part * msg}[op]  # fmt: skip
    assert torch.equal(flat[11:34], ref)
    assert torch.equal(flat[:11], before[:11]) and torch.equal(flat[34:], before[34:])


def test_ring_plan_arguments():
    with pytest.raises(InvalidArgumentError):
        ring_plan(3, 3)
    with pytest.raises(InvalidArgumentError):
        ring_plan(3, 0, "broadcast")
    assert ring_plan(1, 0) == []


# -- queue-pair bookkeeping, registrations, connection data -------------------------------------------------


def test_queue_pair_state_order():
    s = QueuePairState(peer=2)
    with pytest.raises(CollectiveError):
        s.check_can_receive()
    with pytest.raises(InvalidArgumentError, match="RESET; it cannot move to RTR"):
        s.advance("RTR")
    s.advance("INIT")
    s.check_can_receive()
    with pytest.raises(CollectiveError, match="not RTS"):
        s.check_can_send()
    s.advance("RTR")
    with pytest.raises(InvalidArgumentError):
        s.advance("INIT")
    s.advance("RTS")
    s.check_can_send()
    s.advance("ERR")
    with pytest.raises(InvalidArgumentError):
        s.advance("RTS")
    with pytest.raises(InvalidArgumentError, match="unknown state"):
        QueuePairState(0).advance("SQD")


def test_registration_cache_registers_once_per_buffer():
    regs, deregs = [], []

    def reg(addr, n):
        regs.append((addr, n))
        return ("mr", addr, n)

    cache = RegistrationCache(reg, deregs.append, max_entries=2)
    a, b, c = torch.randn(100), torch.randn(50), torch.randn(7)
    mr, off = cache.lookup(a)
    assert mr == ("mr", a.data_ptr(), a.nbytes) and off == 0
    mr2, off2 = cache.lookup(a[10:20])  # a view: the same storage, one registration
    assert mr2 is mr and off2 == 40
    assert len(regs) == 1 and cache.hits == 1 and cache.misses == 1
    cache.lookup(b)
    cache.lookup(a)  # a is now the most recent
    cache.lookup(c)  # evicts b, the least recently used
    assert deregs == [("mr", b.data_ptr(), b.nbytes)] and len(cache) == 2
    cache.drop(a)
    assert deregs[-1] == ("mr", a.data_ptr(), a.nbytes) and len(cache) == 1
    cache.clear()
    assert len(cache) == 0 and len(deregs) == 3
    with pytest.raises(InvalidArgumentError):
        RegistrationCache(reg, deregs.append, max_entries=0)


def test_registration_cache_keeps_storage_alive_and_bounds_bytes():
    regs = []
    cache = RegistrationCache(lambda a, n: regs.append(n) or n, lambda r: None, max_entries=10, max_bytes=1000)
    t = torch.empty(100, dtype=torch.uint8)
    ptr = t.data_ptr()
    cache.lookup(t)
    del t  # the cache holds the storage: the address cannot be reused while registered
    u = torch.empty(100, dtype=torch.uint8)
    assert u.data_ptr() != ptr
    for _ in range(20):
        cache.lookup(torch.empty(300, dtype=torch.uint8))
    assert cache._bytes <= 1000 and len(cache) <= 4


def test_endpoint_round_trip_and_packing():
    gid = bytes.fromhex("fe800000000000000202c9fffe000001")
    e = Endpoint(
        qp_num=0x1234, psn=0xABCDE, lid=7, gid_index=3, gid=gid, addr=0x7F00DEADBEEF, rkey=0x55, length=1 << 21
    )
    assert Endpoint.from_bytes(e.to_bytes()) == e
    assert e.gid_str == "fe80:0000:0000:0000:0202:c9ff:fe00:0001"
    blob = pack_endpoints([e, None, e])
    assert unpack_endpoint(blob, 2, 3) == e
    with pytest.raises(CollectiveError, match="disagree on the world size"):
        unpack_endpoint(blob, 0, 4)
    with pytest.raises(InvalidArgumentError):
        Endpoint(1, 1 << 24, 0, 0, gid, 0, 0, 0)
    with pytest.raises(InvalidArgumentError):
        Endpoint(1, 1, 0, 0, b"short", 0, 0, 0)


def test_sysfs_devices_reads_ports(tmp_path):
    port = tmp_path / "mlx5_0" / "ports" / "1"
    port.mkdir(parents=True)
    (port / "state").write_text("4: ACTIVE\n")
    (port / "phys_state").write_text("5: LinkUp\n")
    (port / "link_layer").write_text("Ethernet\n")
    (port / "rate").write_text("100 Gb/sec (4X EDR)\n")
    down = tmp_path / "rxe0" / "ports" / "1"
    down.mkdir(parents=True)
    (down / "state").write_text("1: DOWN\n")
    got = sysfs_devices(tmp_path)
    assert got[0] == {"device": "mlx5_0", "port": 1, "state": "ACTIVE", "phys_state": "LinkUp",
                      "link_layer": "Ethernet", "rate": "100 Gb/sec (4X EDR)"}  # fmt: skip
    assert got[1]["device"] == "rxe0" and got[1]["state"] == "DOWN" and got[1]["link_layer"] == ""
    assert sysfs_devices(tmp_path / "missing") == []


# -- the store exchange between real processes ----------------------------------------------------------------


def _exchange_worker(comm: TorchCommunicator) -> dict:
    r, w = comm.rank, comm.world_size
    store = bootstrap.default_store("test")
    # RDMA's connection data: every rank publishes one endpoint per peer, each rank takes the one meant for it
    ns = bootstrap.namespace(store, "rdma-test", list(range(w)), "test")
    gid = bytes(range(16))
    mine = [None if p == r else Endpoint(100 * r + p, (r * 7 + p) % (1 << 24), r + 1, 0, gid, 0x1000 * r + p,
                                         r, 4096) for p in range(w)]  # fmt: skip
    blobs = bootstrap.all_gather_bytes(ns, r, w, pack_endpoints(mine), timeout=60, what="test")
    got = {p: unpack_endpoint(blobs[p], r, w) for p in range(w) if p != r}
    for p, e in got.items():
        assert (e.qp_num, e.addr, e.rkey, e.lid) == (100 * p + r, 0x1000 * p + r, p, p + 1)
    # NCCL's unique id: made once by rank 0 (CuPy's real one where CuPy has NCCL), the same bytes everywhere
    try:
        from cupy.cuda import nccl

        make = (lambda: uid_to_bytes(nccl.get_unique_id())) if nccl.available else None
    except Exception:
        make = None
    source = "cupy" if make is not None else "urandom"
    make = make or (lambda: os.urandom(128))
    ns2 = bootstrap.namespace(store, "cupy-nccl", list(range(w)), "test")
    uid = bootstrap.broadcast_bytes(ns2, r, 0, make, timeout=60, what="test", key="uid")
    ids = [None] * w
    dist.all_gather_object(ids, uid)
    assert all(i == ids[0] for i in ids) and len(uid) == 128
    # a second communicator of the same ranks gets its own namespace: a fresh id
    ns3 = bootstrap.namespace(store, "cupy-nccl", list(range(w)), "test")
    uid2 = bootstrap.broadcast_bytes(ns3, r, 0, make, timeout=60, what="test", key="uid")
    return {"source": source, "differs": uid2 != uid}


@pytest.mark.parametrize("world", [2, 3])
def test_connection_data_travels_through_the_store(world):
    out = run_local(_exchange_worker, world, timeout=120)
    assert all(o["differs"] for o in out)
    if HAS_CUPY:
        assert out[0]["source"] == "cupy"


def test_store_wait_times_out_typed(tmp_path):
    store = dist.FileStore(str(tmp_path / "store"), 2)
    with pytest.raises(CollectiveTimeoutError, match="did not publish"):
        bootstrap.all_gather_bytes(store, 0, 2, b"x", timeout=0.3, what="test")
    with pytest.raises(CollectiveTimeoutError):
        bootstrap.broadcast_bytes(store, 1, 0, lambda: b"never", timeout=0.3, what="test")
    with pytest.raises(ArgumentTypeError):
        bootstrap.all_gather_bytes(store, 0, 1, "text", timeout=1, what="test")
    with pytest.raises(ArgumentTypeError):
        bootstrap.namespace(object(), "k", [0], "test")


# -- errors when a library, device or port is missing; constructor arguments -------------------------------------


def test_cupy_missing_is_typed(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy then raises ImportError
    with pytest.raises(TransportUnavailableError) as ei:
        CupyNcclCommunicator(store=dist.HashStore(), rank=0, world_size=1)
    assert ei.value.reason == "CuPy is not installed" and "torsh-kernels[cuda]" in ei.value.fix


@pytest.mark.skipif(not HAS_CUPY or torch.cuda.is_available(), reason="needs CuPy and no GPU")
def test_cupy_without_gpu_is_typed():
    with pytest.raises(TransportUnavailableError) as ei:
        CupyNcclCommunicator(store=dist.HashStore(), rank=0, world_size=1)
    assert "no CUDA device" in ei.value.reason or "NCCL" in ei.value.reason


def test_pyverbs_missing_is_typed(monkeypatch):
    for m in [m for m in sys.modules if m == "pyverbs" or m.startswith("pyverbs.")]:
        monkeypatch.delitem(sys.modules, m)
    monkeypatch.setitem(sys.modules, "pyverbs", None)
    with pytest.raises(TransportUnavailableError) as ei:
        RdmaCommunicator(store=dist.HashStore(), rank=0, world_size=1)
    assert ei.value.reason == "pyverbs is not installed" and "python3-pyverbs" in ei.value.fix


@pytest.mark.skipif(not SYSTEM_PYVERBS.is_dir() or Path("/sys/class/infiniband").is_dir(),
                    reason="needs Debian's python3-pyverbs and a machine without RDMA devices")  # fmt: skip
def test_real_pyverbs_reports_no_device(tmp_path):
    """rdma-core's own pyverbs (Debian's python3-pyverbs, built for this Python minor version) on a
    machine with no RDMA device: the communicator says so, typed, with the fix."""
    (tmp_path / "pyverbs").symlink_to(SYSTEM_PYVERBS)  # only pyverbs, not the rest of dist-packages
    code = textwrap.dedent("""
        import torch, torch.distributed as dist
        from torsh_kernels.collectives.rdma import RdmaCommunicator, load_verbs
        from torsh_kernels.errors import TransportUnavailableError
        load_verbs()  # the real library imports
        try:
            RdmaCommunicator(store=dist.HashStore(), rank=0, world_size=1)
        except TransportUnavailableError as e:
            print("REASON", e.reason)
            print("FIX", e.fix)
    """)
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "REASON no RDMA device" in p.stdout and "rdma_rxe" in p.stdout


@pytest.mark.skipif(not SYSTEM_PYVERBS.is_dir(), reason="needs Debian's python3-pyverbs")
def test_verbs_objects_built_with_the_real_pyverbs(tmp_path):
    """The queue-pair attributes and work requests the communicator posts, built with rdma-core's own
    pyverbs (no device is needed to build them) and read back field by field."""
    (tmp_path / "pyverbs").symlink_to(SYSTEM_PYVERBS)
    code = textwrap.dedent("""
        from torsh_kernels.collectives import rdma, rdma_verbs
        v = rdma.load_verbs()
        e = v.enums
        gid = bytes.fromhex("fe800000000000000202c9fffe000001")
        remote = rdma.Endpoint(0x1234, 0xABCDE, 7, 3, gid, 0x7F0000001000, 0x55, 1 << 21)
        me = rdma.Endpoint(0x99, 0x42, 8, 3, gid, 0x7F0000002000, 0x66, 1 << 21)
        a = rdma.init_attributes(v, 1)
        assert a.port_num == 1 and a.pkey_index == 0
        assert a.qp_access_flags == e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE
        r = rdma.rtr_attributes(v, 1, e.IBV_MTU_4096, 3, remote)
        assert (r.dest_qp_num, r.rq_psn, r.path_mtu) == (0x1234, 0xABCDE, e.IBV_MTU_4096)
        ah = r.ah_attr
        assert (ah.dlid, ah.is_global, ah.port_num, ah.sgid_index) == (7, 1, 1, 3), ah
        assert str(ah.dgid) == remote.gid_str, (str(ah.dgid), remote.gid_str)
        local = rdma.rtr_attributes(v, 1, e.IBV_MTU_1024, 0, rdma.Endpoint(1, 2, 9, 0, bytes(16), 0, 0, 0))
        assert local.ah_attr.is_global == 0 and local.ah_attr.dlid == 9  # InfiniBand: by LID, no GRH
        t = rdma.rts_attributes(v, me)
        assert (t.sq_psn, t.timeout, t.retry_cnt, t.rnr_retry) == (0x42, 14, 7, 7)
        w = rdma.write_request(v, 3, 0x1000, 4096, 0x11, 5, 0x55, 0x7F0000001000)
        assert (w.wr_id, w.num_sge, w.opcode, w.imm_data) == (3, 1, e.IBV_WR_RDMA_WRITE_WITH_IMM, 5)
        assert w.send_flags == e.IBV_SEND_SIGNALED
        # (pyverbs does not expose a WR's SGE list for reading: the address, length and key are not checked)
        c = rdma.credit_request(v, 2, 0x2000, 0x12)
        assert (c.opcode, c.imm_data) == (e.IBV_WR_SEND_WITH_IMM, rdma_verbs.IMM_CREDIT)
        rr = rdma.recv_request(v, 4, 0x3000, 64, 0x13)
        assert (rr.wr_id, rr.num_sge) == (4, 1)
        print("OK")
    """)
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0 and "OK" in p.stdout, p.stdout + p.stderr


class _FakeVerbs:
    """A stand-in for pyverbs' device listing only, to reach the port checks of open_device (which a
    machine without a NIC cannot reach with the real library)."""

    class enums:
        IBV_PORT_ACTIVE = 4

    def __init__(self, devices: dict[str, int]):
        fake = self

        class Dev:
            def __init__(self, name):
                self.name = name.encode()

        class Ctx:
            def __init__(self, name):
                self.name = name

            def query_port(self, port):
                if port != 1:
                    raise RuntimeError("no such port")
                return type("PortAttr", (), {"state": fake.devices[self.name]})()

            def close(self):
                fake.closed.append(self.name)

        self.devices, self.closed = devices, []
        self.device = type("device", (), {"get_device_list": staticmethod(lambda: [Dev(n) for n in devices]),
                                          "Context": staticmethod(lambda name: Ctx(name))})  # fmt: skip


def test_open_device_port_checks():
    v = _FakeVerbs({"mlx5_0": 1, "mlx5_1": 4})
    assert open_device(v, None, 1, "t").name == "mlx5_1"  # the first with an active port
    assert v.closed == ["mlx5_0"]
    with pytest.raises(TransportUnavailableError, match="port 1 is not ACTIVE") as ei:
        open_device(v, "mlx5_0", 1, "t")
    assert "DOWN" in ei.value.reason
    with pytest.raises(TransportUnavailableError, match="no RDMA device named 'rxe9'"):
        open_device(v, "rxe9", 1, "t")
    with pytest.raises(TransportUnavailableError, match="has no port 2"):
        open_device(v, "mlx5_1", 2, "t")
    with pytest.raises(TransportUnavailableError, match="no RDMA device"):
        open_device(_FakeVerbs({}), None, 1, "t")


@pytest.mark.parametrize("cls", [CupyNcclCommunicator, RdmaCommunicator])
def test_constructor_arguments_checked_first(cls):
    s = dist.HashStore()
    for kwargs in ({"store": s}, {"store": s, "rank": 0}, {"store": s, "rank": 2, "world_size": 2},
                   {"store": s, "rank": 0, "world_size": 1, "timeout": 0},
                   {"store": s, "rank": "0", "world_size": 1}, {"rank": 0, "world_size": 1}):  # fmt: skip
        with pytest.raises(InvalidArgumentError):
            cls(**kwargs)
    with pytest.raises(InvalidArgumentError):
        cls(dist.group.WORLD if dist.is_initialized() else object(), store=s, rank=0, world_size=1)


def test_rdma_constructor_arguments():
    s = dist.HashStore()
    for kwargs in ({"chunk_bytes": 8}, {"port": 0}, {"gid_index": -1}, {"chunk_bytes": 1.5}):
        with pytest.raises(InvalidArgumentError):
            RdmaCommunicator(store=s, rank=0, world_size=1, **kwargs)


@pytest.mark.parametrize("cls", [CupyNcclCommunicator, RdmaCommunicator])
def test_new_communicators_implement_the_protocol(cls):
    import inspect

    for name, member in inspect.getmembers(Communicator):
        if name.startswith("_"):
            continue
        assert hasattr(cls, name), f"{cls.__name__} lacks {name}"
        if callable(member) and not isinstance(inspect.getattr_static(Communicator, name), property):
            want = list(inspect.signature(member).parameters)
            got = list(inspect.signature(getattr(cls, name)).parameters)
            assert got == want, f"{cls.__name__}.{name}{got} vs the protocol's {want}"


# -- make_communicator, transports() -------------------------------------------------------------------------------


def test_transports_report_every_kind_with_reasons():
    st = {t.name: t for t in transports()}
    assert set(st) == {"torch", "cupy-nccl", "rdma"}
    assert st["torch"].available and "gloo" in st["torch"].detail
    for t in st.values():
        assert t.detail
        if not t.available:
            assert t.fix, t
    if not torch.cuda.is_available():
        assert not st["cupy-nccl"].available
    if not Path("/sys/class/infiniband").is_dir():
        assert not st["rdma"].available
    ok, why = namespaces_supported()
    assert isinstance(ok, bool) and why


def _make_worker(comm: TorchCommunicator) -> list:
    out = []
    c = make_communicator("torch")
    x = torch.full((5,), float(comm.rank + 1))
    c.all_reduce(x)
    out.append(x.tolist())
    a = make_communicator("auto")  # no RDMA port and no NCCL here: torch
    out.append(type(a).__name__)
    for kind in ("cupy-nccl", "rdma"):
        try:
            make_communicator(kind, timeout=5)
            out.append(f"{kind} made")
        except TransportUnavailableError as e:
            out.append(f"{kind}: {e.reason}")
    return out


def test_make_communicator_on_real_processes():
    out = run_local(_make_worker, 2, timeout=120)
    for o in out:
        assert o[0] == [3.0] * 5
        if not Path("/sys/class/infiniband").is_dir():
            assert o[1] == "TorchCommunicator"
        if not torch.cuda.is_available():
            assert o[2].startswith("cupy-nccl: ") and o[3].startswith("rdma: ")


def test_make_communicator_kinds():
    assert KINDS == ("auto", "torch", "cupy-nccl", "rdma")
    for bad in ("nccl", None, 3):
        with pytest.raises(InvalidArgumentError):
            make_communicator(bad)
    if not torch.cuda.is_available() and not Path("/sys/class/infiniband").is_dir():
        with pytest.raises(TransportUnavailableError):
            make_communicator("auto", store=dist.HashStore(), rank=0, world_size=1)
