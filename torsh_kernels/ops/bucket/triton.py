"""Triton kernels of the bucket op family (see ``providers.py``).

Imported by the triton launchers on first use, so ``import torsh_kernels`` does not import Triton. Triton
reads ``TRITON_INTERPRET`` when these kernels are defined, i.e. on that first import.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..triton_common import cast, nonfinite


@triton.jit
def _direction(tensor, flat, TO_FLAT: tl.constexpr):
    """(source, destination) pointers: from the tensor to the flat buffer (flatten) or back (unflatten)."""
    if TO_FLAT:
        return tensor, flat
    else:
        return flat, tensor


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


@triton.jit(do_not_specialize=["scale_bits", "flat_ptr", "tensor_ref"])
def _segment_kernel(
    rows_ptr,
    flat_ptr,
    tensor_ref,
    scale_bits,
    BLOCK: tl.constexpr,
    TO_FLAT: tl.constexpr,
    ALIGN_TENSOR: tl.constexpr,
    ALIGN_FLAT: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    COMPUTE_F64: tl.constexpr,
):
    """dst = cast(src * scale [+ dst]) over one tile of a contiguous segment: flat -> tensor, or tensor -> flat
    with TO_FLAT. A program's row (``tables.copy_plan``), read with one 128-bit load: the tile's tensor
    address, and its flat offset | its element count << 48 (``tables.N_SHIFT``). The host built the
    rows so that every count is a multiple of 16 elements and each side's address (flat_ptr + the offset, for
    the flat side) a multiple of ALIGN_TENSOR / ALIGN_FLAT bytes (16 on at least one side), stated here: the
    accesses on a 16-byte side are 128-bit, on the other as wide as its alignment allows."""
    addr, packed = tl.split(tl.load(rows_ptr + 2 * tl.program_id(0) + tl.arange(0, 2)))
    t = tl.multiple_of(addr.to(tensor_ref.dtype), ALIGN_TENSOR)
    f = tl.multiple_of(flat_ptr + (packed & 0xFFFFFFFFFFFF), ALIGN_FLAT)
    n = tl.multiple_of((packed >> 48).to(tl.int32), 16)
    src, dst = _direction(t, f, TO_FLAT)
    idx = tl.arange(0, BLOCK)
    mask = idx < n
    x = _scaled(tl.load(src + idx, mask=mask), scale_bits, HAS_SCALE, COMPUTE_F64)
    if ACCUMULATE:
        x = tl.load(dst + idx, mask=mask).to(x.dtype) + x
    tl.store(dst + idx, cast(x, dst.dtype.element_ty), mask=mask)


@triton.jit
def _strided_offsets(row, idx, NDIM: tl.constexpr, IDX64: tl.constexpr):
    """Element offsets of linear indices ``idx`` in a gather row's tensor (its last NDIM sizes and strides);
    unsigned division in 32 bits unless IDX64. A row of one dimension (a contiguous piece, a 1-D strided view)
    skips the divisions whatever NDIM is: a branch uniform over the program."""
    ty = tl.int64 if IDX64 else tl.uint32
    off = idx * tl.load(row + 10).to(ty)
    if NDIM > 1:  # noqa: SIM102 (a compile-time test, then a run-time one: kept apart)
        if tl.load(row + 11) > 1:
            s3 = tl.load(row + 6).to(ty)
            r = idx // s3
            off = (idx - r * s3) * tl.load(row + 10).to(ty)
            if NDIM == 2:
                off += r * tl.load(row + 9).to(ty)
            else:
                s2 = tl.load(row + 5).to(ty)
                q = r // s2
                off += (r - q * s2) * tl.load(row + 9).to(ty)
                if NDIM == 3:
                    off += q * tl.load(row + 8).to(ty)
                else:
                    s1 = tl.load(row + 4).to(ty)
                    p = q // s1
                    off += (q - p * s1) * tl.load(row + 8).to(ty) + p * tl.load(row + 7).to(ty)
    return off


@triton.jit(do_not_specialize=["scale_bits", "flat_ptr", "tensor_ref"])
def _gather_kernel(
    rows_ptr,
    tiles_ptr,
    flat_ptr,
    tensor_ref,
    scale_bits,
    BLOCK: tl.constexpr,
    NDIM: tl.constexpr,
    IDX64: tl.constexpr,
    TO_FLAT: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    COMPUTE_F64: tl.constexpr,
):
    """What the segment kernel does, for rows of any layout: strided tensors (the tensor's side walks up to NDIM
    dimensions, the flat side is contiguous) and contiguous pieces (one dimension, stride 1). A row: tensor
    address, flat offset, element count, first tile, sizes 1..3, strides 0..3, dimensions; ``tiles_ptr`` maps
    each program to its row."""
    pid = tl.program_id(0)
    row = rows_ptr + tl.load(tiles_ptr + pid) * 12
    local = pid - tl.load(row + 3).to(tl.int32)
    if IDX64:
        idx = local.to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
        mask = idx < tl.load(row + 2)
    else:
        idx = (local * BLOCK + tl.arange(0, BLOCK)).to(tl.uint32)
        mask = idx < tl.load(row + 2).to(tl.uint32)
    t = tl.load(row).to(tensor_ref.dtype) + _strided_offsets(row, idx, NDIM, IDX64)
    f = flat_ptr + tl.load(row + 1) + idx
    src, dst = _direction(t, f, TO_FLAT)
    x = _scaled(tl.load(src, mask=mask), scale_bits, HAS_SCALE, COMPUTE_F64)
    if ACCUMULATE:
        x = tl.load(dst, mask=mask).to(x.dtype) + x
    tl.store(dst, cast(x, dst.dtype.element_ty), mask=mask)


def copy(plan, flat, tensor_ref, scale_bits: int, has_scale: bool, accumulate: bool, f64: bool, warps: int) -> None:
    """Launch a copy plan (``tables.copy_plan``) between ``flat`` and tensors of ``tensor_ref``'s dtype:
    one launch per variant it holds."""
    for ln in plan:
        common = dict(HAS_SCALE=has_scale, ACCUMULATE=accumulate, COMPUTE_F64=f64, num_warps=warps,
                      enable_fp_fusion=False)  # fmt: skip
        if ln.kernel == "segments":
            _segment_kernel[(ln.n_tiles,)](ln.rows, flat, tensor_ref, scale_bits, **ln.meta, **common)
        else:
            _gather_kernel[(ln.n_tiles,)](ln.rows, ln.tiles, flat, tensor_ref, scale_bits, **ln.meta, **common)


def bucket_reduce(ptrs, out, ref, k: int, op: int, f64: bool, aligned: bool, warps: int, spans) -> None:
    """Reduce the ``k`` buffers at the addresses in ``ptrs`` into ``out`` (``op``: the OP constexpr), one launch
    per (grid, start, end, BLOCK) of ``spans``."""
    for grid, start, end, block in spans:
        _bucket_reduce_kernel[grid](
            ptrs, out, ref, start, end, k,
            BLOCK=block, OP=op, COMPUTE_F64=f64, ALIGNED=aligned, num_warps=warps, enable_fp_fusion=False,
        )  # fmt: skip


def wire_cast(x, out, bad, divisor: float, count_bad: bool, warps: int, spans) -> None:
    """``out = dtype(dtype(x) / divisor)``, counting the NaN/Inf written into ``bad``, one launch per (grid,
    start, end, BLOCK) of ``spans``."""
    for grid, start, end, block in spans:
        _wire_cast_kernel[grid](
            x, out, bad, start, end, float(divisor), BLOCK=block, DIVIDE=divisor != 1.0,
            COUNT_BAD=bool(count_bad), num_warps=warps,
        )  # fmt: skip


@triton.jit
def _buffer_pair(ptrs_ptr, j, K, idx, mask, ref_ptr, OP: tl.constexpr, ALIGNED: tl.constexpr, ACC: tl.constexpr):
    """Buffers 2j and 2j + 1 at ``idx`` in the compute dtype: their two addresses read with one 128-bit load (the
    table is padded to an even length); the second, when 2j + 1 == K, masked to the identity of the reduction
    (-0.0 adds exactly, -inf never wins a max and NaN still propagates)."""
    pa, pb = tl.split(tl.load(ptrs_ptr + 2 * j + tl.arange(0, 2)))
    a = pa.to(ref_ptr.dtype)
    b = pb.to(ref_ptr.dtype)
    if ALIGNED:
        a = tl.multiple_of(a, 16)
        b = tl.multiple_of(b, 16)
    xa = tl.load(a + idx, mask=mask).to(ACC)
    xb = tl.load(b + idx, mask=tl.where(2 * j + 1 < K, mask, False), other=float("-inf") if OP == 2 else -0.0).to(ACC)
    return xa, xb


@triton.jit
def _combine(acc, x, OP: tl.constexpr):
    if OP == 2:
        return tl.maximum(acc, x, propagate_nan=tl.PropagateNan.ALL)
    else:
        return acc + x


@triton.jit
def _bucket_reduce_kernel(
    ptrs_ptr,
    out_ptr,
    ref_ptr,
    start,
    end,
    K,
    BLOCK: tl.constexpr,
    OP: tl.constexpr,
    COMPUTE_F64: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    """out = the K buffers at the addresses in ``ptrs_ptr`` reduced in order, over [start, end) (``common.spans``:
    the bulk's end is divisible by 16), two buffers a step. ALIGNED: the host checked every buffer 16-byte
    aligned, stated here so the loads are 128-bit (``out_ptr``'s alignment Triton specializes itself)."""
    idx = start + tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < end
    ACC: tl.constexpr = tl.float64 if COMPUTE_F64 else tl.float32
    acc, x = _buffer_pair(ptrs_ptr, 0, K, idx, mask, ref_ptr, OP, ALIGNED, ACC)
    acc = _combine(acc, x, OP)
    for j in range(1, (K + 1) // 2):
        xa, xb = _buffer_pair(ptrs_ptr, j, K, idx, mask, ref_ptr, OP, ALIGNED, ACC)
        acc = _combine(_combine(acc, xa, OP), xb, OP)
    if OP == 1:
        acc = acc / K
    tl.store(out_ptr + idx, cast(acc, out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _wire_cast_kernel(
    x_ptr,
    out_ptr,
    bad_ptr,
    start,
    end,
    divisor,
    BLOCK: tl.constexpr,
    DIVIDE: tl.constexpr,
    COUNT_BAD: tl.constexpr,
):
    """out = dtype(dtype(x) / divisor): rounded to the wire dtype, then divided in fp32 and rounded again
    (PyTorch's fp16_compress_hook arithmetic), counting the NaN/Inf it writes into ``bad_ptr`` (int32 when the
    host knows the count fits); over [start, end) (``common.spans``)."""
    offs = start + tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < end
    h = cast(tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32), out_ptr.dtype.element_ty)
    if DIVIDE:
        h = cast(tl.math.div_rn(h.to(tl.float32), divisor), out_ptr.dtype.element_ty)
    tl.store(out_ptr + offs, h, mask=mask)
    if COUNT_BAD:
        bad = tl.sum((nonfinite(h.to(tl.float32)) & mask).to(bad_ptr.dtype.element_ty), axis=0)
        if bad != 0:  # (the common case, all finite: no atomic)
            tl.atomic_add(bad_ptr, bad)
