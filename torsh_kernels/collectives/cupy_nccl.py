"""NCCL through CuPy: :class:`CupyNcclCommunicator`, a :class:`~torsh_kernels.collectives.Communicator`
that calls NCCL directly (``cupy.cuda.nccl``) on torch CUDA tensors, as vLLM's NCCL wrapper does.

- **Zero copy.** A tensor is passed as its data pointer (``tensor.data_ptr()``) and a count; nothing is
  copied or converted, no CuPy array is made.
- **Torch's streams.** A blocking call runs on torch's *current* stream, so it is ordered with the torch
  kernels before and after it without any synchronisation (the host does not wait). ``async_op=True``
  runs on the communicator's own stream, which first waits for the current one; the handle's ``wait()``
  makes the current stream wait for it (the host still does not block), as ``ProcessGroupNCCL`` does,
  and the tensors are marked as used on that stream for the caching allocator.
- **Dtypes.** Torch dtypes map to NCCL's own ``ncclDataType_t`` values (``nccl.h``), not through CuPy's
  dtype table: bfloat16 is NCCL's ``ncclBfloat16`` (9), passed to CuPy's call as the integer it
  forwards to NCCL unchanged, so it works with any CuPy that wraps NCCL >= 2.10 whether or not CuPy
  names it; reductions need the dtype in NCCL's table (:func:`reducible_dtypes`). Operations that only
  move data (all-gather, broadcast, all-to-all, send/recv) move bytes (``ncclUint8``), so every dtype
  moves, bool, int16, complex and float8 included.
- **Connection.** Created from a ``torch.distributed`` group (or DeviceMesh dimension) or from any store
  with ``rank=``/``world_size=``: the lowest rank makes the NCCL unique id and it travels through the
  store (:mod:`.bootstrap`).
- **Failures.** Every call first checks its arguments (the same checks and typed errors as
  :class:`~torsh_kernels.collectives.TorchCommunicator`). A watchdog thread polls each operation's
  completion event and NCCL's asynchronous error; an operation still running after ``timeout`` seconds,
  or an asynchronous error (a peer gone), aborts the NCCL communicator (``ncclCommAbort``, which
  unblocks the stuck kernels), and every later call or ``wait()`` raises ``CollectiveError``
  (``CollectiveTimeoutError`` for the timeout). ``close()`` destroys the communicator.

Requires CuPy with NCCL (the ``cuda`` extra: ``cupy-cuda12x`` and ``nvidia-nccl-cu12``) and a CUDA GPU;
without them construction raises :class:`~torsh_kernels.errors.TransportUnavailableError` saying why
and what to install.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from .. import recording
from ..errors import (
    ArgumentTypeError,
    CollectiveError,
    CollectiveTimeoutError,
    DTypeError,
    InvalidArgumentError,
    TransportUnavailableError,
)
from . import bootstrap
from .protocol import CommunicatorBase
from .traffic import Traffic

__all__ = [
    "CupyNcclCommunicator",
    "load_nccl",
    "nccl_datatype",
    "reducible_dtypes",
    "uid_from_bytes",
    "uid_to_bytes",
    "version_tuple",
]

# ncclDataType_t (nccl.h); bfloat16 since NCCL 2.10, the float8 types since 2.19
_NCCL_DTYPES = {
    torch.int8: 0, torch.uint8: 1, torch.int32: 2, torch.int64: 4, torch.float16: 6, torch.float32: 7,
    torch.float64: 8, torch.bfloat16: 9,
}  # fmt: skip
for _name, _code in (("uint32", 3), ("uint64", 5)):
    if hasattr(torch, _name):
        _NCCL_DTYPES[getattr(torch, _name)] = _code
NCCL_UINT8 = 1
NO_GPU_FIX = (
    "run on a machine with an NVIDIA GPU and a CUDA build of torch (pip install torch --index-url "
    "https://download.pytorch.org/whl/cu128)"
)
# ncclRedOp_t; avg since NCCL 2.10
NCCL_OPS = {"sum": 0, "product": 1, "max": 2, "min": 3, "avg": 4}
_V2_10 = (2, 10, 0)


def version_tuple(code: int) -> tuple[int, int, int]:
    """NCCL's version code as (major, minor, patch): ``X*10000 + Y*100 + Z`` from 2.9 on, ``X*1000 + Y*100
    + Z`` before (23203 is 2.32.3, 2708 is 2.7.8)."""
    if not isinstance(code, int) or isinstance(code, bool) or code <= 0:
        raise InvalidArgumentError(f"version_tuple: an NCCL version code is a positive int, got {code!r}")
    if code >= 10000:
        return code // 10000, code // 100 % 100, code % 100
    return code // 1000, code // 100 % 10, code % 100


def reducible_dtypes(version: tuple[int, int, int]) -> frozenset[torch.dtype]:
    """The torch dtypes NCCL of this version reduces (bfloat16 from 2.10 on)."""
    return frozenset(d for d in _NCCL_DTYPES if d is not torch.bfloat16 or tuple(version) >= _V2_10)


def nccl_datatype(dtype: torch.dtype, version: tuple[int, int, int], what: str = "nccl_datatype") -> int:
    """NCCL's ``ncclDataType_t`` value for reducing ``dtype`` (a typed error where NCCL has none)."""
    if not isinstance(dtype, torch.dtype):
        raise ArgumentTypeError(f"{what}: dtype must be a torch.dtype, got {type(dtype).__name__}")
    if dtype not in _NCCL_DTYPES or (dtype is torch.bfloat16 and tuple(version) < _V2_10):
        v = ".".join(map(str, version))
        hint = "; bfloat16 needs NCCL >= 2.10" if dtype is torch.bfloat16 else ""
        raise DTypeError(
            f"{what}: NCCL {v} cannot reduce {dtype}{hint}; reducible: "
            f"{sorted(str(d).replace('torch.', '') for d in reducible_dtypes(version))}"
        )
    return _NCCL_DTYPES[dtype]


