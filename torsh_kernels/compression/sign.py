"""1-bit signs with error feedback (EF-SignSGD), and the two-phase all-reduce that carries them.

The scheme is that of 1-bit Adam / DeepSpeed's compressed all-reduce. Each rank splits its
error-compensated tensor into ``world_size`` chunks and sign-compresses each (its own scale), an
all-to-all sends chunk ``d`` to rank ``d``, which averages the decompressed chunks, adds its *server*
residual and sign-compresses the average again (keeping the new server residual), and an all-gather
returns every chunk to every rank. Worker and server error feedback both live in the rank's state
(``residual`` and ``server_residual``).
"""

from __future__ import annotations

import math
from dataclasses import KW_ONLY, dataclass

import torch

from ..collectives.communicator import Communicator
from ..collectives.cost_model import Round
from ..errors import NonFiniteError
from ..ops import count_nonfinite, sign_compress, sign_decompress
from .base import (
    CompressionState,
    Compressor,
    Payload,
    Rounds,
    check_input,
    check_out,
    check_settings,
    lockstep,
    numel_of,
)

__all__ = ["Sign", "sign_chunk", "sign_segment_bytes"]


@dataclass(slots=True)
class Sign(Compressor):
    """1-bit signs plus one scale (mean |v|), with error feedback (EF-SignSGD)."""

    _: KW_ONLY
    error_feedback: bool = True
    """Keep v - scale * sign(v) in the state and add it to the next step's input."""
    check_finite: bool = True
    """Raise NonFiniteError on NaN/Inf input (before the residual changes)."""
    provider: str | None = None
    """Kernel provider (None: automatic)."""

    is_linear = False
    passes = 5.0

    def __post_init__(self) -> None:
        check_settings(self, "Sign")

    def compress(self, tensor, state):
        x = check_input(tensor, "Sign.compress")
        r = state.residual(x) if self.error_feedback else None
        bits, scale = sign_compress(x, r, check_finite=self.check_finite, provider=self.provider)
        state.step += 1
        return Payload({"bits": bits, "scale": scale.reshape(1)}, x.numel())

    def decompress(self, payload, state, out, *, alpha=1.0, accumulate=False):
        o = check_out(out, payload.numel, "Sign.decompress")
        t = payload.tensors
        sign_decompress(t["bits"], t["scale"], payload.numel, out=o, accumulate=accumulate, alpha=alpha,
                        provider=self.provider)  # fmt: skip
        return out

    def payload_nbytes(self, shape, dtype=torch.float32):
        return -(-numel_of(shape) // 8) + 4

    # -- on the wire ---------------------------------------------------------------------------------

    def schemes(self, shape, dtype, world_size):
        seg = sign_segment_bytes(numel_of(shape), world_size)
        return {"all_to_all+all_gather": (Round("all_to_all", world_size * seg), Round("all_gather", seg))}

    def reduce(self, tensors, states, comm: Communicator, *, link=None) -> tuple[Rounds, str]:
        return lockstep([_two_phase_rounds(t, comm, self, s) for t, s in zip(tensors, states)]), "two-phase sign"


def sign_chunk(numel: int, world_size: int) -> int:
    """Elements per server chunk of the two-phase sign all-reduce (a multiple of 32)."""
    per = -(-numel // world_size)
    return max(32, -(-per // 32) * 32)


def sign_segment_bytes(numel: int, world_size: int) -> int:
    """Bytes per destination in the two-phase sign all-reduce: a chunk's sign bits plus its fp32 scale."""
    return sign_chunk(numel, world_size) // 8 + 4


def _two_phase_rounds(x: torch.Tensor, comm: Communicator, c: Sign, state: CompressionState) -> Rounds:
    ws, me = comm.world_size, comm.rank
    flat = x.view(-1)
    n = flat.numel()
    chunk = sign_chunk(n, ws)
    cb = chunk // 8  # sign bytes of a full chunk (a multiple of 4, so the scale after it is aligned)
    seg_bytes = cb + 4
    # check once up front: the per-chunk calls below must not change state half-way
    if c.check_finite and (bad := int(count_nonfinite(flat))):
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
