"""Gradient-bucket ops: flatten, unflatten, bucket_reduce, wire_cast.

- ``flatten(tensors)`` copies N tensors (any shapes, contiguous or not) into one flat buffer, optionally
  scaling and casting in the same pass, and returns the buffer with its :class:`BucketLayout`.
- ``unflatten(flat, layout, tensors)`` writes (or adds) the slices back into the tensors, casting to each
  tensor's dtype.
- ``bucket_reduce(buffers)`` reduces K same-size buffers elementwise (sum, avg, max) in fp32 (fp64 if
  any operand is fp64).
- ``wire_cast(x, dtype, divisor=)`` casts a bucket to its wire dtype and divides it there, in one pass:
  ``dtype(dtype(x) / divisor)``, two roundings, PyTorch's ``fp16_compress_hook`` arithmetic (so a hook
  built on it gives PyTorch's bits), counting the NaN/Inf it writes (an fp16 overflow above 65504).

The Triton kernels take all tensors of one dtype in at most three launches, each a constexpr variant chosen
on the host from a cached copy plan (``_bucket_tables.copy_plan``): the 16-byte aligned contiguous segments
(128-bit accesses, alignment and extent stated with ``tl.multiple_of``), the segments of tensors whose
address and flat offset disagree modulo 16 bytes (128-bit on one side), and a gather of the rest (strided
tensors, the heads and tails of odd-sized ones) with the strided index math. Launches therefore grow with
the number of distinct dtypes, never with the number of tensors. bucket_reduce and wire_cast launch a bulk
whose end is divisible by 16 and a one-program tail (``_common.spans``). The Numba kernels take a table in
device memory that holds, per tensor, its element offset from the lowest address, size, offset in the flat
buffer, first tile and (for non-contiguous tensors) up to four coalesced sizes and strides; a second table
maps each tile (program) to its tensor, in the manner of Triton's grouped-GEMM tutorial. Tables and plans
are cached per (device, stream, geometry, addresses), so steady-state training steps do not rebuild or
re-upload them (``_bucket_tables.py``).
The kernels live in ``_bucket_triton.py`` and ``_bucket_numba.py``, imported on a provider's first launch.
"""

from __future__ import annotations

import itertools
import math
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import (
    ArgumentTypeError,
    DeviceMismatchError,
    DTypeError,
    InvalidArgumentError,
    LayoutMismatchError,
    NonFiniteError,
    ShapeError,
)
from . import _eager
from ._bucket_tables import _by_dtype, _numba_groups, _readable, _scale_bits, _tables, _Writable, copy_plan
from ._common import (
    VEC,
    _check_strided,
    _count,
    _count_nonfinite,
    _flat_inout,
    _flat_input,
    _guards,
    _Memo,
    _no_overlap,
    _numba_span,
    _on,
    _ptr_table,
    _ptrs,
    _Ranges,
    device_bytes,
    spans,
)
from .registry import Op, check_provider, tuned_meta
from .tuning import TuneSpace, register_space

__all__ = [
    "BucketLayout",
    "bucket_reduce",
    "bucket_reduce_ref",
    "flatten",
    "flatten_ref",
    "unflatten",
    "unflatten_ref",
    "wire_cast",
    "wire_cast_ref",
]

WIRE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
REDUCE_OPS = ("sum", "avg", "max")
_FLOAT_SET = frozenset(FLOAT_DTYPES)
_REDUCE_CODE = {"sum": 0, "avg": 1, "max": 2}

# Kernel geometry. The autotuner (a later issue) searches these; the defaults suit memory-bound copies.
TRITON_BLOCK = 2048
TRITON_WARPS = 4
GATHER_BLOCK = 512  # the strided / unaligned pieces: 4 elements a thread keep the index math within 64 registers
NUMBA_TILE = 2048


# --------------------------------------------------------------------------------------------------
# Layout


