"""Blockwise absmax int8 / int4 quantization with error feedback, and its two ways over the wire.

- **all-gather** of every rank's (codes, scales), then one fused dequantize-sum (the default scheme of a
  non-linear compressor);
- **shared scale**: an all-reduce(max) of the per-block scales, every rank quantizes with the shared
  scales, the codes are summed exactly by an integer all-reduce (int8 where ``world_size * qmax <= 127``,
  else int32) and decoded once.

``Quantize(scheme=...)`` picks one; ``"auto"`` (the default) asks the cost model which moves fewer bytes
for this world size and link, per bucket. The scheme is a setting of the compressor like its bits: it is
part of ``signature()``, so ranks agree on it with the rest (it once travelled beside the compressor as
the hook's, the synchronizer's and ``compressed_all_reduce``'s ``quantize_mode``: see
:func:`apply_quantize_mode`). Both give the mean of the ranks' dequantized contributions (with the shared scale, each
contribution is quantized on a coarser common grid). Give each rank a different seed
(``new_state(seed=rank)``) when stochastic rounding is used, so the ranks' rounding noise is independent.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import KW_ONLY, dataclass

import torch
import torch.nn.functional as F

from ..checks import check_bool, check_choice, check_int
from ..collectives.communicator import Communicator
from ..collectives.cost_model import Link, Round, Topology, rounds_time
from ..errors import InvalidArgumentError, NonFiniteError
from ..ops import QMAX, block_codes, count_nonfinite, dequantize, quantize, residual_add, seed_key
from .base import (
    CompressionState,
    Compressor,
    Payload,
    Rounds,
    check_input,
    check_out,
    check_settings,
    gathered_rounds,
    itemsize,
    lockstep,
    numel_of,
)

__all__ = ["SCHEMES", "Quantize", "apply_quantize_mode", "quantize_codes_dtype", "quantize_shared_scale_cheaper"]

SCHEMES = ("auto", "all_gather", "shared_scale")
"""What ``Quantize(scheme=...)`` may ask for."""

_ROUNDS = {"all_gather": "all_gather", "shared_scale": "shared_scale_all_reduce"}  # scheme -> schemes() key


@dataclass(slots=True)
class Quantize(Compressor):
    """Blockwise absmax int8 / int4 quantization, optionally stochastic, with error feedback."""

    bits: int = 8
    """8 or 4 bits per element (int4 packed two per byte)."""
    block: int = 256
    """Elements per scale (a power of two)."""
    stochastic: bool = False
    """Stochastic rounding (unbiased), noise from the state's seed and step."""
    _: KW_ONLY
    scheme: str = "auto"
    """How the payload travels: "all_gather" of (codes, scales), "shared_scale" (an all-reduce of the scales,
    then an integer all-reduce of the codes), or "auto": the one the cost model prices cheaper per bucket."""
    error_feedback: bool = True
    """Keep the quantization error in the state and add it to the next step's input."""
    check_finite: bool = True
    """Raise NonFiniteError on NaN/Inf input (before the residual changes)."""
    provider: str | None = None
    """Kernel provider (None: automatic)."""

    is_linear = False
    passes = 5.0

    def __post_init__(self) -> None:
        self.bits = check_int(self.bits, "Quantize", "bits", 1)
        if self.bits not in (8, 4):
            raise InvalidArgumentError(f"Quantize: bits must be 8 or 4, got {self.bits!r}")
        self.block = check_int(self.block, "Quantize", "block", 2)
        if self.block & (self.block - 1) or self.block > 1 << 30:
            raise InvalidArgumentError(f"Quantize: block must be a power of two in [2, 2**30], got {self.block!r}")
        check_bool(self.stochastic, "Quantize", "stochastic")
        check_choice(self.scheme, "Quantize", "scheme", SCHEMES)
        check_settings(self, "Quantize")

    def step_seed(self, state: CompressionState) -> int:
        """The stochastic-rounding seed of this step: from the state's seed and step count."""
        return (state.seed * 0x9E3779B97F4A7C15 + state.step) & 0xFFFFFFFFFFFFFFFF

    def compress(self, tensor, state):
        x = check_input(tensor, "Quantize.compress")
        seed = self.step_seed(state) if self.stochastic else None
        if not self.error_feedback:
            q, s = quantize(x, bits=self.bits, block=self.block, stochastic=self.stochastic, seed=seed,
                            check_finite=self.check_finite, provider=self.provider)  # fmt: skip
        else:
            r = state.residual(x)
            acc = state.buffer("acc", x.numel(), x.device)
            residual_add(x, r, out=acc, check_finite=self.check_finite, provider=self.provider)
            q, s = quantize(acc, bits=self.bits, block=self.block, stochastic=self.stochastic, seed=seed,
                            check_finite=False, provider=self.provider)  # fmt: skip
            # acc - dequantized = the new residual, written over acc; then the buffers swap roles
            dequantize(q, s, block=self.block, numel=x.numel(), out=acc, accumulate=True, alpha=-1.0,
                       provider=self.provider)  # fmt: skip
            state.tensors["residual"], state.work["acc"] = acc, r
        state.step += 1
        return Payload({"q": q, "scales": s}, x.numel())

    def decompress(self, payload, state, out, *, alpha=1.0, accumulate=False):
        o = check_out(out, payload.numel, "Quantize.decompress")
        t = payload.tensors
        dequantize(t["q"], t["scales"], block=self.block, numel=payload.numel, out=o, accumulate=accumulate,
                   alpha=alpha, provider=self.provider)  # fmt: skip
        return out

    def payload_nbytes(self, shape, dtype=torch.float32):
        numel = numel_of(shape)
        codes = numel if self.bits == 8 else -(-numel // 2)
        return codes + 4 * -(-numel // self.block)

    # -- on the wire ---------------------------------------------------------------------------------

    def schemes(self, shape, dtype, world_size):
        numel = numel_of(shape)
        codes = numel * itemsize(quantize_codes_dtype(self.bits, world_size))
        ways = {
            "all_gather": (Round("all_gather", self.payload_nbytes(numel, dtype)),),
            "shared_scale_all_reduce": (Round("all_reduce", 4 * -(-numel // self.block)), Round("all_reduce", codes)),
        }
        return ways if self.scheme == "auto" else {_ROUNDS[self.scheme]: ways[_ROUNDS[self.scheme]]}

    def reduce(self, tensors, states, comm: Communicator, *, link=None) -> tuple[Rounds, str]:
        shared = self.scheme == "shared_scale"
        if self.scheme == "auto":
            shared = quantize_shared_scale_cheaper(max(t.numel() for t in tensors), self, comm.world_size, link)
        if shared:
            return lockstep([_shared_scale_rounds(t, comm, self, s) for t, s in zip(tensors, states)]), \
                "shared-scale all_reduce"  # fmt: skip
        return gathered_rounds(tensors, states, comm, self), "all_gather"


def apply_quantize_mode(compressor: object, quantize_mode: str, what: str) -> object:
    """The compressor that the deprecated ``quantize_mode=`` keyword (of the DDP hook, the synchronizer and
    ``compressed_all_reduce``) asks for: a :class:`Quantize` with that ``scheme`` (its own "auto" replaced;
    another scheme of its own that differs is an error, not overridden), anything else unchanged (the mode
    only ever applied to Quantize). "auto" changes nothing. Warns with FutureWarning whatever the value."""
    import warnings

    warnings.warn(
        f"{what}: quantize_mode= is deprecated and will be removed; the scheme is a setting of the compressor: "
        "pass Quantize(..., scheme='all_gather' | 'shared_scale' | 'auto')",
        FutureWarning,
        stacklevel=3,
    )
    mode = check_choice(quantize_mode, what, "quantize_mode", SCHEMES)
    if mode == "auto" or not isinstance(compressor, Quantize) or compressor.scheme == mode:
        return compressor
    if compressor.scheme != "auto":
        raise InvalidArgumentError(
            f"{what}: quantize_mode={mode!r} and the compressor's own scheme={compressor.scheme!r} disagree; "
            "drop quantize_mode (deprecated) and set Quantize(scheme=...) alone"
        )
    return dataclasses.replace(compressor, scheme=mode)


def quantize_codes_dtype(bits: int, world_size: int) -> torch.dtype:
    """Narrowest integer dtype both gloo and NCCL reduce that holds the sum of ``world_size`` codes."""
    return torch.int8 if QMAX[bits] * world_size <= 127 else torch.int32


def quantize_shared_scale_cheaper(numel: int, q: Quantize, world_size: int, link: Link | None = None) -> bool:
    """Whether the shared-scale integer all-reduce beats the all-gather of (codes, scales) for a
    quantized all-reduce of ``numel`` elements over ``world_size`` ranks (alpha-beta model, a flat
    topology, a 10 Gbit/s link unless one is given). Asked on every bucket of every step in
    ``scheme="auto"``, so the answer is cached per (bits, block, numel, world size, link)."""
    return _shared_scale_cheaper(q.bits, q.block, numel, world_size, link or Link.gbit(10))


@functools.lru_cache(maxsize=4096)
def _shared_scale_cheaper(bits: int, block: int, numel: int, world_size: int, link: Link) -> bool:
    topo = Topology(world_size=world_size)
    schemes = Quantize(bits, block).schemes(numel, torch.float32, world_size)
    shared = rounds_time(schemes["shared_scale_all_reduce"], topo, link)[1]
    return shared < rounds_time(schemes["all_gather"], topo, link)[1]


def _shared_scale_rounds(x: torch.Tensor, comm: Communicator, q: Quantize, state: CompressionState) -> Rounds:
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
        if q.check_finite and (bad := int(count_nonfinite(acc))):
            raise NonFiniteError(
                f"compressed_all_reduce (Quantize): {bad} non-finite element(s) (NaN/Inf) in the tensor"
            )
    padded = F.pad(acc, (0, nb * block - n)) if n % block else acc
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
    total = (F.pad(total, (0, nb * block - n)) if n % block else total).view(nb, block)
    flat.copy_((total * (scales / ws)[:, None]).view(-1)[:n])
    state.step += 1