def uid_to_bytes(uid: object) -> bytes:
    """NCCL's 128-byte unique id as bytes: CuPy 14 returns bytes, CuPy 13 a tuple of 128 signed chars."""
    if isinstance(uid, (bytes, bytearray)):
        b = bytes(uid)
    elif isinstance(uid, tuple) and all(isinstance(x, int) and -128 <= x < 256 for x in uid):
        b = bytes(x % 256 for x in uid)
    else:
        raise ArgumentTypeError(
            f"uid_to_bytes: an NCCL unique id is bytes or a tuple of ints, got {type(uid).__name__}"
        )
    if len(b) != 128:
        raise InvalidArgumentError(f"uid_to_bytes: an NCCL unique id is 128 bytes, got {len(b)}")
    return b


def uid_from_bytes(b: bytes, tuple_form: bool) -> bytes | tuple[int, ...]:
    """The id back in the form this CuPy's ``NcclCommunicator`` takes (a tuple of signed chars for CuPy 13)."""
    if len(b) != 128:
        raise InvalidArgumentError(f"uid_from_bytes: an NCCL unique id is 128 bytes, got {len(b)}")
    return tuple(x - 256 if x > 127 else x for x in b) if tuple_form else bytes(b)


def _load():
    """(cupy, cupy.cuda.nccl), or TransportUnavailableError saying what is missing and how to get it."""
    try:
        import cupy
    except ImportError as e:
        raise TransportUnavailableError(
            f"CupyNcclCommunicator: CuPy is not installed ({e})",
            reason="CuPy is not installed",
            fix="pip install 'torsh-kernels[cuda]'  (cupy-cuda12x and nvidia-nccl-cu12)",
        ) from e
    except Exception as e:  # a CuPy built for another CUDA, a broken install
        raise TransportUnavailableError(
            f"CupyNcclCommunicator: importing CuPy failed: {type(e).__name__}: {e}",
            reason=f"CuPy does not import ({type(e).__name__})",
            fix="reinstall the CuPy wheel matching the CUDA major version: pip install cupy-cuda12x",
        ) from e
    try:
        from cupy.cuda import nccl
    except Exception as e:
        nccl = None
        err = e
    if nccl is None or not getattr(nccl, "available", False):
        why = f" ({type(err).__name__}: {err})" if nccl is None else ""
        raise TransportUnavailableError(
            f"CupyNcclCommunicator: CuPy {cupy.__version__} found no NCCL library{why}",
            reason=f"CuPy {cupy.__version__} has no NCCL library",
            fix="pip install nvidia-nccl-cu12  (or python -m cupyx.tools.install_library --library nccl --cuda 12.x)",
        )
    return cupy, nccl


