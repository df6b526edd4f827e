"""Blockwise FP8 (e4m3 or e5m2) with error feedback: :class:`FP8`.

Each block of ``block`` elements is sent as one-byte fp8 codes of ``x / s`` and an fp32 scale
``s = absmax / max`` (448 for e4m3, 57344 for e5m2): saturating, rounded to nearest even, bit for bit torch's
cast of the clamped value (``ops/quantize/fp8.py``). On the wire a block is one packed row of
:func:`~torsh_kernels.ops.quantize_rows` (codes, then the scale), so a tensor of n elements is
``ceil(n / block) * (block + 4)`` bytes (128-element blocks: 1.03 bytes per element, 26% of fp32, 52% of
bf16). Not linear (codes of different scales do not add): every rank's packed rows are all-gathered and one
fused decode-sum runs per rank (``compression.base.gathered_rounds``).

Against int8 at the same block: the same bytes; e4m3 keeps ~2**-4 relative error on *every* element (a
floating-point grid), where int8's error is up to half a step of the block's absmax, so an element 100x smaller
than its block's largest keeps 2 significant bits in int8 and 4 in e4m3. e5m2 trades a mantissa bit for range:
its smallest nonzero code is 2**-16 / 57344 = 2.7e-10 of the block's largest (e4m3: 2**-9 / 448 = 4.4e-6). With
error feedback (the default) what rounding loses is carried to the next step, as for int8.
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass

import torch
import torch.nn.functional as F

from ..checks import check_choice, check_int
from ..errors import InvalidArgumentError
from ..ops import dequantize_rows, quantize_rows, residual_add
from ..ops.rowquant import RowQuantSpec
from .base import (
    CompressionState,
    Compressor,
    Payload,
    check_input,
    check_out,
    check_settings,
    numel_of,
    raise_if_nonfinite,
)

__all__ = ["FP8", "FP8_FORMATS"]

FP8_FORMATS = ("e4m3", "e5m2")
"""``FP8(fmt=...)``."""


@dataclass(slots=True)
class FP8(Compressor):
    """Blockwise absmax FP8 (e4m3 or e5m2), with error feedback."""

    fmt: str = "e4m3"
    """"e4m3" (3 mantissa bits, largest 448) or "e5m2" (2 mantissa bits, largest 57344)."""
    block: int = 128
    """Elements per scale, a power of two in [2, 65536] (DeepSeek-V3's tiles: 128)."""
    _: KW_ONLY
    error_feedback: bool = True
    """Keep the rounding error in the state and add it to the next step's input."""
    check_finite: bool = True
    """Raise NonFiniteError on NaN/Inf input (before the residual changes)."""
    provider: str | None = None
    """Kernel provider (None: automatic)."""

    is_linear = False
    passes = 5.0

    def __post_init__(self) -> None:
        check_choice(self.fmt, "FP8", "fmt", FP8_FORMATS)
        self.block = check_int(self.block, "FP8", "block", 2, 1 << 16)
        if self.block & (self.block - 1):
            raise InvalidArgumentError(f"FP8: block must be a power of two in [2, 65536], got {self.block!r}")
        check_settings(self, "FP8")

    @property
    def spec(self) -> RowQuantSpec:
        return RowQuantSpec(fmt=self.fmt, block=self.block)

    def _rows(self, v: torch.Tensor) -> torch.Tensor:
        """fp32 ``v`` as [ceil(n / block), block] (the last row padded with zeros)."""
        n = v.numel()
        pad = -n % self.block
        return (F.pad(v, (0, pad)) if pad else v).view(-1, self.block)

    def _decode(self, packed: torch.Tensor, n: int) -> torch.Tensor:
        return dequantize_rows(packed, self.spec, hidden=self.block, dtype=torch.float32,
                               provider=self.provider).view(-1)[:n]  # fmt: skip

    def compress(self, tensor: torch.Tensor, state: CompressionState) -> Payload:
        x = check_input(tensor, "FP8.compress")
        n = x.numel()
        if self.error_feedback:
            r = state.residual(x)
            acc = state.buffer("acc", n, x.device)
            residual_add(x, r, out=acc, check_finite=self.check_finite, provider=self.provider)
        else:
            acc = x.float()
            if self.check_finite:
                raise_if_nonfinite(acc, "FP8.compress")
        packed = quantize_rows(self._rows(acc), self.spec, provider=self.provider)
        if self.error_feedback:
            acc.sub_(self._decode(packed, n))  # the new residual, written over acc; the buffers swap roles
            state.tensors["residual"], state.work["acc"] = acc, r
        state.step += 1
        return Payload({"rows": packed}, n)

    def decompress(self, payload, state, out, *, alpha=1.0, accumulate=False):
        o = check_out(out, payload.numel, "FP8.decompress")
        v = self._decode(payload.tensors["rows"], payload.numel)
        if alpha != 1.0:
            v = v * alpha
        if accumulate:
            v = o.float() + v
        o.copy_(v)
        return out

    def decompress_sum(self, payloads, state, out, *, alpha=1.0):
        """``out = alpha * sum`` of the ranks' decoded payloads, summed in fp32 and rounded once."""
        if not payloads:
            raise InvalidArgumentError("FP8.decompress_sum: no payloads")
        o = check_out(out, payloads[0].numel, "FP8.decompress_sum")
        rows = torch.cat([p.tensors["rows"] for p in payloads]) if len(payloads) > 1 else payloads[0].tensors["rows"]
        dec = dequantize_rows(rows, self.spec, hidden=self.block, dtype=torch.float32, provider=self.provider)
        total = dec.view(len(payloads), -1)[:, : o.numel()].sum(0)
        o.copy_(total.mul_(alpha) if alpha != 1.0 else total)
        return out

    def payload_nbytes(self, shape, dtype=torch.float32):
        return -(-numel_of(shape) // self.block) * (self.block + 4)
