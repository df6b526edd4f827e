"""Torch references of the bucket ops: the plain oracles the tests compare every provider with (any
device, plain PyTorch), and the compute dtype every implementation accumulates in."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .layout import BucketLayout

__all__ = ["bucket_reduce_ref", "compute_dtype", "flatten_ref", "unflatten_ref", "wire_cast_ref"]


def compute_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """fp64 if an operand is fp64, else fp32."""
    return torch.float64 if torch.float64 in dtypes else torch.float32


def flatten_ref(tensors: Sequence[torch.Tensor], dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """Reference flatten: per tensor, upcast, scale, cast to ``dtype``; concatenate."""
    parts = []
    for t in tensors:
        c = compute_dtype(t.dtype, dtype)
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
        c = compute_dtype(t.dtype, flat.dtype)
        v = flat[off : off + n].to(c).view(t.shape) * scale
        if accumulate:
            v = t.to(c) + v
        t.copy_(v.to(t.dtype))


def bucket_reduce_ref(buffers: Sequence[torch.Tensor], op: str, out_dtype: torch.dtype) -> torch.Tensor:
    """Reference reduction: accumulate buffer by buffer, in order, in fp32 (fp64 if any is fp64)."""
    c = compute_dtype(buffers[0].dtype, out_dtype)
    acc = buffers[0].to(c).clone()
    for b in buffers[1:]:
        acc = torch.maximum(acc, b.to(c)) if op == "max" else acc + b.to(c)
    if op == "avg":
        acc = acc / len(buffers)
    return acc.to(out_dtype)


def wire_cast_ref(x: torch.Tensor, dtype: torch.dtype, divisor: float = 1.0) -> torch.Tensor:
    """``dtype(dtype(x) / divisor)``: x rounded to dtype, divided (in fp32, torch's arithmetic for 16-bit
    tensors) and rounded again; the elements of x in order, 1-D."""
    v = x.reshape(-1).to(dtype, copy=True)
    return v.div_(divisor) if divisor != 1.0 else v