def load_nccl() -> tuple[object, tuple[int, int, int]]:
    """``cupy.cuda.nccl`` and the version of the NCCL library it loaded; TransportUnavailableError if none."""
    _, nccl = _load()
    return nccl, version_tuple(int(nccl.get_version()))


class _NcclHandle:
    """An operation on the communicator's stream; ``wait()`` orders the current stream after it."""

    __slots__ = ("_comm", "_done", "_event", "_then", "_what")

    def __init__(self, comm: CupyNcclCommunicator, event: torch.cuda.Event, what: str, then) -> None:
        self._comm, self._event, self._what, self._then, self._done = comm, event, what, then, False

    def wait(self) -> None:
        if self._done:
            return
        c = self._comm
        c._raise_if_failed(self._what)
        torch.cuda.current_stream(c._device).wait_event(self._event)
        self._done = True
        if self._then is not None:
            self._then()

    def is_completed(self) -> bool:
        return self._event.query()

    def future(self) -> torch.futures.Future:
        """A CUDA-aware ``torch.futures.Future``: its value is ready for kernels on the current stream once
        it completes (as ``ProcessGroupNCCL``'s futures are); ``.then`` callbacks run ordered after the
        operation. The host does not block."""
        fut = torch.futures.Future(devices=[self._comm._device])
        self.wait()
        fut.set_result(None)
        return fut


