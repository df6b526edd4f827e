"""The bucket family's layout and input checks: :class:`BucketLayout` (where each tensor lives in a flat
bucket), the dtypes and reductions the ops accept, and the checks the public ops (``api.py``) run on their
arguments, memory overlap included."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ...errors import (
    ArgumentTypeError,
    DeviceMismatchError,
    DTypeError,
    InvalidArgumentError,
    LayoutMismatchError,
    ShapeError,
)
from ..common import Ranges

__all__ = [
    "FLOAT_DTYPES",
    "FLOAT_SET",
    "REDUCE_CODE",
    "REDUCE_OPS",
    "WIRE_DTYPES",
    "BucketLayout",
    "check_flat",
    "check_float",
    "check_floats",
    "check_out_clear",
    "check_reduce_out",
    "check_same_device",
    "check_scale",
    "check_tensor_list",
    "check_unflatten_memory",
    "flat_offsets",
    "has_internal_overlap",
]

WIRE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
REDUCE_OPS = ("sum", "avg", "max")
FLOAT_SET = frozenset(FLOAT_DTYPES)
REDUCE_CODE = {"sum": 0, "avg": 1, "max": 2}  # the kernels' OP constexpr


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
            if d not in FLOAT_SET:
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
        check_flat(flat, self, "BucketLayout.views")
        flat = flat.reshape(-1)
        return [flat[o : o + n].view(s) for o, n, s in zip(self.offsets, self.numels, self.shapes)]


# --------------------------------------------------------------------------------------------------
# Validation


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def check_tensor_list(tensors: object, what: str, arg: str) -> list[torch.Tensor]:
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, (list, tuple)):
        raise ArgumentTypeError(f"{what}: {arg} must be a list or tuple of tensors, got {type(tensors).__name__}")
    if not tensors:
        raise InvalidArgumentError(f"{what}: {arg} is empty; pass at least one tensor")
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        i = next(i for i, t in enumerate(tensors) if not isinstance(t, torch.Tensor))
        raise ArgumentTypeError(f"{what}: {arg}[{i}] is a {type(tensors[i]).__name__}, expected a torch.Tensor")
    return list(tensors)


def check_float(t: torch.Tensor, what: str, name: str) -> None:
    if t.dtype not in FLOAT_DTYPES:
        raise DTypeError(
            f"{what}: {name} has dtype {t.dtype}; expected one of float32, float16, bfloat16, float64. "
            f"Convert it (e.g. .float()) or keep it out of the bucket."
        )


def check_floats(tensors: Sequence[torch.Tensor], what: str, arg: str) -> None:
    """All of ``tensors`` floating point (one set pass; the per-tensor walk only to name an offender)."""
    if not {t.dtype for t in tensors} <= FLOAT_SET:
        for i, t in enumerate(tensors):
            check_float(t, what, f"{arg}[{i}]")


def check_same_device(tensors: Sequence[torch.Tensor], what: str, arg: str) -> torch.device:
    dev = tensors[0].device
    if len({t.device for t in tensors}) > 1:
        i = next(i for i, t in enumerate(tensors) if t.device != dev)
        raise DeviceMismatchError(
            f"{what}: all tensors must be on one device; {arg}[0] is on {dev} but {arg}[{i}] is on "
            f"{tensors[i].device}. Move them with .to({str(dev)!r}) first."
        )
    return dev


def check_scale(scale: object, what: str) -> float:
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise ArgumentTypeError(f"{what}: scale must be a real number, got {type(scale).__name__}")
    scale = float(scale)
    if not math.isfinite(scale):
        raise InvalidArgumentError(f"{what}: scale must be finite, got {scale}")
    return scale


def has_internal_overlap(t: torch.Tensor) -> bool:
    """A stride-0 (expanded) dimension of size > 1 makes several elements share memory."""
    return not t.is_contiguous() and any(st == 0 and s > 1 for s, st in zip(t.shape, t.stride()))


def check_flat(flat: object, layout: BucketLayout, what: str) -> torch.Tensor:
    if not isinstance(flat, torch.Tensor):
        raise ArgumentTypeError(f"{what}: flat must be a torch.Tensor, got {type(flat).__name__}")
    check_float(flat, what, "flat")
    if flat.numel() != layout.total:
        raise LayoutMismatchError(
            f"{what}: flat has {flat.numel()} elements but the layout describes {layout.total}; "
            "use the layout returned by the flatten call that produced this buffer"
        )
    return flat


def check_out_clear(tensors: Sequence[torch.Tensor], out: torch.Tensor) -> None:
    hits = np.flatnonzero(Ranges.of(tensors).overlapping(out))
    if hits.size:
        raise ShapeError(
            f"torsh_kernels.flatten: out overlaps tensors[{hits[0]}]; flatten cannot write over its own input"
        )


def check_unflatten_memory(flat: torch.Tensor, tensors: Sequence[torch.Tensor], ranges: Ranges) -> None:
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
        offsets = flat_offsets(tensors)
        for i in hits.tolist():
            t = tensors[i]
            exact = t.dtype == flat.dtype and t.is_contiguous() and t.data_ptr() == fptr + offsets[i] * fsz
            if not exact:
                raise ShapeError(
                    f"{what}: tensors[{i}] overlaps flat other than as its own slice; the result would be undefined"
                )


def check_reduce_out(buffers: Sequence[torch.Tensor], out: torch.Tensor) -> None:
    """``out`` shares no memory with a buffer, unless it is that buffer (an in-place reduction)."""
    for i, (b, hit) in enumerate(zip(buffers, Ranges.of(buffers).overlapping(out))):
        same = b.data_ptr() == out.data_ptr() and b.dtype == out.dtype and b.is_contiguous()
        if hit and not same:
            raise ShapeError(
                f"torsh_kernels.bucket_reduce: out overlaps buffers[{i}] without being the same tensor; the result "
                "would be undefined"
            )


def flat_offsets(tensors: Sequence[torch.Tensor]) -> list[int]:
    """Each tensor's element offset in a dense flat buffer of them, in order."""
    return list(itertools.accumulate((t.numel() for t in tensors[:-1]), initial=0))
