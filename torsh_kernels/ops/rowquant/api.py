"""The row ops of the compressed expert-parallel all-to-all: :func:`quantize_rows` (the fused permute + quantize
pass: rows gathered by an index and quantized, codes and scales packed in one byte row) and
:func:`dequantize_rows` (decode on arrival, optionally gathering rows in the same pass), their format
(:class:`RowQuantSpec`) and :func:`row_wire_bytes`.

A packed row of H channels in format ``fmt`` with scale tiles of ``block`` channels is ``row_wire_bytes(H)``
bytes: H one-byte codes, zero bytes up to a multiple of 4, then ``ceil(H / block)`` fp32 scales (native byte
order), so the scales travel in the same all-to-all as the codes. Each tile of ``block`` consecutive channels
(the row's last tile may be partial) has scale ``s = amax(|tile|) / qmax`` (fp32 divisions correctly rounded;
qmax 448 for e4m3, 57344 for e5m2, 127 for int8) and codes of ``x / s``: fp8 saturating and rounded to nearest
even, bit for bit torch's cast of the clamped value (``ops/quantize/fp8.py``), int8 rounded half to even and
clamped to +-127. A tile of zeros has s = 0 and codes 0; a tile holding NaN/Inf has s = NaN and codes 0, so it
decodes to NaN, as an uncompressed row would carry it (nothing raises: these are activations). Decoding is
``float(code) * s``, rounded once to the output dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...checks import check_choice, check_int
from ...errors import ArgumentTypeError, DeviceMismatchError, DTypeError, InvalidArgumentError, ShapeError
from ...specs import Spec
from .. import eager
from ..common import check_tensor, no_overlap
from ..registry import check_provider
from .providers import dequantize_rows_into, quantize_rows_into
from .reference import row_layout

__all__ = ["FORMATS", "RowQuantSpec", "dequantize_rows", "quantize_rows", "row_wire_bytes"]

FORMATS = ("e4m3", "e5m2", "int8")
"""The formats of a packed row."""
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_MAX_BLOCK = 1 << 16


@dataclass(frozen=True, kw_only=True, slots=True)
class RowQuantSpec(Spec):
    """How a row travels packed: one-byte codes and an fp32 scale per tile of ``block`` channels."""

    fmt: str = "e4m3"
    """"e4m3" (fp8, DeepSeek-V3's dispatch format), "e5m2" (fp8, wider range, one mantissa bit less) or "int8"."""
    block: int = 128
    """Channels per scale: a power of two in [2, 65536] (DeepSeek-V3: 128)."""

    def __post_init__(self) -> None:
        check_choice(self.fmt, "RowQuantSpec", "fmt", FORMATS)
        b = check_int(self.block, "RowQuantSpec", "block", 2, _MAX_BLOCK)
        if b & (b - 1):
            raise InvalidArgumentError(f"RowQuantSpec: block={b} must be a power of two in [2, {_MAX_BLOCK}]")
        self.normalize("block", b)


def row_wire_bytes(hidden: int, spec: RowQuantSpec | None = None, **fields) -> int:
    """Bytes of one packed row of ``hidden`` channels: codes padded to a multiple of 4, then the fp32 scales."""
    spec = RowQuantSpec.build(spec, fields, "torsh_kernels.row_wire_bytes")
    hidden = check_int(hidden, "torsh_kernels.row_wire_bytes", "hidden", 1)
    return row_layout(hidden, spec.block)[2]


# --------------------------------------------------------------------------------------------------
# Custom ops (torch.library): opaque to torch.compile, with fake implementations.


@torch.library.custom_op("torsh::quantize_rows", mutates_args=("packed",))
def quantize_rows_op(x: torch.Tensor, index: torch.Tensor | None, packed: torch.Tensor, fmt: str, block: int,
                     provider: str) -> None:  # fmt: skip
    quantize_rows_into(x, index, packed, fmt, block, provider)


@quantize_rows_op.register_fake
def _(x, index, packed, fmt, block, provider):
    return None


@torch.library.custom_op("torsh::dequantize_rows", mutates_args=("out",))
def dequantize_rows_op(packed: torch.Tensor, index: torch.Tensor | None, out: torch.Tensor, fmt: str, block: int,
                       provider: str) -> None:  # fmt: skip
    dequantize_rows_into(packed, index, out, fmt, block, provider)


@dequantize_rows_op.register_fake
def _(packed, index, out, fmt, block, provider):
    return None


# --------------------------------------------------------------------------------------------------
# Public API


def _check_index(index: object, rows: int, device: torch.device, what: str, of: str) -> torch.Tensor | None:
    """``index``: None, or a 1-D int64/int32 tensor on ``device`` of values in [-1, rows) (-1: a zero row)."""
    if index is None:
        return None
    index = check_tensor(index, what, "index")
    if index.dtype not in (torch.int64, torch.int32) or index.dim() != 1:
        raise DTypeError(f"{what}: index must be a 1-D int64 or int32 tensor, got {index.dtype} of shape "
                         f"{tuple(index.shape)}")  # fmt: skip
    if index.device != device:
        raise DeviceMismatchError(f"{what}: index is on {index.device}, {of} on {device}")
    if index.numel() and not eager.deferred(index):
        lo, hi = int(index.min()), int(index.max())
        if lo < -1 or hi >= rows:
            raise InvalidArgumentError(
                f"{what}: index holds {lo if lo < -1 else hi}, outside [-1, {rows}) ({of} has {rows} rows; -1 is a "
                "zero row)"
            )
    return index.long().contiguous()


def _check_out(out: object, shape: tuple[int, int], dtype: torch.dtype, device: torch.device, what: str):
    out = check_tensor(out, what, "out")
    if tuple(out.shape) != shape or out.dtype != dtype or not out.is_contiguous():
        raise ShapeError(f"{what}: out must be a contiguous {dtype} tensor of shape {shape}, got {out.dtype} "
                         f"{tuple(out.shape)}{'' if out.is_contiguous() else ' (strided)'}")  # fmt: skip
    if out.device != device:
        raise DeviceMismatchError(f"{what}: out is on {out.device}, the input on {device}")
    return out


def quantize_rows(
    x: torch.Tensor,
    spec: RowQuantSpec | None = None,
    *,
    index: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    provider: str | None = None,
    **fields,
) -> torch.Tensor:
    """Rows of ``x`` [T, H] (fp32, bf16 or fp16), packed (module docstring): uint8 [N, row_wire_bytes(H)].

    ``index`` (int64 or int32 [N], values in [-1, T)): row n is ``x[index[n]]``, -1 a row of zeros (a padding
    row): the permute of the MoE dispatch fused with the quantization, one pass. None: the rows of ``x``.
    ``spec`` or its fields as keywords (``fmt="int8"``); ``out``: a contiguous uint8 tensor of that shape."""
    what = "torsh_kernels.quantize_rows"
    spec = RowQuantSpec.build(spec, fields, what)
    check_provider(provider)
    x = check_tensor(x, what, "x")
    if x.dtype not in _DTYPES or x.dim() != 2 or x.shape[1] < 1:
        raise ShapeError(f"{what}: x must be a [T, H] float32, bfloat16 or float16 tensor with H >= 1, got "
                         f"{x.dtype} of shape {tuple(x.shape)}")  # fmt: skip
    idx = _check_index(index, x.shape[0], x.device, what, "x")
    N = x.shape[0] if idx is None else idx.numel()
    shape = (N, row_layout(x.shape[1], spec.block)[2])
    if out is None:
        out = torch.empty(shape, dtype=torch.uint8, device=x.device)
    else:
        out = _check_out(out, shape, torch.uint8, x.device, what)
        if not eager.deferred(x, out):
            no_overlap(out, x, what, "out", "x")
    if N:
        eager.call(quantize_rows_op, (2,), x.detach().contiguous(), idx, out, spec.fmt, spec.block, provider or "")
    return out


def dequantize_rows(
    packed: torch.Tensor,
    spec: RowQuantSpec | None = None,
    *,
    hidden: int,
    dtype: torch.dtype = torch.bfloat16,
    index: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    provider: str | None = None,
    **fields,
) -> torch.Tensor:
    """Packed rows decoded: ``dtype`` [N, hidden] (fp32, bf16 or fp16), row n the decoded row ``index[n]`` of
    ``packed`` (-1: zeros; None: row n), so a regroup on arrival is the same pass. ``hidden`` is the rows' width
    (``packed`` is uint8 [M, row_wire_bytes(hidden)])."""
    what = "torsh_kernels.dequantize_rows"
    spec = RowQuantSpec.build(spec, fields, what)
    check_provider(provider)
    hidden = check_int(hidden, what, "hidden", 1)
    packed = check_tensor(packed, what, "packed")
    rb = row_layout(hidden, spec.block)[2]
    if packed.dtype != torch.uint8 or packed.dim() != 2 or packed.shape[1] != rb:
        raise ShapeError(f"{what}: packed must be uint8 [M, {rb}] (rows of {hidden} channels in blocks of "
                         f"{spec.block}), got {packed.dtype} of shape {tuple(packed.shape)}")  # fmt: skip
    if not isinstance(dtype, torch.dtype) or dtype not in _DTYPES:
        raise (DTypeError if isinstance(dtype, torch.dtype) else ArgumentTypeError)(
            f"{what}: dtype must be torch.float32, torch.bfloat16 or torch.float16, got {dtype!r}"
        )
    idx = _check_index(index, packed.shape[0], packed.device, what, "packed")
    N = packed.shape[0] if idx is None else idx.numel()
    if out is None:
        out = torch.empty(N, hidden, dtype=dtype, device=packed.device)
    else:
        out = _check_out(out, (N, hidden), dtype, packed.device, what)
        if not eager.deferred(packed, out):
            no_overlap(out, packed, what, "out", "packed")
    if N:
        eager.call(dequantize_rows_op, (2,), packed.contiguous(), idx, out, spec.fmt, spec.block, provider or "")
    return out