class CupyNcclCommunicator(CommunicatorBase):
    """A :class:`~torsh_kernels.collectives.Communicator` over NCCL through ``cupy.cuda.nccl`` (see the
    module docstring).

    Args:
        group: a ``torch.distributed`` process group (None: the default one), a ``DeviceMesh`` (with
            ``mesh_dim``) or ``(mesh, dim)``: its ranks form the NCCL communicator, its store carries the
            unique id. Ignored when ``store`` is given.
        mesh_dim: the mesh dimension, for a DeviceMesh ``group``.
        store: a ``torch.distributed`` Store (``TCPStore``, ``FileStore``) to exchange the id through,
            without an initialised process group; needs ``rank`` and ``world_size``.
        rank, world_size: this process's rank and the number of ranks, with ``store``.
        device: the CUDA device (default: torch's current device).
        timeout: seconds an operation (or the id exchange) may take before the communicator is aborted
            and ``CollectiveTimeoutError`` raised.
    """

    __slots__ = ("_cupy", "_error", "_lock", "_nccl", "_nccl_mod", "_pending", "_root_store", "_side",
                 "_timeout", "_version", "_watchdog")  # fmt: skip

    def __init__(
        self,
        group: object = None,
        *,
        mesh_dim: str | int | None = None,
        store: dist.Store | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        device: torch.device | str | int | None = None,
        timeout: float = 600.0,
        _global_ranks: Sequence[int] | None = None,
    ) -> None:
        what = "CupyNcclCommunicator"
        bootstrap.check_timeout(timeout, what)
        rank, world_size, ranks, root_store = bootstrap.identity(group, mesh_dim, store, rank, world_size, what)
        if _global_ranks is not None:
            ranks = list(_global_ranks)
        cupy, nccl = _load()
        if not torch.cuda.is_available():
            raise TransportUnavailableError(
                f"{what}: torch sees no CUDA device (torch {torch.__version__}, CUDA build: {torch.version.cuda})",
                reason="no CUDA device visible to torch",
                fix=NO_GPU_FIX,
            )
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device())
        device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        if device.type != "cuda":
            raise InvalidArgumentError(f"{what}: device must be a CUDA device, got {device}")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self._cupy, self._nccl_mod = cupy, nccl
        self._version = version_tuple(int(nccl.get_version()))
        self._rank, self._world, self._ranks, self._device = rank, world_size, ranks, device
        self._traffic = Traffic()
        self._backend = "cupy-nccl"
        self._reduce_dtypes = reducible_dtypes(self._version)
        self._timeout = float(timeout)
        self._root_store = root_store
        self._error: CollectiveError | None = None
        self._pending: collections.deque = collections.deque()
        self._lock = threading.Lock()
        self._watchdog: threading.Thread | None = None
        self._nccl = None
        ns = bootstrap.namespace(root_store, "cupy-nccl", ranks, what)
        uid = bootstrap.broadcast_bytes(ns, rank, 0, lambda: uid_to_bytes(nccl.get_unique_id()), timeout=self._timeout,
                                        what=what, key="uid")  # fmt: skip
        try:
            with cupy.cuda.Device(device.index):
                try:
                    self._nccl = nccl.NcclCommunicator(world_size, uid_from_bytes(uid, False), rank)
                except TypeError:  # CuPy 13 takes the id as a tuple (refused before NCCL is called)
                    self._nccl = nccl.NcclCommunicator(world_size, uid_from_bytes(uid, True), rank)
        except Exception as e:
            raise self._failure(f"{what} (ncclCommInitRank)", e) from e
        self._side = torch.cuda.Stream(device)

    # -- identity ------------------------------------------------------------------------------------------

    @property
    def nccl_version(self) -> tuple[int, int, int]:
        """The version of the NCCL library CuPy loaded."""
        return self._version

    @property
    def stream(self) -> torch.cuda.Stream:
        """The stream ``async_op=True`` operations run on."""
        return self._side

    # -- failure handling ----------------------------------------------------------------------------------

    def _raise_if_failed(self, what: str) -> None:
        if self._error is not None:
            raise type(self._error)(f"{what}: this communicator was aborted earlier: {self._error}")
        if self._nccl is None:
            raise CollectiveError(f"{what}: this communicator is closed")

    def _abort(self, err: CollectiveError) -> None:
        with self._lock:
            if self._error is None:
                self._error = err
            nccl, self._nccl = self._nccl, None
        if nccl is not None:
            with contextlib.suppress(Exception):  # already aborted or destroyed
                nccl.abort()

    def _watch(self, event: torch.cuda.Event, what: str) -> None:
        with self._lock:
            self._pending.append((event, time.monotonic() + self._timeout, what))
            if self._watchdog is None or not self._watchdog.is_alive():
                self._watchdog = threading.Thread(target=self._watch_loop, name="torsh-nccl-watchdog", daemon=True)
                self._watchdog.start()

    def _watch_loop(self) -> None:
        """Retire completed operations; abort on NCCL's asynchronous error or on an operation past its
        deadline. Ends when nothing is pending."""
        while True:
            with self._lock:
                while self._pending and self._pending[0][0].query():
                    self._pending.popleft()
                if not self._pending:
                    self._watchdog = None
                    return
                _, deadline, what = self._pending[0]
                nccl = self._nccl
            if nccl is None:
                return
            try:
                nccl.check_async_error()
            except Exception as e:
                self._abort(self._failure(what, e))
                return
            if time.monotonic() > deadline:
                self._abort(self._failure(what, TimeoutError(f"not complete after {self._timeout:g} s")))
                return
            time.sleep(0.002)

    def close(self) -> None:
        """Wait for what this rank issued, then destroy the NCCL communicator (abort it if that fails)."""
        with self._lock:
            nccl, self._nccl = self._nccl, None
        if nccl is None:
            return
        try:
            torch.cuda.synchronize(self._device)
            nccl.destroy()
        except Exception:
            with contextlib.suppress(Exception):
                nccl.abort()

    def __enter__(self) -> CupyNcclCommunicator:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- launching -----------------------------------------------------------------------------------------

    def _launch(self, what: str, call: Callable[[object, int], None], async_op: bool, tensors: Sequence[torch.Tensor],
                then: Callable[[], None] | None = None, *, nbytes: int = 0, op: str | None = None):  # fmt: skip
        """``call(nccl_comm, stream_handle)`` on the current stream (or the side stream, for async_op)."""
        self._raise_if_failed(what)
        cur = torch.cuda.current_stream(self._device)
        stream = cur
        if async_op:
            stream = self._side
            stream.wait_stream(cur)
        self._traffic.add(op or what, nbytes, self._world)
        rec = recording.recorder
        span = rec.collective(op or what, group=self._ranks, nbytes=nbytes, device=self._device) if rec else None
        try:
            with self._cupy.cuda.Device(self._device.index):
                call(self._nccl, stream.cuda_stream)
        except Exception as e:
            if span is not None:
                span.end(error=type(e).__name__)
            err = self._failure(what, e)
            self._abort(err)
            raise err from e
        event = torch.cuda.Event()
        event.record(stream)
        if span is not None:
            span.end()
        self._watch(event, what)
        if not async_op:
            if then is not None:
                then()
            return None
        for t in tensors:
            t.record_stream(stream)
        return _NcclHandle(self, event, what, then)

    # -- collectives -----------------------------------------------------------------------------------------

    def _reduction(self, result: torch.Tensor, op: str) -> tuple[int, int, Callable[[], None] | None]:
        """(NCCL datatype, NCCL op, what runs after) of a reduction into ``result`` (its dtype already
        checked against this NCCL's reducible ones): ``avg`` before NCCL 2.10 is a sum, then a division."""
        if op == "avg" and self._version < _V2_10:
            return _NCCL_DTYPES[result.dtype], NCCL_OPS["sum"], lambda: result.div_(self._world)
        return _NCCL_DTYPES[result.dtype], NCCL_OPS[op], None

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", *, async_op: bool = False) -> _NcclHandle | None:
        what = "all_reduce"
        op = self._check_op(op, what)
        t = self._check_tensor(tensor, what, "tensor", reduce=True, op=op)
        dt, code, then = self._reduction(t, op)
        ptr, n = t.data_ptr(), t.numel()
        return self._launch(what, lambda c, s: c.allReduce(ptr, ptr, n, dt, code, s), async_op, [t], then,
                            nbytes=t.nbytes)  # fmt: skip

    def all_gather(self, output: torch.Tensor | list[torch.Tensor], input: torch.Tensor, *,
                   async_op: bool = False) -> _NcclHandle | None:  # fmt: skip
        what = "all_gather"
        out, x = self._check_all_gather(output, input, what)
        then = None
        if isinstance(out, list):
            outs, out = out, torch.empty((self._world, *x.shape), dtype=x.dtype, device=x.device)

            def then() -> None:
                for r, o in enumerate(outs):
                    o.copy_(out[r])

        src, dst, nb = x.data_ptr(), out.data_ptr(), x.nbytes
        return self._launch(what, lambda c, s: c.allGather(src, dst, nb, NCCL_UINT8, s), async_op, [x, out], then,
                            nbytes=nb)  # fmt: skip

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: str = "sum", *,
                       async_op: bool = False) -> _NcclHandle | None:  # fmt: skip
        what = "reduce_scatter"
        out, x, op = self._check_reduce_scatter(output, input, op, what)
        dt, code, then = self._reduction(out, op)
        src, dst, n = x.data_ptr(), out.data_ptr(), out.numel()
        return self._launch(what, lambda c, s: c.reduceScatter(src, dst, n, dt, code, s), async_op, [x, out], then,
                            nbytes=x.nbytes)  # fmt: skip

    def broadcast(self, tensor: torch.Tensor, src: int, *, async_op: bool = False) -> _NcclHandle | None:
        what = "broadcast"
        t = self._check_tensor(tensor, what, "tensor")
        src = self._check_peer(src, what, "src")
        ptr, nb = t.data_ptr(), t.nbytes
        return self._launch(what, lambda c, s: c.broadcast(ptr, ptr, nb, NCCL_UINT8, src, s), async_op, [t],
                            nbytes=nb if src == self._rank else 0)  # fmt: skip

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, output_splits: Sequence[int] | None = None,
                   input_splits: Sequence[int] | None = None, *,
                   async_op: bool = False) -> _NcclHandle | None:  # fmt: skip
        what = "all_to_all"
        out, x, outs, ins = self._check_all_to_all(output, input, output_splits, input_splits, what)
        sends = byte_ranges(ins, x, self._world)
        recvs = byte_ranges(outs, out, self._world)
        nccl, sp, rp = self._nccl_mod, x.data_ptr(), out.data_ptr()

        def call(c, s) -> None:
            nccl.groupStart()
            try:
                for peer in range(self._world):
                    c.send(sp + sends[peer][0], sends[peer][1], NCCL_UINT8, peer, s)
                    c.recv(rp + recvs[peer][0], recvs[peer][1], NCCL_UINT8, peer, s)
            finally:
                nccl.groupEnd()

        return self._launch(what, call, async_op, [x, out], nbytes=x.nbytes)

    def send(self, tensor: torch.Tensor, dst: int, *, tag: int = 0, async_op: bool = False) -> _NcclHandle | None:
        what = "send"
        t = self._check_tensor(tensor, what, "tensor")
        dst = self._check_peer(dst, what, "dst")
        self._check_no_tag(tag, what)
        ptr, nb = t.data_ptr(), t.nbytes
        return self._launch(what, lambda c, s: c.send(ptr, nb, NCCL_UINT8, dst, s), async_op, [t], nbytes=nb)

    def recv(self, tensor: torch.Tensor, src: int, *, tag: int = 0, async_op: bool = False) -> _NcclHandle | None:
        what = "recv"
        t = self._check_tensor(tensor, what, "tensor")
        src = self._check_peer(src, what, "source")
        self._check_no_tag(tag, what)
        ptr, nb = t.data_ptr(), t.nbytes
        return self._launch(what, lambda c, s: c.recv(ptr, nb, NCCL_UINT8, src, s), async_op, [t])

    def barrier(self) -> None:
        """All ranks reach this point; the host waits (up to the timeout) for the token all-reduce."""
        t = torch.zeros(1, dtype=torch.int32, device=self._device)
        self.all_reduce(t)
        deadline = time.monotonic() + self._timeout
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self._device))
        while not ev.query():
            self._raise_if_failed("barrier")
            if time.monotonic() > deadline:
                err = CollectiveTimeoutError(f"barrier: not complete after {self._timeout:g} s on rank {self._rank}")
                self._abort(err)
                raise err
            time.sleep(0.0005)

    def split(self, groups: Sequence[Sequence[int]]) -> CupyNcclCommunicator:
        """A new NCCL communicator of the group holding this rank (its lowest rank makes the id; only the
        members take part)."""
        mine = self._split_members(groups)
        members = sorted(mine)
        return CupyNcclCommunicator(
            store=self._root_store, rank=members.index(self._rank), world_size=len(members), device=self._device,
            timeout=self._timeout, _global_ranks=[self._ranks[m] for m in members],
        )  # fmt: skip


def byte_ranges(splits: Sequence[int] | None, t: torch.Tensor, world: int) -> list[tuple[int, int]]:
    """(byte offset, byte count) of each rank's rows of ``t`` (dim-0 ``splits``; None: even)."""
    row = t.element_size()
    for s in t.shape[1:]:
        row *= s
    rows = [t.shape[0] // world] * world if splits is None else list(splits)
    out, off = [], 0
    for r in rows:
        out.append((off, r * row))
        off += r * row
    return out
