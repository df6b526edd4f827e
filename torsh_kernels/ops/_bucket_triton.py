"""Triton kernels of the bucket op family (see bucket.py).

Imported by the triton launchers on first use, so ``import torsh_kernels`` does not import Triton. Triton
reads ``TRITON_INTERPRET`` when these kernels are defined, i.e. on that first import.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._triton import _cast, _nonfinite


@triton.jit
def _element_offsets(row, idx):
    """Element offsets (from the tensor's address) of linear indices ``idx`` of one table row."""
    contig = tl.load(row + 4)
    if contig != 0:
        off = idx
    else:
        s1 = tl.load(row + 5)
        s2 = tl.load(row + 6)
        s3 = tl.load(row + 7)
        i3 = idx % s3
        r = idx // s3
        i2 = r % s2
        r = r // s2
        i1 = r % s1
        i0 = r // s1
        off = i0 * tl.load(row + 8) + i1 * tl.load(row + 9) + i2 * tl.load(row + 10) + i3 * tl.load(row + 11)
    return off


@triton.jit
def _tile(table_ptr, tile_ptr, BLOCK: tl.constexpr, NCOL: tl.constexpr):
    """This program's table row, its tensor's offset in the flat buffer, its indices and mask."""
    pid = tl.program_id(0).to(tl.int64)
    row = table_ptr + tl.load(tile_ptr + pid).to(tl.int64) * NCOL
    idx = (pid - tl.load(row + 3)) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    return row, tl.load(row + 2), idx, idx < tl.load(row + 1)


@triton.jit
def _scaled(x, scale_bits, HAS_SCALE: tl.constexpr, COMPUTE_F64: tl.constexpr):
    """x in the compute dtype, times the scale (passed as its fp64 bits; rounded once for fp32)."""
    if COMPUTE_F64:
        x = x.to(tl.float64)
    else:
        x = x.to(tl.float32)
    if HAS_SCALE:
        s = scale_bits.to(tl.int64).to(tl.float64, bitcast=True)
        if not COMPUTE_F64:
            s = s.to(tl.float32)
        x = x * s
    return x


@triton.jit(do_not_specialize=["scale_bits"])
def _flatten_kernel(
    table_ptr,
    tile_ptr,
    out_ptr,
    ref_ptr,
    scale_bits,
    BLOCK: tl.constexpr,
    NCOL: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    COMPUTE_F64: tl.constexpr,
):
    row, flat_off, idx, mask = _tile(table_ptr, tile_ptr, BLOCK, NCOL)
    src = tl.load(row).to(ref_ptr.dtype)
    x = _scaled(tl.load(src + _element_offsets(row, idx), mask=mask), scale_bits, HAS_SCALE, COMPUTE_F64)
    tl.store(out_ptr + flat_off + idx, _cast(x, out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["scale_bits"])
def _unflatten_kernel(
    table_ptr,
    tile_ptr,
    flat_ptr,
    ref_ptr,
    scale_bits,
    BLOCK: tl.constexpr,
    NCOL: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    COMPUTE_F64: tl.constexpr,
):
    row, flat_off, idx, mask = _tile(table_ptr, tile_ptr, BLOCK, NCOL)
    dst = tl.load(row).to(ref_ptr.dtype) + _element_offsets(row, idx)
    x = _scaled(tl.load(flat_ptr + flat_off + idx, mask=mask), scale_bits, HAS_SCALE, COMPUTE_F64)
    if ACCUMULATE:
        x = tl.load(dst, mask=mask).to(x.dtype) + x
    tl.store(dst, _cast(x, ref_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _bucket_reduce_kernel(
    ptrs_ptr,
    out_ptr,
    ref_ptr,
    numel,
    K,
    BLOCK: tl.constexpr,
    OP: tl.constexpr,
    COMPUTE_F64: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    idx = pid * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    mask = idx < numel
    acc = tl.load(tl.load(ptrs_ptr).to(ref_ptr.dtype) + idx, mask=mask)
    if COMPUTE_F64:
        acc = acc.to(tl.float64)
    else:
        acc = acc.to(tl.float32)
    for k in range(1, K):
        x = tl.load(tl.load(ptrs_ptr + k).to(ref_ptr.dtype) + idx, mask=mask).to(acc.dtype)
        if OP == 2:
            acc = tl.maximum(acc, x, propagate_nan=tl.PropagateNan.ALL)
        else:
            acc = acc + x
    if OP == 1:
        acc = acc / K
    tl.store(out_ptr + idx, _cast(acc, out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _wire_cast_kernel(
    x_ptr,
    out_ptr,
    bad_ptr,
    n,
    divisor,
    BLOCK: tl.constexpr,
    DIVIDE: tl.constexpr,
    COUNT_BAD: tl.constexpr,
):
    """out = dtype(dtype(x) / divisor): rounded to the wire dtype, then divided in fp32 and rounded again
    (PyTorch's fp16_compress_hook arithmetic), counting the NaN/Inf it writes."""
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    mask = offs < n
    h = _cast(tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32), out_ptr.dtype.element_ty)
    if DIVIDE:
        h = _cast(tl.math.div_rn(h.to(tl.float32), divisor), out_ptr.dtype.element_ty)
    tl.store(out_ptr + offs, h, mask=mask)
    if COUNT_BAD:
        bad = tl.sum((_nonfinite(h.to(tl.float32)) & mask).to(tl.int64), axis=0)
        tl.atomic_add(bad_ptr, bad)
