"""Provider implementations of the quantization ops, registered per provider (torch, triton, numba, cpu), and
the host step both custom ops take (:func:`quantize_into`, :func:`dequantize_into`: pick the provider, run it
on the device). Inputs are validated, contiguous and 1-D, on one device, and outputs allocated by the public
ops (``api.py``); the kernels are imported on a provider's first launch (``triton.py``, ``numba.py``,
``cpu.py``), so importing the family imports neither Triton nor Numba.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from ..common import LazyNonFiniteCount, as_count, on_device, raise_nonfinite, select_provider, whole_programs
from ..registry import Op, tuned_meta
from .format import QMAX, round_codes

__all__ = [
    "CPU_SLICE",
    "QTAIL",
    "QTILE",
    "QWARPS",
    "dequantize_impl",
    "dequantize_into",
    "quantize_impl",
    "quantize_into",
]

QTILE = 4096
"""Elements per Triton program of the bulk (several quantization blocks; int8 quantize tunes it per shape
bucket, with num_warps)."""
QWARPS = {8: 8, 4: 4}
"""Warps per Triton program of the bulk by bit width: 16 elements a thread for int8 (16 code bytes: a 128-bit
store or load), 32 for int4 (16 packed bytes). Quantizing fp32 to int4 runs 1 warp and QTILE / 4 elements a
program instead: at 4 warps a block's 256 elements (4 a chunk) span two warps, and the reduction across them
and the 8 blocks a thread then touches take 70 registers (80 stochastic), at 1 warp 56 (63)."""
QTAIL = 256
"""Elements per Triton program of the tail (the last partial program's blocks; small: few registers)."""


# On the CPU the torch providers work through the elements in slices of about this many, so that their
# fp32 temporaries stay in cache instead of each costing a full pass of fresh pages (10x at 64 MiB).
CPU_SLICE = 1 << 17

quantize_impl = Op("quantize")
# (x, q, scales, bits, block, stochastic, key) -> the non-finite count (an int, a device counter or a
# LazyNonFiniteCount). x any float dtype, q int8 [n] or uint8 [ceil(n / 2)], scales fp32 [ceil(n / block)].
dequantize_impl = Op("dequantize")
# (q, scales, out, bits, block, alpha, accumulate): out = alpha * codes * scale (+ out with accumulate).


def quantize_into(x, q, scales, bits, block, stochastic, key, check_finite, provider) -> None:
    """``torsh::quantize``'s and ``torsh::quantize_out``'s body: x's codes and scales into q and scales,
    raising :class:`NonFiniteError` afterwards for a non-finite element with ``check_finite``."""
    if x.numel():
        name = select_provider(quantize_impl, x, provider)
        with on_device(x.device):
            bad = quantize_impl(name, x.view(-1), q, scales, bits, block, stochastic, key)
        if check_finite and (b := as_count(bad)):
            raise_nonfinite(b, "torsh_kernels.quantize", "x")


def dequantize_into(q, scales, out, bits, block, alpha, accumulate, provider) -> None:
    """``torsh::dequantize``'s body: the codes' values into ``out``."""
    if out.numel():
        name = select_provider(dequantize_impl, out, provider)
        with on_device(out.device):
            dequantize_impl(name, q, scales, out.view(-1), bits, block, alpha, accumulate)


# --------------------------------------------------------------------------------------------------
# torch


def _slices(n: int, bits: int, block: int, device: torch.device) -> Iterator[tuple[slice, slice, slice]]:
    """(elements, code bytes, scales) of each slice of the torch providers' pass: whole blocks of about
    CPU_SLICE elements on the CPU, everything at once elsewhere (block is even, so int4 bytes never straddle
    two slices)."""
    step = max(block, CPU_SLICE // block * block) if device.type == "cpu" else n
    for a in range(0, n, max(step, 1)):
        b = min(a + step, n)
        codes = slice(a, b) if bits == 8 else slice(a // 2, -(-b // 2))
        yield slice(a, b), codes, slice(a // block, -(-b // block))


@quantize_impl.register("torch")
def _quantize_torch(x, q, scales, bits, block, stochastic, key):
    bad = 0
    for e, c, s in _slices(x.numel(), bits, block, x.device):
        bad += _quantize_torch_range(x[e], q[c], scales[s], bits, block, stochastic, key, e.start)
    return bad


def _quantize_torch_range(x, q, scales, bits, block, stochastic, key, offset):
    n = x.numel()
    nb = scales.numel()
    qmax = QMAX[bits]
    v = x.float()
    blocks = (torch.nn.functional.pad(v, (0, nb * block - n)) if n % block else v).view(nb, block)
    amax = blocks.abs().amax(dim=1)  # NaN/Inf propagate into the block's maximum
    finite = math.isfinite(amax.sum().item())  # all >= 0: finite iff every block is (an overflow rechecks)
    bad_blocks = None if finite else ~torch.isfinite(amax)
    s = amax.div_(qmax) if finite else torch.where(bad_blocks, float("nan"), amax / qmax)
    scales.copy_(s)
    c = round_codes(blocks, s, qmax, stochastic, key, offset).to(torch.int8).view(-1)[:n]
    if bits == 8:
        q.copy_(c)
    else:
        c = torch.nn.functional.pad(c, (0, n % 2)).view(-1, 2) & 15
        q.copy_(c[:, 0] | (c[:, 1] << 4))
    if bad_blocks is None or not bool(bad_blocks.any()):
        return 0
    return int((~torch.isfinite(blocks[bad_blocks])).sum())  # rare: count the elements for the message


@dequantize_impl.register("torch")
def _dequantize_torch(q, scales, out, bits, block, alpha, accumulate):
    for e, c, s in _slices(out.numel(), bits, block, out.device):
        _dequantize_torch_range(q[c], scales[s], out[e], bits, block, alpha, accumulate)


def _dequantize_torch_range(q, scales, out, bits, block, alpha, accumulate):
    n = out.numel()
    if bits == 4:
        b = q.view(torch.int8)
        codes = torch.stack([(b << 4) >> 4, b >> 4], dim=1).view(-1)[:n]  # arithmetic shifts sign-extend
    else:
        codes = q
    v = codes.float().view(-1, block) if n % block == 0 else None
    if v is not None:
        v = (v * scales[:, None]).view(-1)
    else:
        v = codes.float() * scales.repeat_interleave(block)[:n]
    if alpha != 1.0:
        v = v * alpha
    if accumulate:
        v = out.float() + v
    out.copy_(v)


# --------------------------------------------------------------------------------------------------
# triton


def _tiles(n: int, block: int, group: int, bulk: bool = True) -> list[tuple[tuple[int], int, int, bool]]:
    """:func:`common.whole_programs` in quantization blocks of ``block``, as ``(grid, group, start, even)``: the
    bulk in programs of ``group`` blocks, the rest in programs of about QTAIL elements (whole blocks: a block
    never spans two launches)."""
    tail = max(1, min(group, QTAIL // block))
    return [(grid, group if even else tail, start, even)
            for grid, start, even in whole_programs(n, group * block, tail * block, bulk)]  # fmt: skip


@quantize_impl.register("triton")
def _quantize_triton(x, q, scales, bits, block, stochastic, key):
    from . import triton as K

    n = x.numel()
    if bits == 8:  # the tuned configuration (``torsh tune`` runs int8)
        m = tuned_meta("quantize", x.device, x.dtype, n, "triton")
        tile, warps = m.get("QTILE", QTILE), m.get("num_warps", QWARPS[8])
    else:
        tile, warps = (QTILE // 4, 1) if x.dtype == torch.float32 else (QTILE, QWARPS[4])
    # the int4 bulk stores 16-bit words of packed codes: a code buffer at an odd address takes the byte path
    for grid, g, start, even in _tiles(n, block, max(1, tile // block), bulk=bits == 8 or q.data_ptr() % 2 == 0):
        K._quantize_kernel[grid](
            x, q, scales, start, n, key,
            QBLOCK=block, GROUP=g, BITS=bits, QMAXV=QMAX[bits], STOCHASTIC=stochastic, EVEN=even, num_warps=warps,
        )  # fmt: skip
    return LazyNonFiniteCount(scales, lambda: x)  # a block holding NaN/Inf has a NaN scale


@dequantize_impl.register("triton")
def _dequantize_triton(q, scales, out, bits, block, alpha, accumulate):
    from . import triton as K

    n = out.numel()
    for grid, g, start, even in _tiles(n, block, max(1, QTILE // block)):
        K._dequantize_kernel[grid](
            q, scales, out, start, n, alpha,
            QBLOCK=block, GROUP=g, BITS=bits, ACCUMULATE=accumulate, EVEN=even, num_warps=QWARPS[bits],
            enable_fp_fusion=False,
        )  # fmt: skip


# --------------------------------------------------------------------------------------------------
# numba (CUDA) and cpu (Numba's CPU target): the kernel modules' launchers


@quantize_impl.register("numba")
def _quantize_numba(x, q, scales, bits, block, stochastic, key):
    from . import numba as K

    return K.quantize(x, q, scales, bits, block, stochastic, key)


@quantize_impl.register("cpu")
def _quantize_cpu(x, q, scales, bits, block, stochastic, key):
    from . import cpu as K

    return K.quantize(x, q, scales, bits, block, stochastic, key)


@dequantize_impl.register("numba")
def _dequantize_numba(q, scales, out, bits, block, alpha, accumulate):
    from . import numba as K

    K.dequantize(q, scales, out, bits, block, alpha, accumulate)


@dequantize_impl.register("cpu")
def _dequantize_cpu(q, scales, out, bits, block, alpha, accumulate):
    from . import cpu as K

    K.dequantize(q, scales, out, bits, block, alpha, accumulate)
