"""The anchors of ``torsh inspect``: a plain Triton copy kernel and a plain Triton cast kernel, the reference a
memory-bound kernel's machine code is read against ("what good looks like" for the same bytes).

Imported by :mod:`.inspection` on first use (it imports Triton).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["BLOCK", "WARPS", "cast", "copy"]

BLOCK = 2048
WARPS = 4


@triton.jit
def copy_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=m), mask=m)


@triton.jit
def cast_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=m).to(y_ptr.dtype.element_ty), mask=m)


def copy(x: torch.Tensor, y: torch.Tensor) -> None:
    """y = x (1-D, the same dtype), the best case: 16-byte aligned, a size divisible by 16."""
    copy_kernel[(triton.cdiv(x.numel(), BLOCK),)](x, y, x.numel(), BLOCK=BLOCK, num_warps=WARPS)


def cast(x: torch.Tensor, y: torch.Tensor) -> None:
    """y = x.to(y.dtype) (1-D), the best case as for :func:`copy`."""
    cast_kernel[(triton.cdiv(x.numel(), BLOCK),)](x, y, x.numel(), BLOCK=BLOCK, num_warps=WARPS)
