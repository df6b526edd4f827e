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

import torch

from ..compression import FP16, CompressionState, Compressor, NoCompression, Payload, PowerSGD, Quantize, Sign
from ..errors import ArgumentTypeError, DeviceMismatchError, InvalidArgumentError, NonFiniteError, ShapeError
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

__all__ = ["compressed_all_reduce"]

QUANTIZE_MODES = ("auto", "all_gather", "shared_scale")


def compressed_all_reduce(
    tensor: torch.Tensor,
    comm: Communicator,
    compressor: Compressor | None = None,
    state: CompressionState | None = None,
    *,
    quantize_mode: str = "auto",
    link: Link | None = None,
) -> torch.Tensor:
    """Average ``tensor`` over the ranks of ``comm`` through ``compressor`` (None: uncompressed), in
    place; returns ``tensor``. ``state`` is this rank's state for this tensor (bucket), from
    ``compressor.new_state()``; it may be None only for stateless compressors (none, FP16, BF16).
    ``link`` (e.g. from ``probe``) informs ``quantize_mode="auto"``."""
    what = "compressed_all_reduce"
    if not isinstance(tensor, torch.Tensor):
        raise ArgumentTypeError(f"{what}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in COMPRESS_DTYPES:
        raise InvalidArgumentError(f"{what}: tensor dtype {tensor.dtype}; expected float32, float16 or bfloat16")
    if not tensor.is_contiguous():
        raise ShapeError(f"{what}: the tensor must be contiguous (the average is written into it)")
    dev = comm.device
    if tensor.device.type != dev.type or (dev.type == "cuda" and tensor.device.index != dev.index):
        raise DeviceMismatchError(f"{what}: tensor is on {tensor.device}, the communicator moves tensors on {dev}")
    if compressor is None:
        compressor = NoCompression()
    if not isinstance(compressor, Compressor):
        raise ArgumentTypeError(f"{what}: compressor must be a Compressor or None, got {type(compressor).__name__}")
    if state is None:
        if not compressor.is_linear or isinstance(compressor, PowerSGD):
            raise InvalidArgumentError(
                f"{what}: {type(compressor).__name__} keeps state (error feedback); pass "
                "state=compressor.new_state() and reuse it for this tensor on every step"
            )
        state = compressor.new_state()
    if not isinstance(state, CompressionState):
        raise ArgumentTypeError(f"{what}: state must be a CompressionState, got {type(state).__name__}")
    if quantize_mode not in QUANTIZE_MODES:
        raise InvalidArgumentError(f"{what}: quantize_mode must be one of {QUANTIZE_MODES}, got {quantize_mode!r}")
    if tensor.numel() == 0:
        return tensor
    ws = comm.world_size

    if isinstance(compressor, Sign):
        _sign_two_phase(tensor, comm, compressor, state)
        return tensor
    if isinstance(compressor, Quantize):
        mode = quantize_mode
        if mode == "auto":
            shared = quantize_shared_scale_cheaper(tensor.numel(), compressor, ws, link)
            mode = "shared_scale" if shared else "all_gather"
        if mode == "shared_scale":
            _quantize_shared(tensor, comm, compressor, state)
            return tensor

    if isinstance(compressor, PowerSGD) and state.step == 0 and "q" not in state.tensors:
        # P = sum_r M_r Q needs one Q on every rank: agree on rank 0's seed once per fresh state
        seed = torch.tensor([state.seed], dtype=torch.int64, device=dev)
        comm.broadcast(seed, 0)
        state.seed = int(seed.item())

    payload = compressor.compress(tensor, state)
    if compressor.is_linear:
        while True:
            prescaled = isinstance(compressor, FP16)
            data = list(payload.tensors.values())
            if prescaled:
                for t in data:
                    t.div_(ws)
            handles = [comm.all_reduce(t, "sum", async_op=True) for t in data]
            for h in handles:
                h.wait()
            if payload.final:
                break
            payload = compressor.advance(payload, state)
        if isinstance(compressor, NoCompression):  # the payload is the tensor itself
            if not prescaled:
                payload.tensors["data"].div_(ws)
            return tensor
        compressor.decompress(payload, state, tensor, alpha=1.0 if prescaled else 1.0 / ws)
        return tensor

    if not payload.final:
        raise InvalidArgumentError(f"{what}: a non-linear compressor with several rounds is not supported")
    packed, spec = _pack(payload)
    gathered = torch.empty(ws * packed.numel(), dtype=torch.uint8, device=packed.device)
    comm.all_gather(gathered, packed)
    seg = packed.numel()
    payloads = [_unpack(gathered[r * seg : (r + 1) * seg], spec, payload.numel) for r in range(ws)]
    compressor.decompress_sum(payloads, state, tensor, alpha=1.0 / ws)
    return tensor


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


def _quantize_shared(x: torch.Tensor, comm: Communicator, q: Quantize, state: CompressionState) -> None:
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
    comm.all_reduce(scales, "max")
    key = seed_key(q.step_seed(state)) if q.stochastic else 0
    codes = block_codes(blocks, scales, qmax, q.stochastic, key)
    mine = codes * scales[:, None]  # this rank's dequantized contribution
    if q.error_feedback:
        acc.sub_(mine.view(-1)[:n])  # the new residual, written over acc; the buffers swap roles
        state.tensors["residual"], state.work["acc"] = acc, r
    wire = codes.view(-1)[:n].to(quantize_codes_dtype(q.bits, ws))
    comm.all_reduce(wire, "sum")
    total = wire.view(-1).float()
    total = (torch.nn.functional.pad(total, (0, nb * block - n)) if n % block else total).view(nb, block)
    flat.copy_((total * (scales / ws)[:, None]).view(-1)[:n])
    state.step += 1


# -- sign, two phases --------------------------------------------------------------------------------------


def _sign_two_phase(x: torch.Tensor, comm: Communicator, c: Sign, state: CompressionState) -> None:
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
    comm.all_to_all(recv, send)

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
    comm.all_gather(gathered, mine)
    for d in range(ws):
        lo, hi = span(d)
        if hi == lo:
            continue
        base = d * seg_bytes
        sign_decompress(gathered[base : base + math.ceil((hi - lo) / 8)],
                        gathered[base + cb : base + seg_bytes].view(torch.float32), hi - lo, out=flat[lo:hi],
                        provider=c.provider)  # fmt: skip
    state.step += 1
