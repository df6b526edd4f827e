"""The comms FSDP2 calls in place of its own (:mod:`torsh_kernels.parallel.fsdp` says what they do and
:func:`~torsh_kernels.parallel.fsdp.apply_quantized_comm` installs them): :class:`QuantizedAllGather` (qwZ)
and :class:`QuantizedReduceScatter` (qgZ) on the blockwise quantize/dequantize kernels, over FSDP2's process
group or a torsh Communicator, each agreeing with the other ranks on every new call configuration; and
:func:`counting_default_comms`, FSDP2's own with the same traffic counters."""

from __future__ import annotations

import datetime
import threading
import time
import warnings
import weakref
from collections.abc import Sequence

import torch
import torch.distributed as dist

from .. import live
from ..checks import check_timeout
from ..collectives.agreement import agree_on, enabled
from ..collectives.communicator import TorchCommunicator, is_communicator
from ..collectives.traffic import wire_bytes as _on_wire
from ..env import fmt_bytes
from ..errors import ArgumentTypeError, InvalidArgumentError, NonFiniteError
from .fsdp_format import QuantizedFormat, Wire
from .live_step import StepMeter

try:  # private in torch 2.13 (the public setters take instances of these)
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather as _AllGather
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter as _ReduceScatter
except ImportError:  # pragma: no cover - a torch without FSDP2's comm interfaces
    _AllGather = _ReduceScatter = object

__all__ = ["LiveSteps", "QuantizedAllGather", "QuantizedReduceScatter", "counting_default_comms"]

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _all_gather(out: torch.Tensor, x: torch.Tensor, group, async_op: bool):
    f = getattr(dist, "all_gather_single", None)
    if f is not None:
        return f(out, x, group=group, async_op=async_op)
    return dist.all_gather_into_tensor(out, x, group=group, async_op=async_op)  # pragma: no cover - older torch


class LiveSteps:
    """FSDP2's steps as the live metrics see them, for the comms one :func:`~.fsdp.apply_quantized_comm` call
    installed: a step runs from one forward of the root module to the next (a forward pre-hook publishes the
    previous step's record there, while someone listens). The comms add what they sent and the seconds their
    encode and decode took (host time: on a GPU, the launches); the seconds the quantized collectives were in
    flight come from their communicator's timed :class:`~torsh_kernels.collectives.Traffic`. FSDP2 waits for
    its collectives itself, so ``comm_s`` (time blocked) is not observed here (null). On a sampling step the
    quantized reduce-scatters with error feedback add their gradients' and residuals' squared norms, for the
    compression error."""

    def __init__(self) -> None:
        self.meter = StepMeter("fsdp")
        self._lock = threading.Lock()
        self.payload = self.sent = 0
        self.compress_s = 0.0
        self.rank, self.world_size = 0, 1
        self.rnorm2: float | None = None  # this sampling step's residuals' squared norm

    def add_error(self, grad: torch.Tensor | None, residual: torch.Tensor | None) -> None:
        """A sampling step's reduce-scatter: its input gradient before the residual was added, and its residual
        after (each squared norm added)."""
        with self._lock:
            if grad is not None:
                self.meter.add_gradients([grad])
            if residual is not None:
                r2 = float(torch.linalg.vector_norm(residual, dtype=torch.float32).square())
                self.rnorm2 = r2 if self.rnorm2 is None else self.rnorm2 + r2

    def add(self, comm, payload: int, sent: int, compress_s: float) -> None:
        with self._lock:
            self.meter.watch(comm)
            self.rank, self.world_size = comm.rank, comm.world_size
            self.payload += payload
            self.sent += sent
            self.compress_s += compress_s

    def boundary(self, module, args) -> None:
        """The root module's forward pre-hook."""
        pub = live.publisher
        if pub is None:
            return
        with self._lock:
            m = self.meter
            step_s = m.lap()
            wire, busy = m.traffic()
            payload, sent, comp = self.payload, self.sent, self.compress_s
            self.payload = self.sent = 0
            self.compress_s = 0.0
            error = m.error(self.rnorm2)
            self.rnorm2 = None
        if step_s is None or not (payload or sent):
            m.sampling = pub.sampling(m.steps)
            return
        pub.publish(m.record(
            step=m.steps, rank=self.rank, world_size=self.world_size, step_s=step_s, comm_s=None, compress_s=comp,
            payload_bytes=payload, sent_bytes=sent, wire_bytes=wire, busy_s=busy, nonfinite=False,
            compressor=self.label, error=error,
        ))  # fmt: skip
        m.sampling = pub.sampling(m.steps)

    label = "fsdp"
    """The comms' formats (set by apply_quantized_comm: "weights=int8,grads=int4")."""


