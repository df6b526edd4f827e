"""Torch references of the top-k ops: the plain oracles the tests compare every provider with (any device,
plain PyTorch), and the definitions every module of the family shares: k for a density ratio
(:func:`topk_count`, with its ratio check :func:`check_ratio`) and the indices' dtype (:func:`index_dtype`)."""

from __future__ import annotations

import math

import torch

from ...checks import check_int
from ...errors import ArgumentTypeError, InvalidArgumentError, NonFiniteError
from ..common import acc_ref

__all__ = ["check_ratio", "index_dtype", "topk_compress_ref", "topk_count", "topk_decompress_ref"]


def check_ratio(ratio: object, what: str) -> float:
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)):
        raise ArgumentTypeError(f"{what}: ratio must be a number in (0, 1], got {type(ratio).__name__}")
    if not (0.0 < ratio <= 1.0):
        raise InvalidArgumentError(f"{what}: ratio must be in (0, 1] (the fraction of elements sent), got {ratio}")
    return float(ratio)


def topk_count(numel: int, ratio: float) -> int:
    """k for a density ``ratio`` of ``numel`` elements: ceil(ratio * numel), at least 1."""
    if numel.__class__ is not int or ratio.__class__ is not float:  # (the callers' common types: no checks)
        check_int(numel, "torsh_kernels.topk_count", "numel", 0)
        ratio = check_ratio(ratio, "torsh_kernels.topk_count")
    elif numel < 0 or not 0.0 < ratio <= 1.0:
        check_int(numel, "torsh_kernels.topk_count", "numel", 0)
        check_ratio(ratio, "torsh_kernels.topk_count")
    return min(numel, max(1, math.ceil(ratio * numel)))


def index_dtype(numel: int) -> torch.dtype:
    return torch.int32 if numel < 2**31 else torch.int64


def topk_compress_ref(
    x: torch.Tensor, *, ratio: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact top-k of |x + residual| by torch.topk, indices ascending; residual keeps what was not sent."""
    acc = acc_ref(x, residual)
    if torch.compiler.is_compiling():  # no host read while tracing: a run-time assertion (a RuntimeError)
        torch._assert_async(torch.isfinite(acc).all(), "topk_compress_ref: non-finite input")
    elif not torch.isfinite(acc).all():
        raise NonFiniteError("topk_compress_ref: non-finite input")
    k = topk_count(acc.numel(), ratio)
    idx = torch.topk(acc.abs(), k, sorted=False).indices.sort().values
    values = acc[idx].to(x.dtype)
    if residual is not None:
        acc[idx] -= values.float()
        residual.view(-1).copy_(acc)
    return values, idx.to(index_dtype(acc.numel()))


def topk_decompress_ref(values, indices, numel, *, out=None, accumulate=False, alpha=1.0) -> torch.Tensor:
    if out is None:
        out = torch.zeros(numel, dtype=values.dtype, device=values.device)
    acc = out.reshape(-1).float() if accumulate else torch.zeros(numel, device=values.device)
    acc.index_add_(0, indices.long(), values.float() * alpha)
    out.view(-1).copy_(acc)
    return out
