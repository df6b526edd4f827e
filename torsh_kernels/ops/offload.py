"""Offload packing: convert a tensor to a compact format in one fused pass, into a (pinned) host buffer.

- ``pack(x, fmt="bf16"|"fp16"|"int8", out=, block=256, stream=)`` -> :class:`Packed`. One pass over
  ``x`` converts it: fp16/bf16 by a rounding cast (round to nearest even, as PyTorch's ``.to()``);
  int8 by blockwise absmax (``scale = absmax / 127`` per ``block`` elements, codes ``round(x / scale)``
  to nearest even; error per element at most ``scale / 2`` plus fp32 rounding). The packed bytes are
  one uint8 buffer: the codes, then (int8) the fp32 scales beside them, starting at a 16-byte
  boundary. ``out`` is a preallocated uint8 buffer of at least :func:`packed_nbytes` bytes, on any
  device: typically pinned host memory. When ``out`` is on another device than ``x`` (CUDA ``x``, host
  ``out``), the kernel packs into a device staging buffer and the packed bytes, not the full-precision
  ones, cross the bus in one asynchronous copy on ``stream`` (default: the current stream); the host
  buffer is complete when that stream reaches this point (``stream.synchronize()``).
- ``unpack(packed, out=, accumulate=, device=, dtype=, stream=)`` reverses it into a tensor of the
  original shape (by default of the original dtype, on the packed buffer's device or ``device``), or
  adds it to ``out``. Packed bytes on another device are copied over first (asynchronously on CUDA).
- ``Packed.compression_ratio``: source bytes / packed bytes (2 for fp32 -> bf16, about 3.9 for fp32 ->
  int8 with 256-element blocks).

The kernels are the bucket family's fused cast (fp16/bf16; ``flatten``/``unflatten``) and the
quantization family's blockwise quantizer (int8; ``quantize``/``dequantize``), so each format has Triton,
Numba CUDA and torch providers. fp16 holds magnitudes up to 65504: a finite value beyond it would
become inf, which ``check_finite`` refuses (as it refuses NaN/Inf for int8, where one would spoil its
whole block); fp16/bf16 carry NaN and Inf through unchanged.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from ..checks import check_int
from ..errors import (
    ArgumentTypeError,
    DTypeError,
    InvalidArgumentError,
    NonFiniteError,
    ShapeError,
)
from . import eager
from .bucket import BucketLayout, flatten, unflatten
from .bucket.providers import TORCH_IMPL, flatten_impl
from .common import Sealable, check_strided, no_overlap
from .quantize import dequantize, quantize
from .registry import check_provider

__all__ = ["FORMATS", "Packed", "pack", "pack_ref", "packed_nbytes", "unpack", "unpack_ref"]

FORMATS = ("fp16", "bf16", "int8")
SOURCE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_CODE_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "int8": torch.int8}
_ALIGN = 16
FP16_MAX = 65504.0
MAX_BLOCK = 65536
"""The largest int8 block (elements per scale), as for :func:`quantize`."""


def _layout(numel: int, fmt: str, block: int) -> tuple[int, int]:
    """(offset of the scales, total bytes) of a packed buffer."""
    if fmt == "int8":
        off = -(-numel // _ALIGN) * _ALIGN
        return off, off + 4 * (-(-numel // block))
    return 2 * numel, 2 * numel


def packed_nbytes(numel: int, fmt: str, block: int = 256) -> int:
    """Bytes a packed tensor of ``numel`` elements occupies (the size ``pack``'s ``out`` needs)."""
    what = "torsh_kernels.packed_nbytes"
    numel = check_int(numel, what, "numel", 0)
    _check_fmt(fmt, what)
    return _layout(numel, fmt, _check_block(block, what))[1]


@dataclass(frozen=True, slots=True, kw_only=True)
class Packed(Sealable):
    """A packed tensor: the bytes and what is needed to unpack them."""

    data: torch.Tensor
    """uint8 buffer (at least ``nbytes``): the codes, then for int8 the fp32 scales at a 16-byte boundary."""
    fmt: str
    """"fp16", "bf16" or "int8"."""
    shape: tuple[int, ...]
    """Shape of the source tensor."""
    dtype: torch.dtype
    """dtype of the source tensor (what ``unpack`` returns by default)."""
    block: int
    """int8: elements per scale."""

    @property
    def numel(self) -> int:
        """Elements of the source tensor."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of ``data`` in use."""
        return _layout(self.numel, self.fmt, self.block)[1]

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def codes(self) -> torch.Tensor:
        """The codes: fp16/bf16 values or int8 codes, [numel]."""
        n = self.numel
        width = 1 if self.fmt == "int8" else 2
        return self.data[: n * width].view(_CODE_DTYPES[self.fmt])

    @property
    def scales(self) -> torch.Tensor | None:
        """int8: the fp32 scale of each block; None for fp16/bf16."""
        if self.fmt != "int8":
            return None
        off, end = _layout(self.numel, "int8", self.block)
        return self.data[off:end].view(torch.float32)

    @property
    def compression_ratio(self) -> float:
        """Source bytes / packed bytes."""
        return self.numel * self.dtype.itemsize / max(self.nbytes, 1)


def _check_device(device: object, what: str) -> torch.device:
    if not isinstance(device, (str, torch.device)):
        raise ArgumentTypeError(f"{what}: device must be a torch.device or a str, got {type(device).__name__}")
    try:
        return torch.device(device)
    except (RuntimeError, ValueError) as e:
        raise InvalidArgumentError(f"{what}: device={device!r} is not a device torch knows ({e})") from None


def _check_fmt(fmt: object, what: str) -> str:
    if fmt not in FORMATS:
        raise InvalidArgumentError(f"{what}: fmt={fmt!r}; expected one of {', '.join(map(repr, FORMATS))}")
    return fmt  # type: ignore[return-value]


def _check_block(block: object, what: str) -> int:
    if isinstance(block, bool) or not isinstance(block, int):
        raise ArgumentTypeError(f"{what}: block must be an int (a power of two), got {type(block).__name__}")
    if block < 2 or block > MAX_BLOCK or block & (block - 1):
        raise InvalidArgumentError(
            f"{what}: block={block} must be a power of two in [2, {MAX_BLOCK}] (256 is the default)"
        )
    return block


def _check_packed(packed: object, what: str) -> Packed:
    """A :class:`Packed` whose fields agree: a contiguous 1-D uint8 ``data`` of at least ``nbytes`` bytes (so
    the codes and scales views stay inside it), a known format and source dtype, a valid block and shape."""
    if not isinstance(packed, Packed):
        raise ArgumentTypeError(f"{what}: packed must be a Packed (from pack), got {type(packed).__name__}")
    try:  # one pack made, its buffer as it was: its fields agree (pack checked what went in)
        seal = packed._seal
        if seal[0] is packed.data and seal[1] == packed.data.numel():
            return packed
    except AttributeError:
        pass
    _check_fmt(packed.fmt, what)
    _check_block(packed.block, what)
    shape = packed.shape
    if type(shape) is not tuple or not all(type(d) is int and d >= 0 for d in shape):
        raise ShapeError(f"{what}: packed.shape must be a tuple of non-negative ints, got {shape!r}")
    if packed.dtype not in SOURCE_DTYPES:
        raise DTypeError(f"{what}: packed.dtype is {packed.dtype}; expected float32, float16 or bfloat16")
    data = packed.data
    if not isinstance(data, torch.Tensor):
        raise ArgumentTypeError(f"{what}: packed.data must be a torch.Tensor, got {type(data).__name__}")
    if data.dtype != torch.uint8 or data.dim() != 1 or not data.is_contiguous():
        raise ShapeError(f"{what}: packed.data must be a contiguous 1-D uint8 buffer, got {data.dtype} "
                         f"{tuple(data.shape)}")  # fmt: skip
    if data.numel() < packed.nbytes:
        raise ShapeError(
            f"{what}: packed.data holds {data.numel()} bytes; {math.prod(shape)} elements in {packed.fmt} need "
            f"{packed.nbytes}. Pass the Packed that pack returned"
        )
    return packed


def _stream_ctx(stream: object, devices: tuple[torch.device, ...], what: str):
    if stream is None:
        return nullcontext()
    if not isinstance(stream, torch.cuda.Stream):
        raise ArgumentTypeError(f"{what}: stream must be a torch.cuda.Stream or None, got {type(stream).__name__}")
    if not any(d.type == "cuda" for d in devices):
        raise InvalidArgumentError(f"{what}: a CUDA stream was given but no tensor involved is on a CUDA device")
    return torch.cuda.stream(stream)


def _check_buffer(out: object, nbytes: int, what: str, name: str, x: torch.Tensor | None = None) -> torch.Tensor:
    """``out`` as a buffer for ``nbytes`` packed bytes, sharing no memory with ``x`` (the source)."""
    if not isinstance(out, torch.Tensor):
        raise ArgumentTypeError(f"{what}: {name} must be a torch.Tensor, got {type(out).__name__}")
    if out.dtype != torch.uint8 or out.dim() != 1 or not out.is_contiguous():
        raise ShapeError(f"{what}: {name} must be a contiguous 1-D uint8 buffer, got {out.dtype} {tuple(out.shape)}")
    if out.numel() < nbytes:
        raise ShapeError(
            f"{what}: {name} holds {out.numel()} bytes but the packed tensor needs {nbytes}; allocate "
            f"packed_nbytes(numel, fmt, block) = {nbytes} bytes (pinned where CUDA is: torch.empty({nbytes}, "
            "dtype=torch.uint8, pin_memory=torch.cuda.is_available()))"
        )
    # (while torch.compile traces there are no addresses: the views of the codes and the scales as their own
    # dtypes, which need their storage offsets to be whole elements, are the check then; meta: no address)
    if not eager.deferred(out):
        if out.data_ptr() % 4:
            raise ShapeError(f"{what}: {name} must start at a 4-byte aligned address (the scales are fp32)")
        if x is not None and x.device == out.device and not x.is_meta:
            no_overlap(out[:nbytes], x, what, name, "x")
    return out


def _check_fp16_range(x: torch.Tensor, what: str) -> None:
    """No finite magnitude of ``x`` beyond fp16's largest (it would become inf): NonFiniteError."""
    lo, hi = torch.aminmax(x)  # one pass, no temporary
    amax = max(-float(lo), float(hi))
    if math.isnan(amax):  # NaN hides the finite extremes: look again without NaN and Inf
        amax = float(torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0).abs().max())
    if math.isfinite(amax) and amax > FP16_MAX:
        raise NonFiniteError(
            f"{what}: x holds a finite magnitude of {amax:.6g}, beyond fp16's largest {FP16_MAX:g}; it "
            "would become inf. Use fmt='bf16' (fp32's range) or pass check_finite=False"
        )