class _Transport:
    """Where a quantized comm's payload travels: FSDP2's process group (``comm`` None), or a torsh
    Communicator of the same ranks (NCCL through CuPy, RDMA, from ``make_communicator``)."""

    comm = None
    live: LiveSteps | None = None
    """The live metrics' step record this comm adds to (apply_quantized_comm shares one per call)."""
    timeout: float | None = None
    """Seconds any one collective of this comm may take before it fails with ``CollectiveError`` on this rank
    (its signature exchange, the payload over FSDP2's group, the plain all-gather); None: the process
    group's timeout (30 minutes by default). A ``comm`` given brings its own."""
    _group_comms: dict | None = None

    def _set_checks(self, check_signatures: bool | None, what: str) -> None:
        self.check_signatures = enabled(check_signatures, what)
        """Exchange each new call configuration's signature with the other ranks first (see
        :mod:`torsh_kernels.parallel.fsdp`)."""
        self.signature_checks = 0
        """Signature exchanges made (one per new call configuration)."""
        self.signature_s = 0.0
        """Seconds they took."""
        self._agreed: set = set()

    def _agree(self, group, key: tuple, extra: list, what: str) -> None:
        """Before the first call with this configuration: agree on it over FSDP2's group (both the quantized
        and the plain path use that group, so the exchange happens where the ranks' paths could part)."""
        if not self.check_signatures or key in self._agreed:
            return
        t0 = time.perf_counter()
        try:
            agree_on(self._group_comm(group), f"FSDP2's {what}", specs={"format": self.format}, extra=extra, what=what,
                     fix="Install the same comms (apply_quantized_comm with the same settings) on every rank's model, "
                     "sharded alike.")  # fmt: skip
        finally:
            self.signature_checks += 1
            self.signature_s += time.perf_counter() - t0
        self._agreed.add(key)

    def _set_comm(self, comm: object, what: str) -> None:
        if comm is not None and not is_communicator(comm, ("all_gather", "all_to_all", "world_size")):
            raise ArgumentTypeError(
                f"{what}: comm must be a torsh Communicator (CupyNcclCommunicator, RdmaCommunicator, ...) or None, "
                f"got {type(comm).__name__}"
            )
        self.comm = comm

    def _set_timeout(self, timeout: object, what: str) -> None:
        self.timeout = None if timeout is None else check_timeout(timeout, what)

    def _check_ranks(self, group, what: str) -> None:
        ws = dist.get_world_size(group)
        if self.comm is not None and self.comm.world_size != ws:
            raise InvalidArgumentError(
                f"{what}: comm has {self.comm.world_size} ranks, FSDP2's group {ws}; pass a communicator over the "
                "ranks FSDP2 shards over (the shard mesh dimension)"
            )

    def _group_comm(self, group) -> TorchCommunicator:
        """A TorchCommunicator over FSDP2's ``group`` (made once per group)."""
        if self._group_comms is None:
            self._group_comms = {}
        hit = self._group_comms.get(id(group))
        if hit is None or hit[0] is not group:
            hit = self._group_comms[id(group)] = (group, TorchCommunicator(group, timeout=self.timeout))
        return hit[1]

    def _over(self, group):
        """The communicator the payload travels through: the given one, else a TorchCommunicator over
        FSDP2's group, so that a peer's failure or a timeout raises a typed ``CollectiveError`` rather than
        the backend's bare ``RuntimeError``."""
        return self.comm if self.comm is not None else self._group_comm(group)

    def _wire_all_gather(self, recv: torch.Tensor, send: torch.Tensor, group, async_op: bool):
        return _as_work(self._over(group).all_gather(recv, send, async_op=async_op), async_op)

    def _wire_all_to_all(self, recv: torch.Tensor, send: torch.Tensor, group, async_op: bool):
        return _as_work(self._over(group).all_to_all(recv, send, async_op=async_op), async_op)


