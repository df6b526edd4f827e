"""Compressed all-reduce: every rank ends with the average of the ranks' compressed contributions.

``compressed_all_reduce(tensor, comm, compressor, state)`` overwrites ``tensor`` with the average and
moves each compressor's payload with the collective that is correct for it:

- linear compressors (none, FP16, BF16, PowerSGD's P and Q rounds): all-reduce of the payload, then one
  decompression with ``alpha = 1 / world_size``. FP16 payloads are divided by the world size *before*
  the all-reduce (as PyTorch's ``fp16_compress_hook`` does) so the sum cannot overflow fp16. PowerSGD
  orthogonalises the summed P, and every rank ends with the same estimate ``P Q^T``.
- top-k: all-gather of each rank's (values, indices), packed into one byte buffer (one message), then
  one fused scatter-add of all ranks' values into the result.
- quantized (int8 / int4): either all-gather of (codes, scales) then a fused dequantize-sum, or the
  *shared-scale* scheme: an all-reduce(max) of the per-block scales, every rank quantizes with the
  shared scales, the codes are summed exactly by an integer all-reduce (int8 where
  ``world_size * qmax <= 127``, else int32) and decoded once. ``quantize_mode="auto"`` asks the cost
  model which moves fewer bytes for this world size; both give the mean of the ranks' dequantized
  contributions (with the shared scale, each contribution is quantized on a coarser common grid).
- sign (1 bit): the two-phase scheme of 1-bit Adam / DeepSpeed's compressed all-reduce. Each rank
  splits its error-compensated tensor into ``world_size`` chunks and sign-compresses each (its own
  scale), an all-to-all sends chunk ``d`` to rank ``d``, which averages the decompressed chunks, adds
  its *server* residual and sign-compresses the average again (keeping the new server residual), and an
  all-gather returns every chunk to every rank. Worker and server error feedback both live in the
  rank's state (``residual`` and ``server_residual``).

Ordering: the collectives a call issues depend only on the compressor, the tensor's shape and the
state's step count, never on timing or on the data, so ranks that make the same calls issue the same
collectives in the same order, whatever the number of buckets. (PyTorch's PowerSGD hook on gloo with
several buckets fails with "Received data size doesn't match expected size"; this does not.)

Each rank keeps its own ``state`` per bucket (error-feedback residuals are per rank by design). Give
each rank a different seed (``compressor.new_state(seed=rank)``) when stochastic rounding is used, so
the ranks' rounding noise is independent. PowerSGD needs the same initial Q on every rank: on a fresh
state's first call, rank 0's seed is broadcast and adopted by all.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import torch

from .. import _trace
from ..compression import FP16, CompressionState, Compressor, NoCompression, Payload, PowerSGD, Quantize, Sign
from ..errors import ArgumentTypeError, DeviceMismatchError, InvalidArgumentError, NonFiniteError, ShapeError
from ..ops.bucket import flatten, unflatten
from ..ops.compress import (
    COMPRESS_DTYPES,
    QMAX,
    _count_nonfinite,
    block_codes,
    residual_add,
    seed_key,
    sign_compress,
    sign_decompress,
)
from .communicator import Communicator
from .cost_model import Link, quantize_codes_dtype, quantize_shared_scale_cheaper, sign_chunk

__all__ = ["CompressedReduction", "compressed_all_reduce", "start_compressed_all_reduce"]

QUANTIZE_MODES = ("auto", "all_gather", "shared_scale")


class CompressedReduction:
    """A compressed all-reduce in flight. Each round's collectives are issued asynchronously; ``step()``
    waits for the current round and issues the next (or finishes), ``wait()`` runs to the end.

    Several reductions may be in flight at once (one per bucket): as long as every rank starts them and
    steps them in the same order, every rank issues the same collectives in the same order. The DDP
    hook and the gradient synchronizer pipeline them that way (PowerSGD's P round of one bucket travels
    while the Q round of the one before is computed)."""

    __slots__ = ("_gen", "_pending", "_trace_args", "bytes_sent", "compute_s", "done", "rounds", "tensors", "wait_s")

    def __init__(
        self, tensors: list[torch.Tensor], gen, compressor: str = "none", algorithm: str = "all_reduce"
    ) -> None:
        self.tensors = tensors
        """The tensors being averaged in place (the result lands in them)."""
        self.bytes_sent = 0
        """Payload bytes this rank has put on the wire so far (each collective's input, summed)."""
        self.rounds = 0
        """Rounds of collectives issued so far."""
        self.compute_s = 0.0
        """Seconds spent compressing and decompressing (this rank, wall clock)."""
        self.wait_s = 0.0
        """Seconds spent waiting for collectives to complete."""
        self.done = False
        self._gen = gen
        self._pending: list = []
        self._trace_args = (compressor, algorithm)
        self._resume()

    def _resume(self) -> None:
        rec = _trace.recorder
        if rec is not None:
            c, alg = self._trace_args
            dev = self.tensors[0].device if self.tensors else None
            # compressing this round, issuing its collectives (which inherit compressor and algorithm from
            # this span) and decompressing the previous one; uncompressed reductions only issue
            name = f"{c} round {self.rounds + 1}" if c != "none" else "issue all_reduce"
            cat = "compression" if c != "none" else "issue"
            with rec.span(name, cat, {"compressor": c, "algorithm": alg, "round": self.rounds + 1}, device=dev):
                self._advance()
        else:
            self._advance()

    def _advance(self) -> None:
        t0 = time.perf_counter()
        try:
            self._pending, nbytes = next(self._gen)  # each round: its handles and the bytes it sends
            self.bytes_sent += nbytes
            self.rounds += 1
        except StopIteration:
            self._pending, self.done, self._gen = [], True, None
        finally:
            self.compute_s += time.perf_counter() - t0

    def step(self) -> bool:
        """Wait for the current round, then issue the next one or finish. Returns ``done``."""
        if self.done:
            return True
        t0 = time.perf_counter()
        rec = _trace.recorder
        if rec is not None and self._pending:
            with rec.span("wait", "wait", {"compressor": self._trace_args[0], "round": self.rounds}):
                for h in self._pending:
                    h.wait()
        else:
            for h in self._pending:
                h.wait()
        self.wait_s += time.perf_counter() - t0
        self._resume()
        return self.done

    def wait(self) -> list[torch.Tensor]:
        """Run to the end; returns the averaged tensors."""
        while not self.step():
            pass
        return self.tensors


def compressed_all_reduce(
    tensor: torch.Tensor | Sequence[torch.Tensor],
    comm: Communicator,
    compressor: Compressor | None = None,
    state: CompressionState | Sequence[CompressionState] | None = None,
    *,
    quantize_mode: str = "auto",
    link: Link | None = None,
) -> torch.Tensor | list[torch.Tensor]:
    """Average ``tensor`` over the ranks of ``comm`` through ``compressor`` (None: uncompressed), in
    place; returns ``tensor``. ``state`` is this rank's state for this tensor (bucket), from
    ``compressor.new_state()``; it may be None only for stateless compressors (none, FP16, BF16).
    ``link`` (e.g. from ``probe``) informs ``quantize_mode="auto"``.

    ``tensor`` may also be a list of tensors with a list of states (one per tensor): each tensor is
    compressed on its own, and the payloads of a round share one collective where the compressor
    allows it (linear compressors: one flat all-reduce per round; top-k and gathered int8/int4: one
    all-gather)."""
    r = start_compressed_all_reduce(tensor, comm, compressor, state, quantize_mode=quantize_mode, link=link)
    r.wait()
    return tensor


def start_compressed_all_reduce(
    tensor: torch.Tensor | Sequence[torch.Tensor],
    comm: Communicator,
    compressor: Compressor | None = None,
    state: CompressionState | Sequence[CompressionState] | None = None,
    *,
    quantize_mode: str = "auto",
    link: Link | None = None,
) -> CompressedReduction:
    """Validate, compress and issue the first round of :func:`compressed_all_reduce`; returns the
    :class:`CompressedReduction` to ``step()`` or ``wait()`` on. Arguments as for
    ``compressed_all_reduce``."""
    what = "compressed_all_reduce"
    single = isinstance(tensor, torch.Tensor)
    if single:
        tensors = [tensor]
    elif isinstance(tensor, (list, tuple)):
        tensors = list(tensor)
    else:
        raise ArgumentTypeError(f"{what}: expected a torch.Tensor or a list of them, got {type(tensor).__name__}")
    dev = comm.device
    for i, t in enumerate(tensors):
        name = "tensor" if single else f"tensor[{i}]"
        if not isinstance(t, torch.Tensor):
            raise ArgumentTypeError(f"{what}: {name} is a {type(t).__name__}, expected a torch.Tensor")
        if t.dtype not in COMPRESS_DTYPES:
            raise InvalidArgumentError(f"{what}: {name} dtype {t.dtype}; expected float32, float16 or bfloat16")
        if not t.is_contiguous():
            raise ShapeError(f"{what}: {name} must be contiguous (the average is written into it)")
        if t.device.type != dev.type or (dev.type == "cuda" and t.device.index != dev.index):
            raise DeviceMismatchError(f"{what}: {name} is on {t.device}, the communicator moves tensors on {dev}")
    if compressor is None:
        compressor = NoCompression()
    if not isinstance(compressor, Compressor):
        raise ArgumentTypeError(f"{what}: compressor must be a Compressor or None, got {type(compressor).__name__}")
    stateful = not compressor.is_linear or isinstance(compressor, PowerSGD)
    if single:
        states = [state]
    elif state is None:
        states = [None] * len(tensors)
    elif isinstance(state, (list, tuple)) and len(state) == len(tensors):
        states = list(state)
    else:
        got = f"{len(state)} states" if isinstance(state, (list, tuple)) else type(state).__name__
        raise InvalidArgumentError(f"{what}: {len(tensors)} tensors need a list of {len(tensors)} states, got {got}")
    for i, s in enumerate(states):
        if s is None:
            if stateful:
                raise InvalidArgumentError(
                    f"{what}: {type(compressor).__name__} keeps state (error feedback); pass "
                    "state=compressor.new_state() (one per tensor) and reuse it for that tensor on every step"
                )
            states[i] = compressor.new_state()
        elif not isinstance(s, CompressionState):
            raise ArgumentTypeError(f"{what}: state must be a CompressionState, got {type(s).__name__}")
    if stateful and len({id(s) for s in states}) != len(states):
        raise InvalidArgumentError(f"{what}: each tensor needs its own state; the same state was given twice")
    if quantize_mode not in QUANTIZE_MODES:
        raise InvalidArgumentError(f"{what}: quantize_mode must be one of {QUANTIZE_MODES}, got {quantize_mode!r}")
    live = [(t, s) for t, s in zip(tensors, states) if t.numel()]
    if not live:
        gen, alg = iter(()), "none"
    elif isinstance(compressor, Sign):
        gen, alg = _lockstep([_sign_two_phase(t, comm, compressor, s) for t, s in live]), "two-phase sign"
    elif isinstance(compressor, Quantize) and _shared_scale(quantize_mode, live, compressor, comm, link):
        gen, alg = _lockstep([_quantize_shared(t, comm, compressor, s) for t, s in live]), "shared-scale all_reduce"
    elif compressor.is_linear:
        gen, alg = _linear([t for t, _ in live], [s for _, s in live], comm, compressor), "all_reduce"
    else:
        gen, alg = _gathered([t for t, _ in live], [s for _, s in live], comm, compressor), "all_gather"
    cname = "none" if isinstance(compressor, NoCompression) else type(compressor).__name__
    return CompressedReduction(tensors, gen, cname, alg)


def _shared_scale(mode: str, live, q: Quantize, comm: Communicator, link: Link | None) -> bool:
    if mode == "auto":
        n = max(t.numel() for t, _ in live)
        return quantize_shared_scale_cheaper(n, q, comm.world_size, link)
    return mode == "shared_scale"


def _lockstep(gens):
    """Run several per-tensor generators round by round: round k of tensor 0, then of tensor 1, ..."""
    live = list(gens)
    while live:
        handles, nbytes, nxt = [], 0, []
        for g in live:
            try:
                hs, nb = next(g)
            except StopIteration:
                continue
            handles += hs
            nbytes += nb
            nxt.append(g)
        live = nxt
        if live:
            yield handles, nbytes


def _linear(tensors, states, comm: Communicator, compressor: Compressor):
    """Linear compressors: per round, every tensor's payload in one flat all-reduce per dtype."""
    ws = comm.world_size
    dev = tensors[0].device
    fresh = [s for s in states if isinstance(compressor, PowerSGD) and s.step == 0 and "q" not in s.tensors]
    if fresh:
        # P = sum_r M_r Q needs one Q on every rank: agree on rank 0's seeds once per fresh state
        seeds = torch.tensor([s.seed for s in fresh], dtype=torch.int64, device=dev)
        yield [comm.broadcast(seeds, 0, async_op=True)], 0  # bookkeeping, not payload
        for s, v in zip(fresh, seeds.tolist()):
            s.seed = int(v)
    if isinstance(compressor, NoCompression):
        # the payload is the tensor itself: one fused flatten, all-reduce, unflatten with the 1/ws scale
        for t, s in zip(tensors, states):
            compressor.compress(t, s)  # the finite check and the step count
        flat, layout = (tensors[0].view(-1), None) if len(tensors) == 1 else flatten(tensors)
        yield [comm.all_reduce(flat, "sum", async_op=True)], flat.numel() * flat.element_size()
        if layout is None:
            flat.div_(ws)
        else:
            unflatten(flat, layout, tensors, scale=1.0 / ws)
        return
    prescaled = isinstance(compressor, FP16)  # divided by ws before the sum so fp16 cannot overflow
    payloads = [compressor.compress(t, s) for t, s in zip(tensors, states)]
    active = list(range(len(tensors)))
    while active:
        groups: dict[torch.dtype, list[tuple[int, str, torch.Tensor]]] = {}
        for i in active:
            for name, t in payloads[i].tensors.items():
                groups.setdefault(t.dtype, []).append((i, name, t))
        handles, bufs, nbytes = [], [], 0
        for items in groups.values():
            ts = [t for _, _, t in items]
            if len(ts) == 1 and ts[0].is_contiguous():
                flat, layout = ts[0], None
                if prescaled:
                    flat.div_(ws)
            else:
                flat, layout = flatten(ts, scale=1.0 / ws if prescaled else 1.0)
            nbytes += flat.numel() * flat.element_size()
            handles.append(comm.all_reduce(flat, "sum", async_op=True))
            bufs.append((items, flat, layout))
        yield handles, nbytes
        for items, flat, layout in bufs:
            if layout is not None:
                for (i, name, _), v in zip(items, layout.views(flat)):
                    payloads[i].tensors[name] = v
        nxt = []
        for i in active:
            if payloads[i].final:
                compressor.decompress(payloads[i], states[i], tensors[i], alpha=1.0 if prescaled else 1.0 / ws)
            else:
                payloads[i] = compressor.advance(payloads[i], states[i])
                nxt.append(i)
        active = nxt


def _gathered(tensors, states, comm: Communicator, compressor: Compressor):
    """Non-linear compressors (top-k, gathered int8/int4): every tensor's payload packed into one byte
    buffer, one all-gather, then each tensor decoded from every rank's segment."""
    ws = comm.world_size
    payloads = [compressor.compress(t, s) for t, s in zip(tensors, states)]
    if not all(p.final for p in payloads):
        raise InvalidArgumentError(
            "compressed_all_reduce: a non-linear compressor with several rounds is not supported"
        )
    packs = [_pack(p) for p in payloads]
    buf = packs[0][0] if len(packs) == 1 else torch.cat([b for b, _ in packs])
    gathered = torch.empty(ws * buf.numel(), dtype=torch.uint8, device=buf.device)
    yield [comm.all_gather(gathered, buf, async_op=True)], buf.numel()
    seg = buf.numel()
    off = 0
    for t, s, p, (b, spec) in zip(tensors, states, payloads, packs):
        parts = [_unpack(gathered[r * seg + off : r * seg + off + b.numel()], spec, p.numel) for r in range(ws)]
        compressor.decompress_sum(parts, s, t, alpha=1.0 / ws)
        off += b.numel()


# -- gathered payloads: one byte buffer per rank ----------------------------------------------------------


def _pack(payload: Payload) -> tuple[torch.Tensor, list[tuple[str, torch.dtype, tuple[int, ...], int, int]]]:
    """The payload's tensors as one uint8 buffer (largest elements first, so every view stays aligned;
    the length padded to 8 so the ranks' segments do too), and how to read it back."""
    items = sorted(payload.tensors.items(), key=lambda kv: (-kv[1].element_size(), kv[0]))
    spec, off = [], 0
    for name, t in items:
        nb = t.numel() * t.element_size()
        spec.append((name, t.dtype, tuple(t.shape), off, nb))
        off += nb
    total = -(-off // 8) * 8
    dev = items[0][1].device if items else torch.device("cpu")
    buf = (torch.zeros if total != off else torch.empty)(total, dtype=torch.uint8, device=dev)
    for (_, t), (_, _, _, o, nb) in zip(items, spec):
        if nb:
            buf[o : o + nb].copy_(t.contiguous().view(-1).view(torch.uint8))
    return buf, spec


def _unpack(seg: torch.Tensor, spec, numel: int) -> Payload:
    tensors = {}
    for name, dtype, shape, o, nb in spec:
        tensors[name] = seg[o : o + nb].view(dtype).view(shape)
    return Payload(tensors, numel)


# -- quantized, shared scale -------------------------------------------------------------------------------


def _quantize_shared(x: torch.Tensor, comm: Communicator, q: Quantize, state: CompressionState):
    """All-reduce(max) of the block scales, quantize on the shared grid, exact integer sum of the codes."""
    ws = comm.world_size
    flat = x.view(-1)
    n = flat.numel()
    block = q.block
    nb = -(-n // block)
    qmax = QMAX[q.bits]
    if q.error_feedback:
        r = state.residual(flat)
        acc = state.buffer("acc", n, flat.device)
        residual_add(flat, r, out=acc, check_finite=q.check_finite, provider=q.provider)
    else:
        acc = flat.float()
        if q.check_finite and (bad := int(_count_nonfinite(acc))):
            raise NonFiniteError(
                f"compressed_all_reduce (Quantize): {bad} non-finite element(s) (NaN/Inf) in the tensor"
            )
    padded = torch.nn.functional.pad(acc, (0, nb * block - n)) if n % block else acc
    blocks = padded.view(nb, block)
    scales = blocks.abs().amax(dim=1).div_(qmax)
    yield [comm.all_reduce(scales, "max", async_op=True)], scales.numel() * scales.element_size()
    key = seed_key(q.step_seed(state)) if q.stochastic else 0
    codes = block_codes(blocks, scales, qmax, q.stochastic, key)
    mine = codes * scales[:, None]  # this rank's dequantized contribution
    if q.error_feedback:
        acc.sub_(mine.view(-1)[:n])  # the new residual, written over acc; the buffers swap roles
        state.tensors["residual"], state.work["acc"] = acc, r
    wire = codes.view(-1)[:n].to(quantize_codes_dtype(q.bits, ws))
    yield [comm.all_reduce(wire, "sum", async_op=True)], wire.numel() * wire.element_size()
    total = wire.view(-1).float()
    total = (torch.nn.functional.pad(total, (0, nb * block - n)) if n % block else total).view(nb, block)
    flat.copy_((total * (scales / ws)[:, None]).view(-1)[:n])
    state.step += 1


# -- sign, two phases --------------------------------------------------------------------------------------


def _sign_two_phase(x: torch.Tensor, comm: Communicator, c: Sign, state: CompressionState):
    ws, me = comm.world_size, comm.rank
    flat = x.view(-1)
    n = flat.numel()
    chunk = sign_chunk(n, ws)
    cb = chunk // 8  # sign bytes of a full chunk (a multiple of 4, so the scale after it is aligned)
    seg_bytes = cb + 4
    # check once up front: the per-chunk calls below must not change state half-way
    if c.check_finite and (bad := int(_count_nonfinite(flat))):
        raise NonFiniteError(f"compressed_all_reduce (Sign): {bad} non-finite element(s) (NaN/Inf) in the tensor")
    wr = state.residual(flat) if c.error_feedback else None

    def span(d: int) -> tuple[int, int]:
        return min(n, d * chunk), min(n, (d + 1) * chunk)

    send = torch.zeros(ws * seg_bytes, dtype=torch.uint8, device=flat.device)
    for d in range(ws):
        lo, hi = span(d)
        if hi == lo:
            continue
        bits, scale = sign_compress(flat[lo:hi], None if wr is None else wr[lo:hi], check_finite=False,
                                    provider=c.provider)  # fmt: skip
        base = d * seg_bytes
        send[base : base + bits.numel()].copy_(bits)
        send[base + cb : base + seg_bytes].copy_(scale.reshape(1).float().view(torch.uint8))
    recv = torch.empty_like(send)
    yield [comm.all_to_all(recv, send, async_op=True)], send.numel()

    lo, hi = span(me)
    mlen = hi - lo
    mine = torch.zeros(seg_bytes, dtype=torch.uint8, device=flat.device)
    if mlen:
        avg = state.buffer("server_avg", mlen, flat.device)
        nbits = -(-mlen // 8)
        for r in range(ws):
            base = r * seg_bytes
            sign_decompress(recv[base : base + nbits], recv[base + cb : base + seg_bytes].view(torch.float32), mlen,
                            out=avg, accumulate=r > 0, alpha=1.0 / ws, provider=c.provider)  # fmt: skip
        sr = None
        if c.error_feedback:
            sr = state.tensors.get("server_residual")
            if sr is None or sr.numel() != mlen or sr.device != flat.device:
                sr = torch.zeros(mlen, dtype=torch.float32, device=flat.device)
                state.tensors["server_residual"] = sr
        bits, scale = sign_compress(avg, sr, check_finite=False, provider=c.provider)
        mine[: bits.numel()].copy_(bits)
        mine[cb:].copy_(scale.reshape(1).float().view(torch.uint8))
    gathered = torch.empty(ws * seg_bytes, dtype=torch.uint8, device=flat.device)
    yield [comm.all_gather(gathered, mine, async_op=True)], mine.numel()
    for d in range(ws):
        lo, hi = span(d)
        if hi == lo:
            continue
        base = d * seg_bytes
        sign_decompress(gathered[base : base + math.ceil((hi - lo) / 8)],
                        gathered[base + cb : base + seg_bytes].view(torch.float32), hi - lo, out=flat[lo:hi],
                        provider=c.provider)  # fmt: skip
    state.step += 1