def _cast_into(x: torch.Tensor, codes: torch.Tensor, provider: str | None) -> None:
    """``codes`` (fp16/bf16, 1-D) = ``x`` rounded to nearest even."""
    if _torch_path(x, provider):  # one cast-copy, without the bucket op's per-call overhead
        codes.copy_(x.reshape(-1))
    else:
        flatten([x], out=codes, provider=provider)


@torch.library.custom_op("torsh::pack_cast", mutates_args=("codes",))
def _pack_cast_op(x: torch.Tensor, codes: torch.Tensor, check_range: bool, provider: str) -> None:
    """A traced pack's fp16/bf16 cast, with (``check_range``) the fp16 range check that reads x's values."""
    if check_range:
        _check_fp16_range(x, "torsh_kernels.pack")
    _cast_into(x, codes, provider or None)


@_pack_cast_op.register_fake
def _(x, codes, check_range, provider):
    return None


def _torch_path(t: torch.Tensor, provider: str | None) -> bool:
    """Whether the cast runs with the torch implementation (the torch provider, or the cpu provider, whose
    bucket ops are torch's): then as one torch copy."""
    return flatten_impl.select(t.device, t.dtype, t.numel(), provider or None) in TORCH_IMPL


def pack(
    x: torch.Tensor,
    fmt: str = "bf16",
    *,
    out: torch.Tensor | None = None,
    block: int = 256,
    stream: torch.cuda.Stream | None = None,
    check_finite: bool = True,
    provider: str | None = None,
) -> Packed:
    """Pack ``x`` (fp32, fp16 or bf16, any shape and strides) into ``fmt`` (see the module docstring)."""
    if (
        out is None and stream is None and (fmt == "bf16" or (fmt == "fp16" and not check_finite))
        and type(x) is torch.Tensor and x.is_cpu and x.is_contiguous() and x.dtype in SOURCE_DTYPES
        and block.__class__ is int and 2 <= block <= MAX_BLOCK and not block & (block - 1) and (n := x.numel())
        and eager.fast() and _torch_path(x, provider)
    ):  # fmt: skip
        # The common case, a 16-bit float format on the CPU: the torch path's one cast-copy into a new
        # buffer, without the staging logic for another device.
        data = torch.empty(2 * n, dtype=torch.uint8)
        src = x.detach() if x.requires_grad else x
        data.view(_CODE_DTYPES[fmt]).copy_(src if src.dim() == 1 else src.view(-1))
        p = Packed(data=data, fmt=fmt, shape=tuple(x.shape), dtype=x.dtype, block=block)
        _setattr(p, "_seal", (data, 2 * n))  # (_sealed, inline: its buffer holds 2n bytes)
        return p
    what = "torsh_kernels.pack"
    check_provider(provider)
    if not isinstance(x, torch.Tensor):
        raise ArgumentTypeError(f"{what}: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in SOURCE_DTYPES:
        raise DTypeError(f"{what}: x has dtype {x.dtype}; expected float32, float16 or bfloat16")
    fmt = _check_fmt(fmt, what)
    block = _check_block(block, what)
    check_strided(x, what, "x")
    n = x.numel()
    _, nbytes = _layout(n, fmt, block)
    if out is None:
        out = torch.empty(nbytes, dtype=torch.uint8, device=x.device)
    else:
        out = _check_buffer(out, nbytes, what, "out", x)
    with _stream_ctx(stream, (x.device, out.device), what):
        check_range = check_finite and fmt == "fp16" and x.dtype != torch.float16 and n
        traced = fmt != "int8" and eager.deferred(x, out)  # the range check and the cast then run in one op
        if check_range and not traced:
            _check_fp16_range(x.detach(), what)
        stage = out if out.device == x.device else torch.empty(nbytes, dtype=torch.uint8, device=x.device)
        dst = Packed(data=stage, fmt=fmt, shape=tuple(x.shape), dtype=x.dtype, block=block)
        if n:
            if fmt == "int8":
                quantize(x.detach(), bits=8, block=block, check_finite=check_finite, out=(dst.codes, dst.scales),
                         provider=provider)  # fmt: skip
            elif traced:
                _pack_cast_op(x.detach(), dst.codes, bool(check_range), provider or "")
            else:
                _cast_into(x.detach(), dst.codes, provider)
        if stage is not out:  # only the packed bytes cross the bus
            out[:nbytes].copy_(stage, non_blocking=True)
            if stage.device.type == "cuda":
                stage.record_stream(torch.cuda.current_stream(stage.device))
    p = Packed(data=out, fmt=fmt, shape=tuple(x.shape), dtype=x.dtype, block=block)
    return p if eager.compiling() else _sealed(p)  # (while torch.compile traces: nothing to seal)


def _sealed(p: Packed) -> Packed:
    """``p``, marked as made by :func:`pack` over its buffer as it is now (its identity and size: a buffer
    swapped or resized makes :func:`unpack` check the object in full)."""
    _setattr(p, "_seal", (p.data, p.data.numel()))
    return p


_setattr = object.__setattr__


def unpack(
    packed: Packed,
    *,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    stream: torch.cuda.Stream | None = None,
    provider: str | None = None,
) -> torch.Tensor:
    """The tensor ``packed`` holds (or ``out += it`` with ``accumulate``); see the module docstring."""
    what = "torsh_kernels.unpack"
    check_provider(provider)
    packed = _check_packed(packed, what)
    n = packed.numel
    if device is not None:
        device = _check_device(device, what)
    if out is None:
        if accumulate:
            raise InvalidArgumentError(f"{what}: accumulate=True needs out= (the tensor to add to)")
        dt = dtype or packed.dtype
        if dt not in SOURCE_DTYPES:
            raise DTypeError(f"{what}: dtype={dt}; expected float32, float16 or bfloat16")
        out = torch.empty(packed.shape, dtype=dt, device=device or packed.device)
    else:
        if not isinstance(out, torch.Tensor):
            raise ArgumentTypeError(f"{what}: out must be a torch.Tensor, got {type(out).__name__}")
        if tuple(out.shape) != packed.shape:
            raise ShapeError(f"{what}: out has shape {tuple(out.shape)}, the packed tensor {packed.shape}")
        if out.dtype not in SOURCE_DTYPES:
            raise DTypeError(f"{what}: out has dtype {out.dtype}; expected float32, float16 or bfloat16")
        if not out.is_contiguous():
            raise ShapeError(f"{what}: out must be contiguous")
        if (dtype is not None and dtype != out.dtype) or (device is not None and device != out.device):
            raise InvalidArgumentError(f"{what}: dtype/device disagree with out's; pass one or the other")
        if out.device == packed.device and not eager.deferred(out, packed.data):
            no_overlap(out, packed.data[: packed.nbytes], what, "out", "packed.data")
    if n == 0:
        return out
    with _stream_ctx(stream, (packed.device, out.device), what):
        src = packed
        if packed.device != out.device:  # the packed bytes cross the bus, then the kernel runs where out is
            data = torch.empty(packed.nbytes, dtype=torch.uint8, device=out.device)
            data.copy_(packed.data[: packed.nbytes], non_blocking=True)
            src = Packed(data=data, fmt=packed.fmt, shape=packed.shape, dtype=packed.dtype, block=packed.block)
        flat = out.view(-1)
        if packed.fmt == "int8":
            dequantize(src.codes, src.scales, block=src.block, numel=n, out=flat, accumulate=accumulate,
                       provider=provider)  # fmt: skip
        elif eager.compiling():  # the bucket op, which selects its provider at run time (the same roundings)
            unflatten(src.codes, BucketLayout.for_tensors([flat], src.codes.dtype), [flat], accumulate=accumulate,
                      provider=provider)  # fmt: skip
        elif _torch_path(flat, provider):
            if not accumulate:
                flat.copy_(src.codes)
            elif flat.dtype == torch.float32:
                flat.add_(src.codes)  # in fp32, rounded once
            else:
                flat.copy_(flat.float() + src.codes.float())
        else:
            unflatten(src.codes, BucketLayout.for_tensors([flat], src.codes.dtype), [flat], accumulate=accumulate,
                      provider=provider)  # fmt: skip
    return out


def pack_ref(x: torch.Tensor, fmt: str = "bf16", *, block: int = 256) -> Packed:
    """Plain PyTorch packing (the tests' oracle)."""
    n = x.numel()
    _, nbytes = _layout(n, fmt, block)
    data = torch.zeros(nbytes, dtype=torch.uint8, device=x.device)
    p = Packed(data=data, fmt=fmt, shape=tuple(x.shape), dtype=x.dtype, block=block)
    v = x.detach().reshape(-1)
    if fmt == "int8":
        from .quantize import quantize_ref

        q, s = quantize_ref(v, bits=8, block=block)
        p.codes.copy_(q)
        p.scales.copy_(s)
    else:
        p.codes.copy_(v.to(_CODE_DTYPES[fmt]))
    return p


def unpack_ref(packed: Packed, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Plain PyTorch unpacking (the tests' oracle)."""
    dt = dtype or packed.dtype
    if packed.fmt == "int8":
        s = packed.scales.repeat_interleave(packed.block)[: packed.numel]
        v = packed.codes.float() * s
    else:
        v = packed.codes.float()
    return v.to(dt).view(packed.shape)