def _as_work(handle, async_op: bool):
    """A torsh handle as the ``dist.Work`` FSDP2 expects (None for a blocking call; a complete one for a
    handle that is None, a collective already waited for)."""
    if not async_op:
        return None
    get = getattr(handle, "future", None)
    fut = get() if get is not None else None
    if fut is None:
        if handle is not None:
            handle.wait()
        fut = torch.futures.Future()
        fut.set_result(None)
    return torch._C._distributed_c10d._create_work_from_future(fut)


def _flat(t: object, what: str, name: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ArgumentTypeError(f"{what}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_contiguous():
        raise InvalidArgumentError(f"{what}: {name} must be contiguous (FSDP2 passes flat buffers)")
    return t.view(-1)


class _Allocate:
    """FSDP2's ``Comm.allocate``: the buffers it fills and passes to the comm, plain ``torch.empty``."""

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class QuantizedAllGather(_Allocate, _Transport, _AllGather):
    """FSDP2's all-gather with blockwise int8 (or int4) weights; see :mod:`torsh_kernels.parallel.fsdp`.

    ``shard_group_size``: the size of the group FSDP2 shards over (:func:`apply_quantized_comm` sets it).
    All-gathers over a smaller group are FSDP2's post-forward ones under ``reshard_after_forward=<int>``
    (ZeRO++'s hpZ: the backward all-gather within a node): those move the forward's weights, already
    dequantized, as they are, so backward computes with exactly the weights forward used, and the fast
    intra-node link carries them in full precision, as hpZ does. None: quantize every all-gather.

    ``comm``: a torsh Communicator over FSDP2's shard ranks to carry the quantized payload instead of
    FSDP2's process group (``make_communicator("cupy-nccl")``, ...); None: FSDP2's group.

    ``timeout``: seconds one collective may take before it fails with ``CollectiveError`` (see
    :attr:`timeout`); None: the process group's.

    ``check_signatures``: agree with the other ranks on each new call configuration first (see
    :mod:`torsh_kernels.parallel.fsdp`; None: on unless ``TORSH_KERNELS_CHECK_SIGNATURES=0``)."""

    def __init__(self, bits: int = 8, block: int = 256, *, fmt: str = "int",
                 shard_group_size: int | None = None, comm: object = None, timeout: float | None = None,
                 check_signatures: bool | None = None) -> None:  # fmt: skip
        self.format = QuantizedFormat.build(None, {"bits": bits, "block": block, "fmt": fmt}, "QuantizedAllGather")
        """What it sends (bits, block): a spec, agreed with the other ranks."""
        self._set_comm(comm, "QuantizedAllGather")
        self._set_timeout(timeout, "QuantizedAllGather")
        self._set_checks(check_signatures, "QuantizedAllGather")
        if shard_group_size is not None and (
            isinstance(shard_group_size, bool) or not isinstance(shard_group_size, int) or shard_group_size < 1
        ):
            raise InvalidArgumentError(
                f"QuantizedAllGather: shard_group_size must be a positive int or None, got {shard_group_size!r}"
            )
        self.bits, self.block, self.shard_group_size = self.format.bits, self.format.block, shard_group_size
        self.calls = 0
        """All-gathers run (quantized or passed through)."""
        self.plain_calls = 0
        """Of them, those passed through unquantized (non-float inputs, post-forward groups)."""
        self.bytes_sent = 0
        """Bytes this rank put on the wire: ``world_size - 1`` payloads per call (a ring all-gather's)."""

    def __repr__(self) -> str:
        return (
            f"QuantizedAllGather(bits={self.bits}, block={self.block}, fmt={self.format.fmt}, "
            f"shard_group_size={self.shard_group_size}, "
            f"calls={self.calls}, plain_calls={self.plain_calls}, sent {fmt_bytes(self.bytes_sent)})"
        )

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False):  # fmt: skip
        what = "QuantizedAllGather"
        out = _flat(output_tensor, what, "output_tensor")
        x = _flat(input_tensor, what, "input_tensor")
        ws = dist.get_world_size(group)
        n = x.numel()
        if out.numel() != ws * n:
            raise InvalidArgumentError(
                f"{what}: output_tensor has {out.numel()} elements, expected world_size ({ws}) x input ({n})"
            )
        subgroup = self.shard_group_size is not None and ws < self.shard_group_size
        plain = x.dtype not in _FLOATS or out.dtype != x.dtype or n == 0 or subgroup
        if not plain:
            self._check_ranks(group, what)
        self._agree(group, (n, x.dtype, out.dtype, ws, plain), [
            ("path", "unquantized" if plain else "quantized"), ("shard_group_size", self.shard_group_size),
            ("shard numel", n), ("dtype", x.dtype), ("output dtype", out.dtype),
        ], what)  # fmt: skip
        self.calls += 1
        if plain:
            self.plain_calls += 1
            self.bytes_sent += _on_wire("all_gather", x.nbytes, ws)
            return self._plain_all_gather(out, x, group, async_op)
        w = Wire(n, self.bits, self.block, self.format.fmt)
        steps = self.live if live.publisher is not None else None
        t0 = time.perf_counter()
        send = torch.empty(w.total, dtype=torch.uint8, device=x.device)
        w.encode(x, send)  # before anything overwrites x (FSDP2's input is a view of the output)
        recv = torch.empty(ws * w.total, dtype=torch.uint8, device=x.device)
        self.bytes_sent += _on_wire("all_gather", w.total, ws)  # a ring all-gather: ws - 1 segments sent
        rows = out.view(ws, n)
        if steps is not None:
            steps.add(self._over(group), _on_wire("all_gather", x.nbytes, ws), _on_wire("all_gather", w.total, ws),
                      time.perf_counter() - t0)  # fmt: skip

        def decode() -> None:
            t1 = time.perf_counter()
            for r in range(ws):
                w.decode(recv[r * w.total : (r + 1) * w.total], rows[r])
            if steps is not None:
                steps.add(self._over(group), 0, 0, time.perf_counter() - t1)

        if not async_op:
            self._wire_all_gather(recv, send, group, False)
            decode()
            return None
        work = self._wire_all_gather(recv, send, group, True)

        def done(f: torch.futures.Future) -> None:
            f.value()  # the collective's error, if any
            decode()

        return torch._C._distributed_c10d._create_work_from_future(work.get_future().then(done))

    def _plain_all_gather(self, out: torch.Tensor, x: torch.Tensor, group, async_op: bool):
        """FSDP2's own all-gather, in place on its group (the input is a view of the output); with a
        :attr:`timeout` on gloo, waited for here within it (so a failure is this rank's ``CollectiveError`` in
        time, not the process group's, 30 minutes later) and handed back to FSDP2 complete. On NCCL the group's
        own timeout applies (its watchdog), as for ``TorchCommunicator``: a bounded wait would block the host."""
        try:
            if self.timeout is None or "gloo" not in str(dist.get_backend(group)).lower():
                return _all_gather(out, x, group, async_op)
            _all_gather(out, x, group, True).wait(datetime.timedelta(seconds=self.timeout))
        except Exception as e:
            raise self._group_comm(group).failure("all_gather", e) from e
        return _as_work(None, async_op)


class QuantizedReduceScatter(_Allocate, _Transport, _ReduceScatter):
    """FSDP2's reduce-scatter as quantized chunks through one all-to-all, reduced in fp32, with an
    optional error-feedback residual; see :mod:`torsh_kernels.parallel.fsdp`.

    ``residual``: the fp32 tensor (of the reduce-scatter input's size) holding this rank's residual, or
    None to allocate one at the first call. :func:`apply_quantized_comm` passes the local part of the
    module buffer it registers, so the residual is checkpointed with the model. A residual loaded from a
    checkpoint is checked when ``load_state_dict`` gives it (:meth:`use_residual`); one written in place
    otherwise (``dcp.load`` alone) fails the quantization at its next use: both raise
    :class:`~torsh_kernels.errors.NonFiniteError` naming the residual, before anything is sent.

    ``timeout``: seconds one collective may take before it fails with ``CollectiveError``; None: the
    process group's."""

    def __init__(self, bits: int = 8, block: int = 256, error_feedback: bool = True, *, fmt: str = "int",
                 residual: torch.Tensor | None = None, comm: object = None, timeout: float | None = None,
                 check_signatures: bool | None = None) -> None:  # fmt: skip
        self.format = QuantizedFormat.build(None, {"bits": bits, "block": block, "fmt": fmt}, "QuantizedReduceScatter")
        """What it sends (bits, block): a spec, agreed with the other ranks."""
        self._set_comm(comm, "QuantizedReduceScatter")
        self._set_timeout(timeout, "QuantizedReduceScatter")
        self._set_checks(check_signatures, "QuantizedReduceScatter")
        if not isinstance(error_feedback, bool):
            raise ArgumentTypeError(
                f"QuantizedReduceScatter: error_feedback must be a bool, got {type(error_feedback).__name__}"
            )
        if residual is not None and (not isinstance(residual, torch.Tensor) or residual.dtype != torch.float32):
            raise ArgumentTypeError("QuantizedReduceScatter: residual must be an fp32 torch.Tensor or None")
        self.bits, self.block, self.error_feedback = self.format.bits, self.format.block, error_feedback
        self.residual = residual
        self._owner: tuple | None = None  # (weakref to the module, buffer name) whose buffer the residual must be
        self.calls = 0
        self.bytes_sent = 0
        """Bytes this rank put on the wire (the chunks it sent to the other ranks)."""

    def __repr__(self) -> str:
        return (
            f"QuantizedReduceScatter(bits={self.bits}, block={self.block}, fmt={self.format.fmt}, "
            f"error_feedback={self.error_feedback}, "
            f"calls={self.calls}, sent {fmt_bytes(self.bytes_sent)})"
        )

    def use_residual(self, residual: torch.Tensor, where: str) -> None:
        """Take ``residual`` (this rank's part, e.g. the module buffer a checkpoint was just loaded into) as the
        error-feedback residual, checked now: fp32, finite (``NonFiniteError`` naming ``where`` otherwise)."""
        if not isinstance(residual, torch.Tensor) or residual.dtype != torch.float32:
            raise ArgumentTypeError(f"QuantizedReduceScatter: {where}: the residual must be an fp32 torch.Tensor")
        self.residual = residual
        self._check_residual(residual, where)

    def bind_buffer(self, module: torch.nn.Module, name: str) -> None:
        """Keep the residual in ``module``'s buffer ``name`` (what :func:`~.fsdp.apply_quantized_comm` does): at
        every call the residual must still be that buffer's memory. Where the buffer was replaced since the residual
        was last set (``to_empty`` after a build on the meta device, as torchtitan does; ``.to()`` another device; a
        load with ``assign=True`` that skipped the load hook) its values are not known to be a residual, so the
        call raises :class:`~torsh_kernels.errors.InvalidArgumentError` before anything is sent, instead of using
        uninitialised memory or a residual the ``state_dict`` does not hold: zero it with
        :func:`~.fsdp.reset_residuals` or load a checkpoint into the module (``load_state_dict``)."""
        if not isinstance(module, torch.nn.Module) or not isinstance(name, str):
            raise ArgumentTypeError("QuantizedReduceScatter.bind_buffer: needs an nn.Module and a buffer name")
        self._owner = (weakref.ref(module), name)

    def _bound_residual(self, acc: torch.Tensor, what: str) -> torch.Tensor | None:
        """The residual this call uses when it is bound to a module buffer (:meth:`bind_buffer`): the buffer's
        memory, checked to be the tensor the residual was last set to; None when unbound (or the module is gone)."""
        if self._owner is None:
            return None
        module = self._owner[0]()
        if module is None:
            return None
        name = self._owner[1]
        buf = module._buffers.get(name)
        if buf is None:
            raise InvalidArgumentError(
                f"{what}: {type(module).__name__}.{name}, the error-feedback residual buffer, was removed; "
                "apply_quantized_comm again to register it"
            )
        with torch.no_grad():
            cur = buf.to_local() if hasattr(buf, "to_local") else buf
        res = self.residual
        where = f"{type(module).__name__}.{name}"
        if cur.is_meta:
            raise InvalidArgumentError(
                f"{what}: the error-feedback residual {where} is still on the meta device; materialise the model "
                "(model.to_empty(device=...)), then zero the residuals (torsh_kernels.parallel.fsdp.reset_residuals"
                "(model)) or load a checkpoint into it"
            )
        same = (
            res is not None and res.device == cur.device and res.numel() == cur.numel()
            and res.data_ptr() == cur.data_ptr()
        )  # fmt: skip
        if not same:
            why = (
                "was created on the meta device (a model built on meta, as torchtitan does) and the model was "
                "materialised since"
                if res is not None and res.is_meta
                else "was replaced since the residual was set (to_empty, .to() another device, a load with assign=True)"
            )
            raise InvalidArgumentError(
                f"{what}: the error-feedback residual {where} {why}, so its memory is not known to hold a residual "
                "(to_empty leaves it uninitialised); call torsh_kernels.parallel.fsdp.reset_residuals(model) to "
                "start error feedback from zero, or load a checkpoint into the model (load_state_dict, "
                "set_model_state_dict, torchtitan's CheckpointManager.load) to restore it"
            )
        if cur.numel() != acc.numel():
            raise InvalidArgumentError(
                f"{what}: the error-feedback residual {where} holds {cur.numel()} elements, the gradients "
                f"{acc.numel()}; apply_quantized_comm again after changing the model's sharding"
            )
        return res

    def _check_residual(self, res: torch.Tensor, where: str) -> None:
        bad = int(res.numel() - torch.isfinite(res).sum())
        if bad:
            raise NonFiniteError(
                f"QuantizedReduceScatter: the error-feedback residual ({where}) holds {bad} NaN/Inf of "
                f"{res.numel()} values; a residual is finite by construction, so the checkpoint it came from is "
                "damaged: load another one, or zero the residual buffer (torsh_rs_residual) to restart error "
                "feedback"
            )

    def _scale(self, op, ws: int) -> float:
        """The factor FSDP2's op applies to the sum: 1 (SUM), 1 / world_size (AVG), or PREMUL_SUM's."""
        if op == dist.ReduceOp.SUM:
            return 1.0
        if op == dist.ReduceOp.AVG:
            return 1.0 / ws
        if op == dist.ReduceOp.PREMUL_SUM:
            factor = getattr(op, "factor", None)
            if isinstance(factor, (int, float)):
                return float(factor)
        raise InvalidArgumentError(
            f"QuantizedReduceScatter: reduce op {op!r} is not supported (sum, avg and FSDP2's pre-multiplied "
            "sum are; gradients are never reduced with max/min)"
        )

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup, op,
                 async_op: bool = False):  # fmt: skip
        what = "QuantizedReduceScatter"
        out = _flat(output_tensor, what, "output_tensor")
        x = _flat(input_tensor, what, "input_tensor")
        ws = dist.get_world_size(group)
        self._check_ranks(group, what)
        n = out.numel()
        if x.numel() != ws * n:
            raise InvalidArgumentError(
                f"{what}: input_tensor has {x.numel()} elements, expected world_size ({ws}) x output ({n})"
            )
        scale = self._scale(op, ws)
        if n and x.dtype not in _FLOATS:
            raise InvalidArgumentError(f"{what}: gradients must be fp32, bf16 or fp16, got {x.dtype}")
        self._agree(group, (n, x.dtype, ws, scale), [
            ("error_feedback", self.error_feedback), ("shard numel", n),
            ("dtype", x.dtype), ("reduce scale", scale),
        ], what)  # fmt: skip
        self.calls += 1
        if n == 0:
            return None
        steps = self.live if live.publisher is not None else None
        sample = steps is not None and steps.meter.sampling and self.error_feedback
        if sample:
            steps.add_error(x, None)
        t0 = time.perf_counter()
        acc = x.float() if x.dtype != torch.float32 else x.clone()  # fp32, not FSDP2's buffer
        res = None
        if self.error_feedback:
            res = self._bound_residual(acc, what) if self._owner is not None else self.residual
            if res is None or res.numel() != acc.numel() or res.device != acc.device:
                if res is not None:
                    warnings.warn(
                        f"{what}: the residual buffer holds {res.numel()} elements on {res.device}, the gradients "
                        f"{acc.numel()} on {acc.device}; using a new residual, which the state_dict does not hold",
                        stacklevel=2,
                    )
                res = self.residual = torch.zeros(acc.numel(), dtype=torch.float32, device=acc.device)
            acc += res.view(-1)
        w = Wire(n, self.bits, self.block, self.format.fmt)
        send = torch.empty(ws * w.total, dtype=torch.uint8, device=x.device)
        chunks = acc.view(ws, n)
        try:
            for r in range(ws):
                w.encode(chunks[r], send[r * w.total : (r + 1) * w.total])
        except NonFiniteError:  # the gradient's, or the residual's (a damaged checkpoint loaded in place)?
            if res is not None:
                self._check_residual(res.view(-1), "at its first use since it was written: loaded from a checkpoint?")
            raise
        recv = torch.empty_like(send)
        self.bytes_sent += _on_wire("all_to_all", send.numel(), ws)  # ws - 1 of its ws segments
        if steps is not None:
            steps.add(self._over(group), _on_wire("reduce_scatter", x.nbytes, ws),
                      _on_wire("all_to_all", send.numel(), ws), time.perf_counter() - t0)  # fmt: skip

        def reduce() -> None:
            t1 = time.perf_counter()
            if res is not None:  # what quantizing lost, acc - dequantize(codes): kept once the collective is done
                rv = res.view(ws, n)
                rv.copy_(chunks)
                for r in range(ws):
                    w.decode(send[r * w.total : (r + 1) * w.total], rv[r], accumulate=True, alpha=-1.0)
            total = torch.zeros(n, dtype=torch.float32, device=x.device)
            for r in range(ws):  # the ranks' chunks of this shard, summed in fp32 in rank order
                w.decode(recv[r * w.total : (r + 1) * w.total], total, accumulate=True)
            if scale != 1.0:
                total.mul_(scale)
            out.copy_(total)
            if steps is not None:
                steps.add(self._over(group), 0, 0, time.perf_counter() - t1)
            if sample and res is not None:
                steps.add_error(None, res)

        if not async_op:
            self._wire_all_to_all(recv, send, group, False)
            reduce()
            return None
        work = self._wire_all_to_all(recv, send, group, True)

        def done(f: torch.futures.Future) -> None:
            f.value()  # the collective's error, if any
            reduce()

        return torch._C._distributed_c10d._create_work_from_future(work.get_future().then(done))


def counting_default_comms() -> tuple[type, type]:
    """FSDP2's own all-gather and reduce-scatter (its default implementations, unchanged) with the same
    ``bytes_sent`` / ``calls`` counters as the quantized ones (ring collectives: each rank sends
    ``world_size - 1`` segments of its shard per call), to measure plain FSDP2's traffic; install with
    ``set_custom_all_gather(AllGather())`` / ``set_custom_reduce_scatter(ReduceScatter())``."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

    class CountingAllGather(DefaultAllGather):
        def __init__(self) -> None:
            super().__init__()
            self.calls = self.bytes_sent = 0

        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            self.calls += 1
            self.bytes_sent += _on_wire("all_gather", input_tensor.nbytes, dist.get_world_size(group))
            return super().__call__(output_tensor, input_tensor, group, async_op)

    class CountingReduceScatter(DefaultReduceScatter):
        def __init__(self) -> None:
            super().__init__()
            self.calls = self.bytes_sent = 0

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            self.calls += 1
            self.bytes_sent += _on_wire("reduce_scatter", input_tensor.nbytes, dist.get_world_size(group))
            return super().__call__(output_tensor, input_tensor, group, op, async_op)

    return CountingAllGather, CountingReduceScatter
