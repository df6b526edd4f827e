"""What FSDP2's quantized comms send: the byte layout of one rank's payload (:class:`Wire`), the format of a
comm (:class:`QuantizedFormat`: bits and block) and :func:`~torsh_kernels.parallel.apply_quantized_comm`'s
settings as one value (:class:`QuantizedCommSpec`), whose signature ranks agree on before anything is
installed. See :mod:`torsh_kernels.parallel.fsdp`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..checks import check_bool, check_choice
from ..compression.names import QUANTIZED_FORMATS
from ..errors import InvalidArgumentError, NonFiniteError
from ..ops import count_nonfinite, dequantize, dequantize_rows, quantize, quantize_rows
from ..ops.rowquant import RowQuantSpec
from ..specs import Spec

__all__ = ["FORMATS", "FP8_NAMES", "QuantizedCommSpec", "QuantizedFormat", "Wire", "encoded_nbytes"]

FP8_NAMES = {"fp8": "e4m3", "fp8:e4m3": "e4m3", "fp8:e5m2": "e5m2"}
"""The fp8 formats' names (the FP8 compressor's: ``"fp8"`` is e4m3) and the fp8 encoding each stands for."""
FORMATS = {**QUANTIZED_FORMATS, **dict.fromkeys(FP8_NAMES, 8)}
"""The formats of ``apply_quantized_comm(weights=, grads=)``, by name: bits per element ("int8": 8, "int4": 4;
the compressors' names, :data:`~torsh_kernels.compression.names.QUANTIZED_FORMATS`; "fp8", "fp8:e4m3",
"fp8:e5m2": 8, one-byte fp8 codes, :data:`FP8_NAMES`)."""
CODES = ("int", "e4m3", "e5m2")
"""``QuantizedFormat.fmt``: integer codes, or fp8 codes of that encoding."""


def _check_block(block: object, what: str) -> int:
    if isinstance(block, bool) or not isinstance(block, int) or block < 2 or block & (block - 1):
        raise InvalidArgumentError(f"{what}: block must be a power of two >= 2, got {block!r}")
    return block


@dataclass(frozen=True, kw_only=True, slots=True)
class QuantizedFormat(Spec):
    """How one comm quantizes: blockwise absmax, ``bits`` per element, one fp32 scale per ``block``."""

    bits: int = 8
    """8, or 4 (packed two per byte)."""
    block: int = 256
    """Elements per scale, a power of two >= 2."""
    fmt: str = "int"
    """"int" (integer codes, absmax / qmax scales) or "e4m3" / "e5m2" (fp8 codes, 8 bits, at most 65536-element
    blocks; the ``FP8`` compressor's encoding)."""

    def __post_init__(self) -> None:
        if isinstance(self.bits, bool) or self.bits not in (8, 4):
            raise InvalidArgumentError(f"QuantizedFormat: bits must be one of (8, 4), got {self.bits!r}")
        self.normalize("block", _check_block(self.block, "QuantizedFormat"))
        check_choice(self.fmt, "QuantizedFormat", "fmt", CODES)
        if self.fmt != "int" and (self.bits != 8 or self.block > 1 << 16):
            raise InvalidArgumentError(
                f"QuantizedFormat: fp8 codes ({self.fmt}) are 8 bits in blocks of at most 65536, got bits={self.bits}, "
                f"block={self.block}"
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class QuantizedCommSpec(Spec):
    """:func:`~torsh_kernels.parallel.apply_quantized_comm`'s settings."""

    weights: str | None = "int8"
    """The all-gather's format: "int8", "int4" or None (FSDP2's own all-gather)."""
    grads: str | None = "int8"
    """The reduce-scatter's format: "int8", "int4" or None (FSDP2's own reduce-scatter)."""
    block: int = 256
    """Elements per scale, a power of two >= 2."""
    error_feedback: bool = True
    """Keep what quantizing the gradients lost in a residual buffer of each FSDP module, added next step."""

    def __post_init__(self) -> None:
        what = "QuantizedCommSpec"
        for name in ("weights", "grads"):
            v = getattr(self, name)
            if v is not None:
                check_choice(v, what, name, tuple(FORMATS))
        self.normalize("block", _check_block(self.block, what))
        check_bool(self.error_feedback, what, "error_feedback")

    def format(self, which: str) -> QuantizedFormat | None:
        """The format of the ``"weights"`` or ``"grads"`` comm (None: FSDP2's own)."""
        name = getattr(self, which)
        if name is None:
            return None
        return QuantizedFormat(bits=FORMATS[name], block=self.block, fmt=FP8_NAMES.get(name, "int"))


class Wire:
    """Where one rank's payload of ``n`` elements lies in its byte segment: codes, then fp32 scales at an
    8-byte aligned offset; segments are 8-byte multiples so every rank's scales stay aligned. fp8 (``fmt``
    "e4m3" / "e5m2"): ``ceil(n / block)`` packed rows of :func:`~torsh_kernels.ops.quantize_rows` (``block``
    codes, then the block's scale; the last row zero-padded), as the ``FP8`` compressor sends them."""

    __slots__ = ("bits", "block", "fmt", "n", "qbytes", "sc_off", "scales", "total")

    def __init__(self, n: int, bits: int, block: int, fmt: str = "int") -> None:
        self.n, self.bits, self.block, self.fmt = n, bits, block, fmt
        self.qbytes = n if bits == 8 else (n + 1) // 2
        self.scales = -(-n // block)
        if fmt != "int":  # packed rows: block codes and one scale each
            self.qbytes = self.sc_off = self.scales * (block + 4)
            self.total = -(-self.qbytes // 8) * 8
            return
        self.sc_off = -(-self.qbytes // 8) * 8
        self.total = -(-(self.sc_off + 4 * self.scales) // 8) * 8

    def _rows(self, seg: torch.Tensor) -> torch.Tensor:
        return seg[: self.qbytes].view(self.scales, self.block + 4)

    def views(self, seg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q = seg[: self.qbytes]
        if self.bits == 8:
            q = q.view(torch.int8)
        return q, seg[self.sc_off : self.sc_off + 4 * self.scales].view(torch.float32)

    def encode(self, x: torch.Tensor, seg: torch.Tensor) -> None:
        if self.fmt == "int":
            quantize(x, bits=self.bits, block=self.block, out=self.views(seg))
            return
        if bad := int(count_nonfinite(x)):  # (quantize's check_finite: raised before anything is sent)
            raise NonFiniteError(f"torsh_kernels.quantize_rows: {bad} non-finite element(s) (NaN/Inf) in x")
        v = x.reshape(-1)
        pad = self.scales * self.block - self.n
        v = torch.nn.functional.pad(v.float(), (0, pad)) if pad else v
        quantize_rows(v.view(self.scales, self.block), RowQuantSpec(fmt=self.fmt, block=self.block),
                      out=self._rows(seg))  # fmt: skip

    def decode(self, seg: torch.Tensor, out: torch.Tensor, *, accumulate: bool = False, alpha: float = 1.0) -> None:
        if self.fmt != "int":
            v = dequantize_rows(self._rows(seg), RowQuantSpec(fmt=self.fmt, block=self.block), hidden=self.block,
                                dtype=torch.float32).view(-1)[: self.n]  # fmt: skip
            if alpha != 1.0:
                v.mul_(alpha)
            o = out.view(-1)
            if accumulate:
                v.add_(o)
            o.copy_(v)
            return
        q, sc = self.views(seg)
        dequantize(q, sc, block=self.block, numel=self.n, out=out, accumulate=accumulate, alpha=alpha)


def encoded_nbytes(numel: int, bits: int = 8, block: int = 256, fmt: str = "int") -> int:
    """Bytes one rank's payload of ``numel`` elements takes on the wire (codes, scales, alignment)."""
    return Wire(numel, bits, block, fmt).total
