"""What FSDP2's quantized comms send: the byte layout of one rank's payload (:class:`Wire`), the format of a
comm (:class:`QuantizedFormat`: bits and block) and :func:`~torsh_kernels.parallel.apply_quantized_comm`'s
settings as one value (:class:`QuantizedCommSpec`), whose signature ranks agree on before anything is
installed. See :mod:`torsh_kernels.parallel.fsdp`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..checks import check_bool, check_choice
from ..compression.names import QUANTIZED_FORMATS
from ..errors import InvalidArgumentError
from ..ops import dequantize, quantize
from ..specs import Spec

__all__ = ["FORMATS", "QuantizedCommSpec", "QuantizedFormat", "Wire", "encoded_nbytes"]

FORMATS = dict(QUANTIZED_FORMATS)
"""The formats of ``apply_quantized_comm(weights=, grads=)``, by name: bits per element ("int8": 8, "int4": 4;
the compressors' names, :data:`~torsh_kernels.compression.names.QUANTIZED_FORMATS`)."""


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

    def __post_init__(self) -> None:
        if isinstance(self.bits, bool) or self.bits not in (8, 4):
            raise InvalidArgumentError(f"QuantizedFormat: bits must be one of (8, 4), got {self.bits!r}")
        self.normalize("block", _check_block(self.block, "QuantizedFormat"))


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
        return None if name is None else QuantizedFormat(bits=FORMATS[name], block=self.block)


class Wire:
    """Where one rank's payload of ``n`` elements lies in its byte segment: codes, then fp32 scales at an
    8-byte aligned offset; segments are 8-byte multiples so every rank's scales stay aligned."""

    __slots__ = ("bits", "block", "n", "qbytes", "sc_off", "scales", "total")

    def __init__(self, n: int, bits: int, block: int) -> None:
        self.n, self.bits, self.block = n, bits, block
        self.qbytes = n if bits == 8 else (n + 1) // 2
        self.scales = -(-n // block)
        self.sc_off = -(-self.qbytes // 8) * 8
        self.total = -(-(self.sc_off + 4 * self.scales) // 8) * 8

    def views(self, seg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q = seg[: self.qbytes]
        if self.bits == 8:
            q = q.view(torch.int8)
        return q, seg[self.sc_off : self.sc_off + 4 * self.scales].view(torch.float32)

    def encode(self, x: torch.Tensor, seg: torch.Tensor) -> None:
        quantize(x, bits=self.bits, block=self.block, out=self.views(seg))

    def decode(self, seg: torch.Tensor, out: torch.Tensor, *, accumulate: bool = False, alpha: float = 1.0) -> None:
        q, sc = self.views(seg)
        dequantize(q, sc, block=self.block, numel=self.n, out=out, accumulate=accumulate, alpha=alpha)


def encoded_nbytes(numel: int, bits: int = 8, block: int = 256) -> int:
    """Bytes one rank's payload of ``numel`` elements takes on the wire (codes, scales, alignment)."""
    return Wire(numel, bits, block).total
