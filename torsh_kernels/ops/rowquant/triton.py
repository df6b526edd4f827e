"""Triton kernels of the row ops (see api.py).

Imported by the triton launchers on first use. A program handles TILES scale tiles of one output row (a
[TILES, BLOCK] block of channels, about 1024): ``quantize_rows`` loads the source row's channels (row
``index[n]``; -1 a zero row), takes each tile's absmax and scale, and stores the codes and the scales into the
packed row; ``dequantize_rows`` loads codes and scales of packed row ``index[n]`` and stores ``code * scale`` in
the output's dtype. Channels past H are masked; when H is a multiple of the program's width (``EVEN``) and rows
are not gathered, nothing is masked, and H, the row bytes and the pointers divisible by 16 (the JIT specializes
them) let loads and stores be 128-bit wide. Divisions are correctly rounded (``div_rn``), as torch's.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..triton_common import cast, fp8_decode, fp8_encode


@triton.jit
def _quantize_rows_kernel(
    x_ptr, idx_ptr, p_ptr, H, RB, A, NT, QMAXV: tl.constexpr, FMT: tl.constexpr, BLOCK: tl.constexpr,
    TILES: tl.constexpr, HAS_INDEX: tl.constexpr, EVEN: tl.constexpr,
):  # fmt: skip
    n = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    col = g * (TILES * BLOCK) + tl.arange(0, TILES * BLOCK)
    if HAS_INDEX:
        src = tl.load(idx_ptr + n)
        v = tl.load(x_ptr + tl.maximum(src, 0) * H + col, mask=col < tl.where(src >= 0, H, 0), other=0.0)
        v = v.to(tl.float32)
    elif EVEN:
        v = tl.load(x_ptr + n * H + col).to(tl.float32)
    else:
        v = tl.load(x_ptr + n * H + col, mask=col < H, other=0.0).to(tl.float32)
    v = tl.reshape(v, [TILES, BLOCK])
    a = tl.abs(v)
    amax = tl.max(tl.where(a == a, a, float("inf")), axis=1)  # [TILES]: inf iff the tile holds NaN or Inf
    s = tl.where(amax == float("inf"), float("nan"), tl.math.div_rn(amax, QMAXV))
    sb = s[:, None]
    y = tl.where(sb > 0, tl.math.div_rn(v, tl.where(sb > 0, sb, 1.0)), 0.0)
    y = tl.minimum(tl.maximum(y, -QMAXV), QMAXV)
    if FMT == 2:
        code = ((y + 12582912.0) - 12582912.0).to(tl.int32) & 0xFF  # 1.5 * 2**23: round half to even
    else:
        code = fp8_encode(y, FMT == 0)
    code = tl.reshape(code, [TILES * BLOCK]).to(tl.uint8)
    row = p_ptr + n * RB
    if EVEN and not HAS_INDEX:
        tl.store(row + col, code)
    else:
        tl.store(row + col, code, mask=col < H)
    tile = g * TILES + tl.arange(0, TILES)
    tl.store((row + A).to(tl.pointer_type(tl.float32)) + tile, s, mask=tile < NT)
    if g == 0:  # the padding bytes between the codes and the scales
        pc = H + tl.arange(0, 4)
        tl.store(row + pc, tl.zeros([4], dtype=tl.uint8), mask=pc < A)


@triton.jit
def _dequantize_rows_kernel(
    p_ptr, idx_ptr, out_ptr, H, RB, A, NT, FMT: tl.constexpr, BLOCK: tl.constexpr, TILES: tl.constexpr,
    HAS_INDEX: tl.constexpr, EVEN: tl.constexpr,
):  # fmt: skip
    n = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    col = g * (TILES * BLOCK) + tl.arange(0, TILES * BLOCK)
    tile = g * TILES + tl.arange(0, TILES)
    if HAS_INDEX:
        src = tl.load(idx_ptr + n)
        row = p_ptr + tl.maximum(src, 0) * RB
        c = tl.load(row + col, mask=col < tl.where(src >= 0, H, 0), other=0).to(tl.int32)
        s = tl.load((row + A).to(tl.pointer_type(tl.float32)) + tile, mask=tile < tl.where(src >= 0, NT, 0), other=0.0)
    else:
        row = p_ptr + n * RB
        if EVEN:
            c = tl.load(row + col).to(tl.int32)
        else:
            c = tl.load(row + col, mask=col < H, other=0).to(tl.int32)
        s = tl.load((row + A).to(tl.pointer_type(tl.float32)) + tile, mask=tile < NT, other=0.0)
    if FMT == 2:
        v = (c - ((c & 0x80) << 1)).to(tl.float32)
    else:
        v = fp8_decode(c, FMT == 0)
    v = tl.reshape(v, [TILES, BLOCK]) * s[:, None]
    v = cast(tl.reshape(v, [TILES * BLOCK]), out_ptr.dtype.element_ty)
    if EVEN:
        tl.store(out_ptr + n * H + col, v)
    else:
        tl.store(out_ptr + n * H + col, v, mask=col < H)


_FMT = {"e4m3": 0, "e5m2": 1, "int8": 2}
_QMAX = {"e4m3": 448.0, "e5m2": 57344.0, "int8": 127.0}
WIDTH = 1024
"""Channels per program (TILES * BLOCK), for blocks up to it."""


def _grid(H: int, block: int, rows: int) -> tuple[tuple[int, int], int, int, bool, int]:
    """(grid, tiles, tiles per program, EVEN, warps): 16 channels a thread, so that one-byte codes move in
    128-bit accesses too."""
    nt = -(-H // block)
    tiles = min(triton.next_power_of_2(nt), max(1, WIDTH // block))
    width = tiles * block
    return (rows, -(-nt // tiles)), nt, tiles, H % width == 0, max(1, min(8, width // (32 * 16)))


def quantize_rows(x, index, packed, fmt, block) -> None:
    H = x.shape[1]
    N, RB = packed.shape
    A = -(-H // 4) * 4
    grid, nt, tiles, even, warps = _grid(H, block, N)
    _quantize_rows_kernel[grid](
        x, index if index is not None else packed, packed, H, RB, A, nt, QMAXV=_QMAX[fmt], FMT=_FMT[fmt],
        BLOCK=block, TILES=tiles, HAS_INDEX=index is not None, EVEN=even, num_warps=warps,
    )  # fmt: skip


def dequantize_rows(packed, index, out, fmt, block) -> None:
    N, H = out.shape
    RB = packed.shape[1]
    A = -(-H // 4) * 4
    grid, nt, tiles, even, warps = _grid(H, block, N)
    _dequantize_rows_kernel[grid](
        packed, index if index is not None else packed, out, H, RB, A, nt, FMT=_FMT[fmt], BLOCK=block,
        TILES=tiles, HAS_INDEX=index is not None, EVEN=even, num_warps=warps, enable_fp_fusion=False,
    )  # fmt: skip