@dataclass(frozen=True)
class BucketLayout:
    """Where each tensor lives in a flat bucket. Small, picklable, reusable across steps."""

    shapes: tuple[tuple[int, ...], ...]
    """Shape of each tensor, in order."""
    dtypes: tuple[torch.dtype, ...]
    """dtype of each tensor when the layout was made."""
    offsets: tuple[int, ...]
    """Element offset of each tensor in the flat buffer (dense, in order)."""
    total: int
    """Number of elements of the flat buffer."""
    dtype: torch.dtype
    """dtype of the flat buffer."""

    def __post_init__(self) -> None:
        for name in ("shapes", "dtypes", "offsets"):
            if not isinstance(getattr(self, name), tuple):
                raise ArgumentTypeError(
                    f"BucketLayout.{name} must be a tuple, got {type(getattr(self, name)).__name__}"
                )
        for i, shape in enumerate(self.shapes):
            if not isinstance(shape, tuple) or not all(type(d) is int and d >= 0 for d in shape):
                raise InvalidArgumentError(f"BucketLayout.shapes[{i}]={shape!r} must be a tuple of non-negative ints")
        for i, o in enumerate(self.offsets):
            if type(o) is not int:
                raise ArgumentTypeError(f"BucketLayout.offsets[{i}] must be an int, got {type(o).__name__}")
        for d in (*self.dtypes, self.dtype):
            if d not in _FLOAT_SET:
                raise DTypeError(f"BucketLayout: dtype {d!r} is not one of float32, float16, bfloat16, float64")
        if type(self.total) is not int:
            raise ArgumentTypeError(f"BucketLayout.total must be an int, got {type(self.total).__name__}")
        n = len(self.shapes)
        if len(self.dtypes) != n or len(self.offsets) != n:
            raise InvalidArgumentError(
                f"BucketLayout needs one dtype and one offset per shape; got {n} shapes, "
                f"{len(self.dtypes)} dtypes, {len(self.offsets)} offsets"
            )
        expected = 0
        for i, (shape, off) in enumerate(zip(self.shapes, self.offsets)):
            if off != expected:
                raise InvalidArgumentError(
                    f"BucketLayout offsets must be the running sum of the sizes; offset {i} is {off}, "
                    f"expected {expected}"
                )
            expected += math.prod(shape)
        if self.total != expected:
            raise InvalidArgumentError(f"BucketLayout total is {self.total}, the shapes add up to {expected}")

    @classmethod
    def for_tensors(cls, tensors: Sequence[torch.Tensor], dtype: torch.dtype | None = None) -> BucketLayout:
        """The dense layout of ``tensors``; the flat dtype defaults to their promoted dtype."""
        numels = [t.numel() for t in tensors]
        dtypes = tuple(t.dtype for t in tensors)
        if dtype is None:
            dtype = dtypes[0]
            for d in set(dtypes[1:]):
                dtype = torch.promote_types(dtype, d)
        # Consistent by construction, so skip __post_init__'s checks (they are per tensor, in Python).
        layout = object.__new__(cls)
        for name, value in (
            ("shapes", tuple(tuple(t.shape) for t in tensors)),
            ("dtypes", dtypes),
            ("offsets", tuple(itertools.accumulate(numels[:-1], initial=0))),
            ("total", sum(numels)),
            ("dtype", dtype),
        ):
            object.__setattr__(layout, name, value)
        return layout

    def __len__(self) -> int:
        return len(self.shapes)

    @property
    def numels(self) -> tuple[int, ...]:
        return tuple(math.prod(s) for s in self.shapes)

    @property
    def nbytes(self) -> int:
        """Bytes of the flat buffer."""
        return self.total * _itemsize(self.dtype)

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of ``flat`` shaped like each tensor (no copy)."""
        _check_flat(flat, self, "BucketLayout.views")
        flat = flat.reshape(-1)
        return [flat[o : o + n].view(s) for o, n, s in zip(self.offsets, self.numels, self.shapes)]


# --------------------------------------------------------------------------------------------------
# Validation


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _check_tensor_list(tensors: object, what: str, arg: str) -> list[torch.Tensor]:
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, (list, tuple)):
        raise ArgumentTypeError(f"{what}: {arg} must be a list or tuple of tensors, got {type(tensors).__name__}")
    if not tensors:
        raise InvalidArgumentError(f"{what}: {arg} is empty; pass at least one tensor")
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        i = next(i for i, t in enumerate(tensors) if not isinstance(t, torch.Tensor))
        raise ArgumentTypeError(f"{what}: {arg}[{i}] is a {type(tensors[i]).__name__}, expected a torch.Tensor")
    return list(tensors)


def _check_float(t: torch.Tensor, what: str, name: str) -> None:
    if t.dtype not in FLOAT_DTYPES:
        raise DTypeError(
            f"{what}: {name} has dtype {t.dtype}; expected one of float32, float16, bfloat16, float64. "
            f"Convert it (e.g. .float()) or keep it out of the bucket."
        )


def _check_floats(tensors: Sequence[torch.Tensor], what: str, arg: str) -> None:
    """All of ``tensors`` floating point (one set pass; the per-tensor walk only to name an offender)."""
    if not {t.dtype for t in tensors} <= _FLOAT_SET:
        for i, t in enumerate(tensors):
            _check_float(t, what, f"{arg}[{i}]")


def _check_same_device(tensors: Sequence[torch.Tensor], what: str, arg: str) -> torch.device:
    dev = tensors[0].device
    if len({t.device for t in tensors}) > 1:
        i = next(i for i, t in enumerate(tensors) if t.device != dev)
        raise DeviceMismatchError(
            f"{what}: all tensors must be on one device; {arg}[0] is on {dev} but {arg}[{i}] is on "
            f"{tensors[i].device}. Move them with .to({str(dev)!r}) first."
        )
    return dev


def _check_scale(scale: object, what: str) -> float:
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise ArgumentTypeError(f"{what}: scale must be a real number, got {type(scale).__name__}")
    scale = float(scale)
    if not math.isfinite(scale):
        raise InvalidArgumentError(f"{what}: scale must be finite, got {scale}")
    return scale


def _has_internal_overlap(t: torch.Tensor) -> bool:
    """A stride-0 (expanded) dimension of size > 1 makes several elements share memory."""
    return not t.is_contiguous() and any(st == 0 and s > 1 for s, st in zip(t.shape, t.stride()))


def _check_flat(flat: object, layout: BucketLayout, what: str) -> torch.Tensor:
    if not isinstance(flat, torch.Tensor):
        raise ArgumentTypeError(f"{what}: flat must be a torch.Tensor, got {type(flat).__name__}")
    _check_float(flat, what, "flat")
    if flat.numel() != layout.total:
        raise LayoutMismatchError(
            f"{what}: flat has {flat.numel()} elements but the layout describes {layout.total}; "
            "use the layout returned by the flatten call that produced this buffer"
        )
    return flat


# --------------------------------------------------------------------------------------------------
# Torch references: the plain oracles the tests compare every provider with.


def _compute_dtype(*dtypes: torch.dtype) -> torch.dtype:
    return torch.float64 if torch.float64 in dtypes else torch.float32


def flatten_ref(tensors: Sequence[torch.Tensor], dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """Reference flatten: per tensor, upcast, scale, cast to ``dtype``; concatenate."""
    parts = []
    for t in tensors:
        c = _compute_dtype(t.dtype, dtype)
        parts.append((t.reshape(-1).to(c) * scale).to(dtype))
    return torch.cat(parts)


def unflatten_ref(
    flat: torch.Tensor,
    layout: BucketLayout,
    tensors: Sequence[torch.Tensor],
    scale: float = 1.0,
    accumulate: bool = False,
) -> None:
    """Reference unflatten: per tensor, ``t = cast(flat_slice * scale [+ t])``, computed in fp32/fp64."""
    flat = flat.reshape(-1)
    for t, off, n in zip(tensors, layout.offsets, layout.numels):
        c = _compute_dtype(t.dtype, flat.dtype)
        v = flat[off : off + n].to(c).view(t.shape) * scale
        if accumulate:
            v = t.to(c) + v
        t.copy_(v.to(t.dtype))


def bucket_reduce_ref(buffers: Sequence[torch.Tensor], op: str, out_dtype: torch.dtype) -> torch.Tensor:
    """Reference reduction: accumulate buffer by buffer, in order, in fp32 (fp64 if any is fp64)."""
    c = _compute_dtype(buffers[0].dtype, out_dtype)
    acc = buffers[0].to(c).clone()
    for b in buffers[1:]:
        acc = torch.maximum(acc, b.to(c)) if op == "max" else acc + b.to(c)
    if op == "avg":
        acc = acc / len(buffers)
    return acc.to(out_dtype)


# --------------------------------------------------------------------------------------------------
# Provider implementations. Inputs are validated; outputs are allocated.

_flatten = Op("flatten")
_unflatten = Op("unflatten")
_reduce = Op("bucket_reduce")
_T = torch.Tensor
_F32 = torch.float32
_CPU = torch.device("cpu")


def _offsets(tensors: Sequence[torch.Tensor]) -> list[int]:
    return list(itertools.accumulate((t.numel() for t in tensors[:-1]), initial=0))


def _as_1d(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [t if t.dim() == 1 else t.reshape(-1) for t in tensors]


def _split_like(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of ``flat`` shaped like ``tensors`` (one split, then a view only where a shape needs it)."""
    parts = flat.split([t.numel() for t in tensors])
    return [p if t.dim() == 1 else p.view(t.shape) for p, t in zip(parts, tensors)]


@_flatten.register("torch")
def _flatten_torch(tensors: list[torch.Tensor], out: torch.Tensor, scale: float, one_d: bool | None = None) -> None:
    if one_d is not None:  # the direct path's plan: every tensor of out's dtype, 1-D if one_d, scale rounds once
        torch.cat(tensors if one_d else _as_1d(tensors), out=out)
        if scale != 1.0:
            out.mul_(scale)
        return
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) == 1:  # one group covering the whole bucket, in order: whole-buffer ops
        (dtype,) = dtypes
        c = _compute_dtype(dtype, out.dtype)
        if dtype == out.dtype and (dtype == c or scale == 1.0):
            torch.cat(_as_1d(tensors), out=out)  # exact copy, then scale in place in the compute dtype
            if scale != 1.0:
                out.mul_(scale)
        elif scale == 1.0:  # one cast per element, no temporary (torch.cat with a casting out= is slow)
            torch._foreach_copy_(_split_like(out, tensors), tensors)
        elif len(tensors) == 1 and out.dtype == c:
            # an exact widening copy, then the product in c, rounded once (torch.mul(x16, scale, out=out32)
            # would compute in x's 16-bit dtype: the fuzz found -3 * 1.541 flattened as -4.625, not -4.623)
            out.copy_(tensors[0].reshape(-1))
            out.mul_(scale)
        else:
            cat = torch.cat(_as_1d(tensors))
            cat = cat.to(c) if cat.dtype != c else cat
            out.copy_(cat * scale if scale != 1.0 else cat)
        return
    for dtype, (ts, offs) in _by_dtype(tensors, _offsets(tensors)):
        c = _compute_dtype(dtype, out.dtype)
        cat = torch.cat(_as_1d(ts))
        cat = cat.to(c) if cat.dtype != c else cat
        if scale != 1.0:
            cat = cat * scale
        # Scatter each tensor's slice back to its offset (adjacent tensors form one run).
        pos = 0
        for t, off in zip(ts, offs):
            n = t.numel()
            out[off : off + n].copy_(cat[pos : pos + n])
            pos += n


