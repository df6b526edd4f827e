"""Triton device functions shared by the op families' kernels.

Imported by the triton launchers on first use, so ``import torsh_kernels`` does not import Triton. Triton
reads ``TRITON_INTERPRET`` when these kernels are defined, i.e. on that first import.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def cast(x, DST: tl.constexpr):
    """Cast a computed value to DST. fp32 -> bf16 rounds to nearest even in integer ops (what the
    GPU's cvt.rn does), because Triton's interpreter truncates instead; the same code then runs,
    and is tested, in both. fp64 -> bf16 goes through fp32, as PyTorch's conversion does."""
    if tl.bfloat16 == DST:
        b = x.to(tl.float32).to(tl.uint32, bitcast=True)
        r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
        r = tl.where((b & 0x7FFFFFFF) > 0x7F800000, 0x7FC0, r)
        return r.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(DST)


@triton.jit
def nonfinite(v):
    return (v != v) | (tl.abs(v) == float("inf"))


@triton.jit
def _lowbias32(h):
    h = h ^ (h >> 16)
    h = h * 0x7FEB352D
    h = h ^ (h >> 15)
    h = h * 0x846CA68B
    return h ^ (h >> 16)


@triton.jit
def uniform(idx, key):
    h = _lowbias32(_lowbias32(idx.to(tl.uint32)) ^ key)
    return (h >> 8).to(tl.float32) * (1.0 / 16777216.0)


@triton.jit
def load_acc(x_ptr, r_ptr, offs, mask, HAS_R: tl.constexpr):
    v = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_R:
        v = v + tl.load(r_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return v


@triton.jit
def store_out(out_ptr, e, v, end, ACCUMULATE: tl.constexpr, EVEN: tl.constexpr):
    """out[e] = v (plus out[e] with ACCUMULATE, in fp32), rounded to out's dtype; unmasked for a bulk program
    (EVEN), else masked to e < end (a decoder's last step: dequantize, sign_unpack)."""
    if EVEN:
        if ACCUMULATE:
            v = tl.load(out_ptr + e).to(tl.float32) + v
        tl.store(out_ptr + e, cast(v, out_ptr.dtype.element_ty))
    else:
        m = e < end
        if ACCUMULATE:
            v = tl.load(out_ptr + e, mask=m, other=0.0).to(tl.float32) + v
        tl.store(out_ptr + e, cast(v, out_ptr.dtype.element_ty), mask=m)


@triton.jit
def fp8_encode(y, E4M3: tl.constexpr):
    """The fp8 code (int32, 0..255) of fp32 values already saturated (|y| <= the format's max) and not NaN:
    ``ops/quantize/fp8.py``'s ``fp8_bits_py`` in integer ops on the fp32 bits (the interpreter has no rounding
    fp8 cast and sm_80 no fp8 instruction; the same code runs, and is tested, everywhere)."""
    b = y.to(tl.uint32, bitcast=True)
    sign = (b >> 24) & 0x80
    a = b & 0x7FFFFFFF
    if E4M3:
        sub = (tl.abs(y) + 16384.0).to(tl.uint32, bitcast=True) - (141 << 23)
        nor = (a - (120 << 23) + 0x7FFFF + ((a >> 20) & 1)) >> 20
        r = tl.where(a < (121 << 23), sub, nor)
    else:
        sub = (tl.abs(y) + 128.0).to(tl.uint32, bitcast=True) - (134 << 23)
        nor = (a - (112 << 23) + 0xFFFFF + ((a >> 21) & 1)) >> 21
        r = tl.where(a < (113 << 23), sub, nor)
    return (r | sign).to(tl.int32)


@triton.jit
def fp8_decode(c, E4M3: tl.constexpr):
    """The fp32 value of fp8 codes ``c`` (int32, 0..255): ``fp8_value_py``."""
    m = c & 0x7F
    if E4M3:
        sub = m.to(tl.float32) * 0.001953125  # 2**-9
        nor = ((m << 20) + (120 << 23)).to(tl.float32, bitcast=True)
        v = tl.where(m < 8, sub, tl.where(m == 0x7F, float("nan"), nor))
    else:
        sub = m.to(tl.float32) * 1.52587890625e-05  # 2**-16
        bits = tl.where(m >= 0x7C, 0x7F800000 | ((m & 3) << 21), (m << 21) + (112 << 23))
        v = tl.where(m < 4, sub, bits.to(tl.float32, bitcast=True))
    return tl.where((c & 0x80) != 0, -v, v)