@_flatten.register("triton")
def _flatten_triton(tensors: list[torch.Tensor], out: torch.Tensor, scale: float) -> None:
    from . import _bucket_triton as K

    tensors = [_readable(t) for t in tensors]
    for dtype, (ts, offs) in _by_dtype(tensors, _offsets(tensors)):
        f64 = _compute_dtype(dtype, out.dtype) == torch.float64
        seg, gen, warps = _copy_geometry("flatten", out, f64, False)
        plan = copy_plan(ts, offs, out, True, ts[0].element_size() >= out.element_size(), seg, gen)
        K.copy(plan, out, ts[0], _scale_bits(scale), scale != 1.0, False, f64, warps)


def _copy_geometry(op: str, flat: torch.Tensor, f64: bool, accumulate: bool) -> tuple[int, int, int]:
    """(segment kernel BLOCK, gather kernel BLOCK, warps): the tuned BLOCK for the segments, else 16 elements a
    thread (8 with fp64 compute or an accumulating read, to stay within 64 registers)."""
    m = tuned_meta(op, flat.device, flat.dtype, flat.numel(), "triton")
    warps = m.get("num_warps", TRITON_WARPS)
    seg = m.get("BLOCK") or (TRITON_BLOCK // 2 if f64 or accumulate else TRITON_BLOCK) * warps // TRITON_WARPS
    return seg, GATHER_BLOCK, warps


@_flatten.register("numba")
def _flatten_numba(tensors: list[torch.Tensor], out: torch.Tensor, scale: float) -> None:
    from . import _bucket_numba
    from . import _numba as nb

    tensors = [_readable(t) for t in tensors]
    out_arr = nb.as_array(out)
    for ts, offs in _numba_groups(tensors, _offsets(tensors)):
        base, span, addrs = _numba_span(ts)
        table, tile_map, n_tiles = _tables(ts, offs, addrs, NUMBA_TILE, out.device, "numba")
        kernel = _bucket_numba.flatten_kernel(ts[0].dtype, out.dtype)
        nb.launch(
            kernel, n_tiles, nb.THREADS, out.device,
            nb.as_array(table), nb.as_array(tile_map), nb.span_array(base, span, ts[0].dtype),
            out_arr, scale, NUMBA_TILE,
        )  # fmt: skip


@_unflatten.register("torch")
def _unflatten_torch(flat: torch.Tensor, tensors: list[torch.Tensor], scale: float, accumulate: bool,
                     views: list[torch.Tensor] | None = None) -> None:  # fmt: skip
    if views is not None:  # the direct path's plan: views of flat, one per tensor, all of flat's dtype
        torch._foreach_copy_(tensors, views)
        return
    groups = _by_dtype(tensors, _offsets(tensors))
    whole = len(groups) == 1 and len(groups[0][1][0]) == len(tensors)  # every tensor, in order, one dtype
    for dtype, (ts, toffs) in groups:
        c = _compute_dtype(dtype, flat.dtype)
        if whole:
            views = _split_like(flat, ts)
        else:
            views = [flat[o : o + t.numel()].view(t.shape) for t, o in zip(ts, toffs)]
        if not accumulate and scale == 1.0:
            torch._foreach_copy_(ts, views)
            continue
        vals = [v.to(c) for v in views] if flat.dtype != c else views
        if scale != 1.0:
            vals = torch._foreach_mul(vals, scale)
        if accumulate:
            vals = torch._foreach_add([t.to(c) for t in ts] if dtype != c else ts, vals)
        torch._foreach_copy_(ts, vals)


@_unflatten.register("triton")
def _unflatten_triton(flat: torch.Tensor, tensors: list[torch.Tensor], scale: float, accumulate: bool) -> None:
    from . import _bucket_triton as K

    w = _Writable(tensors, accumulate)
    for dtype, (ts, offs) in _by_dtype(w.targets, _offsets(w.targets)):
        f64 = _compute_dtype(dtype, flat.dtype) == torch.float64
        seg, gen, warps = _copy_geometry("unflatten", flat, f64, accumulate)
        prefer_tensor = ts[0].element_size() * (2 if accumulate else 1) > flat.element_size()  # ties: loads
        plan = copy_plan(ts, offs, flat, False, prefer_tensor, seg, gen)
        K.copy(plan, flat, ts[0], _scale_bits(scale), scale != 1.0, accumulate, f64, warps)
    w.finish()


@_unflatten.register("numba")
def _unflatten_numba(flat: torch.Tensor, tensors: list[torch.Tensor], scale: float, accumulate: bool) -> None:
    from . import _bucket_numba
    from . import _numba as nb

    w = _Writable(tensors, accumulate)
    flat_arr = nb.as_array(flat)
    for ts, offs in _numba_groups(w.targets, _offsets(w.targets)):
        base, span, addrs = _numba_span(ts)
        table, tile_map, n_tiles = _tables(ts, offs, addrs, NUMBA_TILE, flat.device, "numba")
        kernel = _bucket_numba.unflatten_kernel(flat.dtype, ts[0].dtype)
        nb.launch(
            kernel, n_tiles, nb.THREADS, flat.device,
            nb.as_array(table), nb.as_array(tile_map), nb.span_array(base, span, ts[0].dtype),
            flat_arr, scale, accumulate, NUMBA_TILE,
        )  # fmt: skip
    w.finish()


@_reduce.register("torch")
def _reduce_torch(buffers: list[torch.Tensor], out: torch.Tensor | None, op: str) -> torch.Tensor:
    """Into ``out``; with ``out=None`` (fp32/fp64 buffers of one dtype, at least two), into a new tensor."""
    if out is None:  # the direct path's case: the first two combined into a new tensor, no copy
        acc = (torch.maximum if op == "max" else torch.add)(buffers[0], buffers[1])
        for b in buffers[2:]:
            torch.maximum(acc, b, out=acc) if op == "max" else acc.add_(b)
        return acc.div_(len(buffers)) if op == "avg" else acc
    c = _compute_dtype(buffers[0].dtype, out.dtype)
    rest = buffers[1:]
    if out.dtype == c and not any(b.data_ptr() == out.data_ptr() for b in rest):
        acc = out  # accumulate in place: no temporary
        if rest and buffers[0].dtype == c and rest[0].dtype == c:  # the first two in one pass
            (torch.maximum if op == "max" else torch.add)(buffers[0], rest[0], out=acc)
            rest = rest[1:]
        else:
            acc.copy_(buffers[0])
    else:
        acc = buffers[0].to(c, copy=True)
    for b in rest:
        b = b.to(c) if b.dtype != c else b
        if op == "max":
            torch.maximum(acc, b, out=acc)
        else:
            acc.add_(b)
    if op == "avg":
        acc.div_(len(buffers))
    if acc is not out:
        out.copy_(acc)
    return out


def _spans(n: int, block: int, warps: int):
    """``_common.spans`` with each launch's BLOCK: the one-program tail (< 16 elements, narrow accesses) at one
    element a thread, so its scalar addressing stays within the bulk's registers."""
    for grid, start, end in spans(n, block):
        yield grid, start, end, (block if end % VEC == 0 and end > start else 32 * warps)


@_reduce.register("triton")
def _reduce_triton(buffers: list[torch.Tensor], out: torch.Tensor, op: str) -> None:
    from . import _bucket_triton as K

    numel = out.numel()
    if numel == 0:
        return
    addrs = [b.data_ptr() for b in buffers]
    ptrs = _ptr_table(addrs + [0] * (len(addrs) % 2), out.device, "triton-reduce")  # (read in pairs)
    m = tuned_meta("bucket_reduce", out.device, buffers[0].dtype, numel, "triton")
    f64 = _compute_dtype(buffers[0].dtype, out.dtype) == torch.float64
    warps = m.get("num_warps", TRITON_WARPS)
    bulk = m.get("BLOCK") or (TRITON_BLOCK // 2 if f64 else TRITON_BLOCK) * warps // TRITON_WARPS
    aligned = all(a % 16 == 0 for a in addrs)
    for grid, start, end, block in _spans(numel, bulk, warps):
        K._bucket_reduce_kernel[grid](
            ptrs, out, buffers[0], start, end, len(buffers),
            BLOCK=block, OP=_REDUCE_CODE[op], COMPUTE_F64=f64, ALIGNED=aligned, num_warps=warps,
            enable_fp_fusion=False,
        )  # fmt: skip


@_reduce.register("numba")
def _reduce_numba(buffers: list[torch.Tensor], out: torch.Tensor, op: str) -> None:
    from . import _bucket_numba
    from . import _numba as nb

    numel = out.numel()
    if numel == 0:
        return
    isz = buffers[0].element_size()
    if len({b.data_ptr() % isz for b in buffers}) > 1:  # not a whole number of elements apart
        buffers = [buffers[0]] + [b.clone() if (b.data_ptr() - buffers[0].data_ptr()) % isz else b for b in buffers[1:]]
    base, span, offs = _numba_span(buffers)
    kernel = _bucket_numba.reduce_kernel(buffers[0].dtype, out.dtype, _REDUCE_CODE[op])
    table = _ptr_table(offs, out.device, "numba-reduce")
    blocks = -(-numel // NUMBA_TILE)
    nb.launch(
        kernel, blocks, nb.THREADS, out.device,
        nb.as_array(table), nb.span_array(base, span, buffers[0].dtype), nb.as_array(out), numel, NUMBA_TILE,
    )  # fmt: skip


# wire cast: out = dtype(dtype(x) / divisor) (no division when divisor == 1); returns the NaN/Inf count
# written (0 unless count_bad). x is contiguous and 1-D, out contiguous, 1-D, of x's size.
_wire = Op("wire_cast")


def wire_cast_ref(x: torch.Tensor, dtype: torch.dtype, divisor: float = 1.0) -> torch.Tensor:
    """``dtype(dtype(x) / divisor)``: x rounded to dtype, divided (in fp32, torch's arithmetic for 16-bit
    tensors) and rounded again; the elements of x in order, 1-D."""
    v = x.reshape(-1).to(dtype, copy=True)
    return v.div_(divisor) if divisor != 1.0 else v


@_wire.register("torch")
def _wire_torch(x, out, divisor, count_bad):
    out.copy_(x)
    if divisor != 1.0:
        out.div_(divisor)
    return _count_nonfinite(out) if count_bad else 0


@_wire.register("triton")
def _wire_triton(x, out, divisor, count_bad):
    from . import _bucket_triton as K

    n = x.numel()
    bad = torch.zeros(1, dtype=torch.int32 if n < 2**31 else torch.int64, device=x.device)  # (holds at most n)
    for grid, start, end, block in _spans(n, TRITON_BLOCK, TRITON_WARPS):
        K._wire_cast_kernel[grid](
            x, out, bad, start, end, float(divisor), BLOCK=block, DIVIDE=divisor != 1.0,
            COUNT_BAD=bool(count_bad), num_warps=TRITON_WARPS,
        )  # fmt: skip
    return bad


@_wire.register("numba")
def _wire_numba(x, out, divisor, count_bad):
    from . import _bucket_numba
    from . import _numba as nb

    bad = torch.zeros(1, dtype=torch.int64, device=x.device)
    n = x.numel()
    kernel = _bucket_numba.wire_cast_kernel(x.dtype, out.dtype)
    nb.launch(kernel, max(1, -(-n // nb.TILE)), nb.THREADS, x.device, nb.as_array(x), nb.as_array(out),
              nb.as_array(bad), n, float(divisor), divisor != 1.0)  # fmt: skip
    return bad


@_wire.register("cpu")
def _wire_cpu(x, out, divisor, count_bad):
    from . import _bucket_cpu as K

    return K.wire_cast(x, out, divisor, count_bad)


# The cpu provider's bucket ops are the torch provider's: on the CPU, torch.cat(out=), _foreach_copy_ and
# the in-place adds are already one vectorised pass per tensor; a Numba loop would add nothing.
for _op, _impl in ((_flatten, _flatten_torch), (_unflatten, _unflatten_torch), (_reduce, _reduce_torch)):
    _op.register("cpu")(_impl)
_TORCH_IMPL = ("torch", "cpu")  # provider names that run the torch implementations above


# --------------------------------------------------------------------------------------------------
# Custom ops (torch.library): opaque to torch.compile, with fake implementations for tracing.


@torch.library.custom_op("torsh::flatten", mutates_args=())
def _flatten_op(tensors: list[torch.Tensor], dtype: torch.dtype, scale: float, provider: str) -> torch.Tensor:
    out = torch.empty(sum(t.numel() for t in tensors), dtype=dtype, device=tensors[0].device)
    _flatten_into(tensors, out, scale, provider)
    return out


@_flatten_op.register_fake
def _(tensors, dtype, scale, provider):
    return tensors[0].new_empty(sum(t.numel() for t in tensors), dtype=dtype)


@torch.library.custom_op("torsh::flatten_out", mutates_args=("out",))
def _flatten_out_op(tensors: list[torch.Tensor], out: torch.Tensor, scale: float, provider: str,
                    traced: bool = False) -> None:  # fmt: skip
    """``traced``: the public function was traced (torch.compile) and left the memory check to run here."""
    if traced:
        _check_out_clear(tensors, out)
    _flatten_into(tensors, out, scale, provider)


@_flatten_out_op.register_fake
def _(tensors, out, scale, provider, traced=False):
    return None


def _check_out_clear(tensors: Sequence[torch.Tensor], out: torch.Tensor) -> None:
    hits = np.flatnonzero(_Ranges.of(tensors).overlapping(out))
    if hits.size:
        raise ShapeError(
            f"torsh_kernels.flatten: out overlaps tensors[{hits[0]}]; flatten cannot write over its own input"
        )


def _flatten_into(tensors: list[torch.Tensor], out: torch.Tensor, scale: float, provider: str) -> None:
    if out.numel() == 0:
        return
    name = _flatten.select(out.device, out.dtype, out.numel(), provider or None)
    with _on(out.device):
        _flatten(name, tensors, out.view(-1), scale)


def _unflatten_impl(flat: torch.Tensor, tensors: list[torch.Tensor], scale: float, accumulate: bool,
                    provider: str, traced: bool = False) -> None:  # fmt: skip
    """``traced``: the public function was traced (torch.compile) and left the memory checks to run here."""
    if traced:
        _check_unflatten_memory(flat, tensors, _Ranges.of(tensors))
    if flat.numel() == 0:
        return
    name = _unflatten.select(flat.device, flat.dtype, flat.numel(), provider or None)
    with _on(flat.device):
        _unflatten(name, flat.reshape(-1).contiguous(), tensors, scale, accumulate)


_unflatten_op = torch.library.custom_op("torsh::unflatten", _unflatten_impl, mutates_args=("tensors",))


@_unflatten_op.register_fake
def _(flat, tensors, scale, accumulate, provider, traced=False):
    return None


def _check_unflatten_memory(flat: torch.Tensor, tensors: Sequence[torch.Tensor], ranges: _Ranges) -> None:
    """The destinations share no memory with each other, nor with ``flat`` unless as exactly its own slice."""
    what = "torsh_kernels.unflatten"
    clash = ranges.contiguous_clash()
    if clash is not None:
        raise ShapeError(
            f"{what}: tensors[{clash[0]}] and tensors[{clash[1]}] share memory; writing both would race. "
            "Pass each destination once."
        )
    hits = np.flatnonzero(ranges.overlapping(flat))
    if hits.size:
        fptr, fsz = flat.data_ptr(), flat.element_size()
        offsets = _offsets(tensors)
        for i in hits.tolist():
            t = tensors[i]
            exact = t.dtype == flat.dtype and t.is_contiguous() and t.data_ptr() == fptr + offsets[i] * fsz
            if not exact:
                raise ShapeError(
                    f"{what}: tensors[{i}] overlaps flat other than as its own slice; the result would be undefined"
                )


def _reduce_impl(buffers: list[torch.Tensor], op: str, provider: str) -> torch.Tensor:
    out = torch.empty_like(buffers[0], memory_format=torch.contiguous_format)
    _reduce_into(buffers, out, op, provider)
    return out


_reduce_op = torch.library.custom_op("torsh::bucket_reduce", _reduce_impl, mutates_args=())


@_reduce_op.register_fake
def _(buffers, op, provider):
    return torch.empty_like(buffers[0], memory_format=torch.contiguous_format)


@torch.library.custom_op("torsh::bucket_reduce_out", mutates_args=("out",))
def _reduce_out_op(buffers: list[torch.Tensor], out: torch.Tensor, op: str, provider: str,
                   traced: bool = False) -> None:  # fmt: skip
    """``traced``: the public function was traced (torch.compile) and left the memory check to run here."""
    if traced:
        _check_reduce_out(buffers, out)
    _reduce_into(buffers, out, op, provider)


@_reduce_out_op.register_fake
def _(buffers, out, op, provider, traced=False):
    return None


def _check_reduce_out(buffers: Sequence[torch.Tensor], out: torch.Tensor) -> None:
    """``out`` shares no memory with a buffer, unless it is that buffer (an in-place reduction)."""
    for i, (b, hit) in enumerate(zip(buffers, _Ranges.of(buffers).overlapping(out))):
        same = b.data_ptr() == out.data_ptr() and b.dtype == out.dtype and b.is_contiguous()
        if hit and not same:
            raise ShapeError(
                f"torsh_kernels.bucket_reduce: out overlaps buffers[{i}] without being the same tensor; the result "
                "would be undefined"
            )


def _reduce_into(buffers: list[torch.Tensor], out: torch.Tensor, op: str, provider: str) -> None:
    if out.numel() == 0:
        return
    name = _reduce.select(out.device, buffers[0].dtype, out.numel(), provider or None)
    with _on(out.device):
        _reduce(name, [b.contiguous().view(-1) for b in buffers], out.view(-1), op)


@torch.library.custom_op("torsh::wire_cast", mutates_args=("out",))
def _wire_op(x: torch.Tensor, out: torch.Tensor, divisor: float, check_finite: bool, provider: str,
             traced: bool = False) -> None:  # fmt: skip
    """``traced``: the public function was traced (torch.compile) and left the memory check to run here."""
    if traced:
        _no_overlap(out, x, "torsh_kernels.wire_cast", "out", "x", same_ok=True)
    if out.numel():
        name = _wire.select(out.device, out.dtype, out.numel(), provider or None)
        with _on(out.device):
            bad = _wire(name, x, out, divisor, check_finite)
        if check_finite and (b := _count(bad)):
            _raise_wire_nonfinite(b, out.dtype)


@_wire_op.register_fake
def _(x, out, divisor, check_finite, provider, traced=False):
    return None


def _raise_wire_nonfinite(bad: int, dtype: torch.dtype) -> None:
    raise NonFiniteError(
        f"torsh_kernels.wire_cast: the {str(dtype).removeprefix('torch.')} result holds {bad} non-finite "
        "element(s) (NaN/Inf in the input, or an fp16 overflow above 65504; out was written); find the source "
        "(a loss scale too high, a diverging step) or pass check_finite=False to cast anyway"
    )


# --------------------------------------------------------------------------------------------------
# The direct path (see _eager): validation cached per layout, the implementation called without the
# dispatcher. A plan is what one full validation of (tensors, out) or (flat, layout, tensors) found; it is
# found again by the tensors' addresses and confirmed by a C-level check of their types, dtypes, devices,
# shapes, strides and requires_grad (``_common._guards``), which together fix everything the validation
# read (memory ranges included). Anything else takes the full validation, and then the plan is stored.


@dataclass(slots=True, eq=False)
class _FlatPlan:
    guards: object
    ptrs: tuple  # the tensors' addresses when it was validated
    layout: BucketLayout
    device: torch.device
    cat: bool  # every tensor of the flat dtype, so torch.cat(out=) writes the bucket exactly
    cat_scaled: bool  # ... and the flat dtype is its own compute dtype (fp32/fp64): scaling in place rounds once
    one_d: bool  # every tensor is 1-D (no reshape before the cat)
    out_1d: bool  # out is None or 1-D
    grad: bool  # a tensor requires grad: run with grad mode off, as below the dispatcher's autograd


@dataclass(slots=True, eq=False)
class _UnflatPlan:
    guards: object
    layout: BucketLayout
    device: torch.device
    same: bool  # every tensor of flat's dtype and flat contiguous: one _foreach_copy_ from views of flat
    grad: bool
    flat_ref: object = None  # weakref to the flat the views were made of
    views: list | None = None


_FLAT_PLANS = _Memo(128)  # each plan is stored under two keys (see flatten)
_UNFLAT_PLANS = _Memo(32)


def _plain_all(tensors: Sequence[torch.Tensor]) -> bool:
    return all(map(_eager.plain, tensors))


def _new_flat_plan(key, tensors, out, layout, device) -> _FlatPlan | None:
    if key is None or not _eager.unmoded() or not _plain_all(tensors) or not _eager.plain(out):
        return None
    guards = _guards(list(tensors) if out is None else [*tensors, out])
    if guards is None:
        return None
    dt = layout.dtype
    plan = _FlatPlan(
        guards=guards, ptrs=_ptrs(tensors), layout=layout, device=device, cat=all(d == dt for d in layout.dtypes),
        cat_scaled=dt in (torch.float32, torch.float64), one_d=all(len(sh) == 1 for sh in layout.shapes),
        out_1d=out is None or out.dim() == 1, grad=any(t.requires_grad for t in tensors) or bool(
            out is not None and out.requires_grad),
    )  # fmt: skip
    _FLAT_PLANS.put(key, plan)  # found by the list object, and by the tensors' addresses
    if plan.ptrs:
        _FLAT_PLANS.put((plan.ptrs, *key[2:]), plan)
    return plan


def _flat_provider(plan: _FlatPlan, provider: str | None) -> str:
    return _flatten.select(plan.device, plan.layout.dtype, plan.layout.total, provider or None)


def _flatten_run(plan: _FlatPlan, tensors, out, scale: float, name: str):
    layout = plan.layout
    if out is None:
        flat = torch.empty(layout.total, dtype=layout.dtype, device=plan.device)
    else:
        flat = out if plan.out_1d else out.view(-1)
    if layout.total:
        if name in _TORCH_IMPL and plan.cat and (scale == 1.0 or plan.cat_scaled):
            if plan.grad:
                _eager.run(_flatten, name, tensors, flat, scale, plan.one_d)
            else:
                _flatten(name, tensors, flat, scale, plan.one_d)
        else:
            _eager.run(_flatten_into, list(tensors), flat, scale, name)
            _eager.written(name, flat)
    return flat, layout


def _storage_views(flat: torch.Tensor, layout: BucketLayout) -> list[torch.Tensor]:
    """Tensors over ``flat``'s storage shaped like the layout's slices: not autograd views of ``flat``, so
    holding them does not keep the ``flat`` object alive (its weakref callback drops the plan)."""
    st, base = flat.untyped_storage(), flat.storage_offset()
    views = []
    for off, shape in zip(layout.offsets, layout.shapes):
        stride, acc = [], 1
        for d in reversed(shape):
            stride.append(acc)
            acc *= max(d, 1)
        views.append(flat.new_empty(0).set_(st, base + off, shape, tuple(reversed(stride))))
    return views


def _unflatten_run(plan: _UnflatPlan, key, flat, tensors, scale: float, accumulate: bool, provider) -> None:
    total = plan.layout.total
    if total == 0:
        return
    name = _unflatten.select(plan.device, flat.dtype, total, provider or None)
    if name in _TORCH_IMPL and plan.same and scale == 1.0 and not accumulate:
        views = plan.views
        if views is None or plan.flat_ref() is not flat:
            views = plan.views = _storage_views(flat, plan.layout)
            plan.flat_ref = weakref.ref(flat, lambda _, k=key: _UNFLAT_PLANS.pop(k))
        if plan.grad:
            _eager.run(_unflatten, name, flat, tensors, scale, accumulate, views)
        else:
            _unflatten(name, flat, tensors, scale, accumulate, views)
        return
    _eager.run(_unflatten_impl, flat, list(tensors), scale, accumulate, name)
    _eager.written(name, *tensors)


# --------------------------------------------------------------------------------------------------
# Public API


def flatten(
    tensors: Sequence[torch.Tensor],
    *,
    out: torch.Tensor | None = None,
    scale: float = 1.0,
    dtype: torch.dtype | None = None,
    provider: str | None = None,
) -> tuple[torch.Tensor, BucketLayout]:
    """Copy ``tensors`` into one flat buffer, times ``scale``, cast to ``dtype``, in one pass.

    Args:
        tensors: floating-point tensors on one device, any shapes, contiguous or not.
        out: a contiguous buffer of exactly the total element count to write into; its dtype is the
            flat dtype. Must not overlap any input.
        scale: multiplier applied in fp32 (fp64 if an operand is fp64) before the cast.
        dtype: dtype of the flat buffer (e.g. torch.bfloat16 for the wire); defaults to ``out``'s
            dtype, else the promoted dtype of the inputs.
        provider: "triton", "numba", "cpu" or "torch"; None selects automatically (see ``providers()``).

    Returns:
        ``(flat, layout)``: the 1-D buffer and the :class:`BucketLayout` that ``unflatten`` takes.
    """
    what = "torsh_kernels.flatten"
    key = None
    tt = type(tensors)
    if (tt is list or tt is tuple) and _eager.unmoded() and (out is None or type(out) in _eager._PLAIN):
        # a validated layout: skip the per-tensor checks and the dispatcher. The plan is looked up by the
        # list object (the same list passed each step), else by the tensors' addresses (fresh views over
        # validated memory, as GradBucket.gradients() gives); either way confirmed by the guards.
        tail = (None, dtype) if out is None else (out.data_ptr(), None)
        key = (id(tensors), len(tensors), *tail)
        plan = _FLAT_PLANS.get(key)
        ptrs = None
        if plan is None:
            ptrs = _ptrs(tensors)
            plan = _FLAT_PLANS.get((ptrs, *tail)) if ptrs else None
        ok = plan is not None and (out is None or dtype is None or dtype == out.dtype)
        if ok and (plan.guards.check(*tensors) if out is None else plan.guards.check(*tensors, out)):
            scale = _check_scale(scale, what)
            name = _flat_provider(plan, provider)
            if plan.device.type == "cpu" and name in _TORCH_IMPL and plan.cat and (scale == 1.0 or plan.cat_scaled):
                # torch.cat(out=) reads the addresses itself and refuses an out overlapping an input (a
                # RuntimeError before it writes): the full validation then says which one
                try:
                    res = _flatten_run(plan, tensors, out, scale, name)
                except RuntimeError:
                    res = None
            elif (ptrs or _ptrs(tensors)) == plan.ptrs:  # the memory the validation checked
                res = _flatten_run(plan, tensors, out, scale, name)
            else:
                res = None
            if res is not None:  # (found by address: the list is new, likely a temporary; not stored)
                return res
    check_provider(provider)  # (a plan's call above selects its provider, which checks the name)
    tensors = _check_tensor_list(tensors, what, "tensors")
    _check_floats(tensors, what, "tensors")
    device = _check_same_device(tensors, what, "tensors")
    scale = _check_scale(scale, what)
    if dtype is not None and dtype not in FLOAT_DTYPES:
        raise DTypeError(f"{what}: dtype={dtype} is not a floating-point dtype the kernels write")
    if out is not None:
        if not isinstance(out, torch.Tensor):
            raise ArgumentTypeError(f"{what}: out must be a torch.Tensor, got {type(out).__name__}")
        _check_float(out, what, "out")
        if dtype is not None and dtype != out.dtype:
            raise InvalidArgumentError(
                f"{what}: dtype={dtype} disagrees with out.dtype={out.dtype}; pass one or make them equal"
            )
        dtype = out.dtype
    layout = BucketLayout.for_tensors(tensors, dtype)
    if layout.nbytes > device_bytes(device):  # (expanded views can claim any size)
        raise InvalidArgumentError(
            f"{what}: the tensors hold {layout.total} elements ({layout.nbytes / 2**30:.4g} GiB as {layout.dtype}), "
            f"more than the {device.type} memory holds; flatten smaller buckets"
        )
    if out is None:
        plan = _new_flat_plan(key, tensors, None, layout, device)
        if plan is not None:
            return _flatten_run(plan, tensors, None, scale, _flat_provider(plan, provider))
        flat = _flatten_op(tensors, layout.dtype, scale, provider or "")
        return flat, layout
    if out.device != device:
        raise DeviceMismatchError(f"{what}: out is on {out.device}, the tensors on {device}")
    if out.numel() != layout.total:
        raise ShapeError(
            f"{what}: out has {out.numel()} elements but the tensors hold {layout.total}; allocate "
            f"torch.empty({layout.total}, dtype={layout.dtype}) or slice your buffer to that size"
        )
    if not out.is_contiguous():
        raise ShapeError(f"{what}: out must be contiguous (it is written as one flat range)")
    if _eager.deferred(out, *tensors):  # the memory check runs in the op, at run time (meta: nothing to check)
        _flatten_out_op(tensors, out, scale, provider or "", True)
        return out.view(-1) if out.dim() != 1 else out, layout
    _check_out_clear(tensors, out)
    plan = _new_flat_plan(key, tensors, out, layout, device)
    if plan is not None:
        return _flatten_run(plan, tensors, out, scale, _flat_provider(plan, provider))
    _flatten_out_op(tensors, out, scale, provider or "")
    return out.view(-1) if out.dim() != 1 else out, layout


def unflatten(
    flat: torch.Tensor,
    layout: BucketLayout,
    tensors: Sequence[torch.Tensor],
    *,
    scale: float = 1.0,
    accumulate: bool = False,
    provider: str | None = None,
) -> None:
    """Write ``flat * scale`` back into ``tensors`` in place (or add it to them), in one launch per dtype.

    Each value is computed in fp32 (fp64 if an operand is fp64) and cast to its tensor's dtype.
    ``tensors`` must have the layout's shapes; they may be non-contiguous, but not expanded (stride 0),
    not sharing memory with each other, and not overlapping ``flat`` unless they are exactly its slices
    (as with DDP's bucket views).
    """
    what = "torsh_kernels.unflatten"
    key = None
    if _eager.unmoded() and type(flat) in _eager._PLAIN:  # a validated layout: skip the checks and the dispatcher
        ptrs = _ptrs(tensors)
        if ptrs:
            key = (flat.data_ptr(), id(layout), ptrs)
            plan = _UNFLAT_PLANS.get(key)
            if plan is not None and plan.layout is layout and plan.guards.check(flat, *tensors):
                return _unflatten_run(plan, key, flat, tensors, _check_scale(scale, what), bool(accumulate), provider)
    check_provider(provider)  # (a plan's call above selects its provider, which checks the name)
    if not isinstance(layout, BucketLayout):
        raise ArgumentTypeError(f"{what}: layout must be a BucketLayout (from flatten), got {type(layout).__name__}")
    flat = _check_flat(flat, layout, what)
    tensors = _check_tensor_list(tensors, what, "tensors")
    if len(tensors) != len(layout):
        raise LayoutMismatchError(f"{what}: the layout describes {len(layout)} tensors, got {len(tensors)}")
    if tuple(t.shape for t in tensors) != layout.shapes:
        i = next(i for i, (t, s) in enumerate(zip(tensors, layout.shapes)) if tuple(t.shape) != s)
        raise LayoutMismatchError(
            f"{what}: tensors[{i}] has shape {tuple(tensors[i].shape)}, the layout says {layout.shapes[i]}"
        )
    _check_floats(tensors, what, "tensors")
    if _eager.deferred(flat, *tensors):  # strides only (no addresses); memory checks in the op, at run time
        for i, t in enumerate(tensors):
            if _has_internal_overlap(t):
                raise ShapeError(f"{what}: tensors[{i}] is expanded (a stride-0 dimension); it cannot be written")
        if tensors[0].device != flat.device:
            raise DeviceMismatchError(f"{what}: flat is on {flat.device} but tensors[0] is on {tensors[0].device}")
        _check_same_device(tensors, what, "tensors")
        _unflatten_op(flat, tensors, _check_scale(scale, what), bool(accumulate), provider or "", True)
        return
    ranges = _Ranges.of(tensors)
    for i in np.flatnonzero(~ranges.contig).tolist():  # a contiguous tensor cannot be expanded
        if _has_internal_overlap(tensors[i]):
            raise ShapeError(f"{what}: tensors[{i}] is expanded (a stride-0 dimension); it cannot be written")
    if tensors[0].device != flat.device:
        raise DeviceMismatchError(f"{what}: flat is on {flat.device} but tensors[0] is on {tensors[0].device}")
    _check_same_device(tensors, what, "tensors")
    scale = _check_scale(scale, what)
    _check_unflatten_memory(flat, tensors, ranges)
    if key is not None and _plain_all(tensors) and not flat.is_meta:
        guards = _guards([flat, *tensors])
        if guards is not None:
            same = flat.is_contiguous() and all(t.dtype == flat.dtype for t in tensors)
            grad = flat.requires_grad or any(t.requires_grad for t in tensors)
            plan = _UnflatPlan(guards=guards, layout=layout, device=flat.device, same=same, grad=grad)
            _UNFLAT_PLANS.put(key, plan)
            return _unflatten_run(plan, key, flat, tensors, scale, bool(accumulate), provider)
    _unflatten_op(flat, tensors, scale, bool(accumulate), provider or "")


def bucket_reduce(
    buffers: Sequence[torch.Tensor] | torch.Tensor,
    *,
    op: str = "sum",
    out: torch.Tensor | None = None,
    provider: str | None = None,
) -> torch.Tensor:
    """Reduce K same-shape buffers elementwise (``op`` = "sum", "avg" or "max") in one launch.

    ``buffers`` is a list of tensors or one tensor stacked along dim 0. Accumulation is in fp32 (fp64 if
    an operand is fp64); "max" propagates NaN. ``out`` (any floating dtype, the buffers' shape,
    contiguous) may be one of the buffers itself, for an in-place reduction.
    """
    if out is None and type(buffers) is list and len(buffers) >= 2 and (op == "sum" or op == "avg" or op == "max"):
        b0 = buffers[0]
        if (
            type(b0) is _T and b0.dtype is _F32 and b0.is_cpu and b0.is_contiguous()
            and all(type(b) is _T and b.dtype is _F32 and b.is_cpu and b.is_contiguous() for b in buffers)
            and all(b.shape == b0.shape for b in buffers)
            and (n := b0.numel())
            and _eager.fast()
            and _reduce.select(_CPU, _F32, n, provider or None) in _TORCH_IMPL
        ):  # fmt: skip
            # The common case, fp32 buffers on the CPU: the torch provider itself into a new tensor, without
            # the flattening views and the custom op.
            return _eager.run(_reduce_torch, buffers, None, op)
    what = "torsh_kernels.bucket_reduce"
    check_provider(provider)
    if isinstance(buffers, torch.Tensor):
        if buffers.dim() == 0:
            raise ShapeError(f"{what}: a stacked buffers tensor needs a leading K dimension, got a scalar")
        buffers = list(buffers.unbind(0))
        if not buffers:
            raise InvalidArgumentError(f"{what}: the stacked buffers tensor has K=0 rows")
    buffers = _check_tensor_list(buffers, what, "buffers")
    names = [f"buffers[{i}]" for i in range(len(buffers))]  # K is small (a world size, a few buffers)
    if op not in REDUCE_OPS:
        raise InvalidArgumentError(f"{what}: op={op!r}; expected one of {', '.join(map(repr, REDUCE_OPS))}")
    b0 = buffers[0]
    for b, n in zip(buffers, names):
        _check_float(b, what, n)
        if b.shape != b0.shape:
            raise ShapeError(f"{what}: {n} has shape {tuple(b.shape)}, buffers[0] has {tuple(b0.shape)}")
        if b.dtype != b0.dtype:
            raise DTypeError(f"{what}: {n} is {b.dtype}, buffers[0] is {b0.dtype}; reduce buffers of one dtype")
    device = _check_same_device(buffers, what, "buffers")
    for b, n in zip(buffers, names):
        _check_strided(b, what, n)
    if out is None:
        if _eager.direct(*buffers):
            return _eager.run(_reduce_impl, buffers, op, provider or "")
        return _reduce_op(buffers, op, provider or "")
    if not isinstance(out, torch.Tensor):
        raise ArgumentTypeError(f"{what}: out must be a torch.Tensor, got {type(out).__name__}")
    _check_float(out, what, "out")
    if out.device != device:
        raise DeviceMismatchError(f"{what}: out is on {out.device}, the buffers on {device}")
    if out.shape != b0.shape:
        raise ShapeError(f"{what}: out has shape {tuple(out.shape)}, the buffers {tuple(b0.shape)}")
    if not out.is_contiguous():
        raise ShapeError(f"{what}: out must be contiguous")
    if _eager.deferred(out, *buffers):  # the memory check runs in the op, at run time
        _reduce_out_op(buffers, out, op, provider or "", True)
        return out
    _check_reduce_out(buffers, out)
    if _eager.direct(*buffers, out):
        _eager.run(_reduce_into, buffers, out, op, provider or "")
        if out.numel():
            _eager.written(_reduce.select(device, b0.dtype, out.numel(), provider or None), out)
        return out
    _reduce_out_op(buffers, out, op, provider or "")
    return out


def wire_cast(
    x: torch.Tensor,
    dtype: torch.dtype | None = None,
    *,
    divisor: float = 1.0,
    out: torch.Tensor | None = None,
    check_finite: bool = True,
    provider: str | None = None,
) -> torch.Tensor:
    """``x``'s elements cast to the wire dtype and divided there: ``dtype(dtype(x) / divisor)`` (the
    division in fp32, then rounded again), in one pass: PyTorch's ``fp16_compress_hook`` arithmetic, bit
    for bit.

    ``dtype``: fp16 (default), bf16 or fp32; with ``out`` it defaults to ``out.dtype``. ``out``: a
    contiguous tensor of x's element count on x's device (x itself when the dtypes match: in place);
    returned, else a new 1-D tensor. ``divisor``: a finite, non-zero number (the world size, for a
    pre-divided all-reduce). With ``check_finite``, NaN/Inf in the result (in the input, or an fp16
    overflow above 65504) raise :class:`NonFiniteError` after ``out`` was written.
    """
    if (
        type(x) is _T and x.dtype is _F32 and x.is_cpu and x.is_contiguous() and (n := x.numel())
        and (divisor.__class__ is float or divisor.__class__ is int) and divisor != 0 and -math.inf < divisor < math.inf
        and (out is None or (type(out) is _T and out.is_cpu and out.is_contiguous() and out.numel() == n
                             and (dtype is None or dtype is out.dtype)))
        and ((wire := out.dtype if out is not None else dtype or torch.float16) in _WIRE_SET)
        and _eager.fast()
        and _wire.select(_CPU, wire, n, provider or None) == "cpu"
        and (out is None or _wire_out_ok(x, out, n))
    ):  # fmt: skip
        # The common case on the CPU with the cpu provider: its kernel straight on the tensors' memory.
        K = _cpu_kernels()
        if out is None:
            out = torch.empty(n, dtype=wire)
        bad = K.wire_cast_ptr(x.data_ptr(), out.data_ptr(), n, K._WIRE[wire], K.np.float32(divisor), divisor != 1)
        _eager.bump(out)
        if bad and check_finite:
            _raise_wire_nonfinite(bad, wire)
        return out
    what = "torsh_kernels.wire_cast"
    check_provider(provider)
    xf = _flat_input(x, what, "x")
    if out is not None:
        if dtype is not None and dtype != getattr(out, "dtype", dtype):
            raise DTypeError(f"{what}: dtype={dtype} but out is {out.dtype}; pass one of them, or matching ones")
        dtype = out.dtype if isinstance(out, torch.Tensor) else dtype
    dtype = dtype or torch.float16
    if dtype not in _WIRE_SET:
        raise DTypeError(f"{what}: dtype={dtype}; expected float16, bfloat16 or float32")
    if isinstance(divisor, bool) or not isinstance(divisor, (int, float)):
        raise ArgumentTypeError(f"{what}: divisor must be a real number, got {type(divisor).__name__}")
    if not math.isfinite(divisor) or divisor == 0:
        raise InvalidArgumentError(f"{what}: divisor={divisor}; expected a finite, non-zero number")
    if out is None:
        out = torch.empty(xf.numel(), dtype=dtype, device=xf.device)
    of = _flat_inout(out, what, "out", xf.numel(), xf.device)
    traced = _eager.deferred(xf, of)  # the memory check then runs in the op, at run time
    if not traced:
        _no_overlap(of, xf, what, "out", "x", same_ok=True)
    if xf.numel():
        _eager.call(_wire_op, (1,), xf, of, float(divisor), bool(check_finite), provider or "", traced)
    return out


def _wire_out_ok(x: torch.Tensor, out: torch.Tensor, n: int) -> bool:
    """``out`` shares no byte with fp32 ``x`` [n], or is x itself (fp32, in place)."""
    px, po = x.data_ptr(), out.data_ptr()
    if po == px and out.dtype is _F32:
        return True
    return po + out.element_size() * n <= px or px + 4 * n <= po


_WIRE_SET = frozenset(WIRE_DTYPES)
_cpu_kernels = _eager.lazy_module("_bucket_cpu")  # the cpu provider's kernels, for the fast paths


# --------------------------------------------------------------------------------------------------
# Tuning spaces (``torsh tune``): the Triton kernels' elements per program and warps

_TUNE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_TUNE_META = {"triton": {"BLOCK": (2048, 1024, 4096, 8192), "num_warps": (4, 2, 8)}}


def _tune_pieces(device, dtype, size, gen):
    k = 7
    sizes = [max(1, size // k + (i * 37) % 101) for i in range(k)]
    return [torch.randn(s, generator=gen).to(dtype).to(device) for s in sizes]


def _tune_make_flatten(device, dtype, size, gen):
    ts = _tune_pieces(device, dtype, size, gen)
    return ts, torch.empty(sum(t.numel() for t in ts), dtype=dtype, device=device)


def _tune_make_unflatten(device, dtype, size, gen):
    ts = _tune_pieces(device, dtype, size, gen)
    flat, layout = flatten(ts, provider="torch")
    flat = torch.randn(flat.numel(), generator=gen).to(dtype).to(device)
    return flat, layout, [torch.empty_like(t) for t in ts]


def _tune_run_unflatten(s, p):
    unflatten(s[0], s[1], s[2], provider=p)
    return torch.cat([t.reshape(-1) for t in s[2]])


def _tune_make_reduce(device, dtype, size, gen):
    bufs = [torch.randn(size, generator=gen).to(dtype).to(device) for _ in range(4)]
    return bufs, torch.empty(size, dtype=dtype, device=device)


def _tune_check_reduce(s, out):
    ref = bucket_reduce_ref(s[0], "sum", s[1].dtype)
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[s[1].dtype]
    return bool(torch.allclose(out.float(), ref.float(), atol=tol, rtol=tol))


register_space(TuneSpace(
    op="flatten", family="bucket", dtypes=_TUNE_DTYPES, meta=_TUNE_META, make=_tune_make_flatten,
    run=lambda s, p: flatten(s[0], out=s[1], provider=p)[0],
    check=lambda s, out: torch.equal(out, torch.cat([t.reshape(-1) for t in s[0]])),
))  # fmt: skip
register_space(TuneSpace(
    op="unflatten", family="bucket", dtypes=_TUNE_DTYPES, meta=_TUNE_META, make=_tune_make_unflatten,
    run=_tune_run_unflatten, check=lambda s, out: torch.equal(out, s[0]),
))  # fmt: skip
register_space(TuneSpace(
    op="bucket_reduce", family="bucket", dtypes=_TUNE_DTYPES, meta=_TUNE_META, make=_tune_make_reduce,
    run=lambda s, p: bucket_reduce(s[0], out=s[1], provider=p), check=_tune_check_reduce,
))  # fmt: skip
