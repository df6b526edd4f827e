"""CPU kernels (Numba's CPU target) of the sign op family (see ``api.py``).

Imported on the cpu provider's first launch. ``sign_compress`` is two passes: ``sum |x + r|`` in fp64
(eight independent accumulators: the additions overlap instead of waiting on one another), then the
packing of the signs of ``x + r`` eight to a byte with the residual's update ``r = v - (+-scale)`` in the
same pass. NaN/Inf are counted only when the sum says there are some. ``sign_decompress`` writes
``+-scale`` per bit.
"""

from __future__ import annotations

import numpy as np
import torch

from ..cpu_common import carray, f32, jit, p_f32, p_u8, store


@jit
def abs_sum_arrays(x, r, has_r):
    """(sum |x + r| in fp64, number of NaN/Inf among x + r); the count is 0 unless the sum is not finite."""
    n = x.size
    acc = np.zeros(8, np.float64)
    m = n - n % 8
    for i in range(0, m, 8):
        for j in range(8):
            v = x[i + j] + r[i + j] if has_r else x[i + j]
            acc[j] += np.float64(abs(v))
    total = 0.0
    for j in range(8):
        total += acc[j]
    for i in range(m, n):
        v = x[i] + r[i] if has_r else x[i]
        total += np.float64(abs(v))
    bad = 0
    if not np.isfinite(total):
        for i in range(n):
            v = x[i] + r[i] if has_r else x[i]
            bad += not np.isfinite(v)
    return total, bad


@jit
def pack_arrays(x, r, has_r, bits, scale):
    """``bits``: bit j of byte i is 1 where ``v = x + r`` at 8i + j is >= 0; with ``has_r``,
    ``r = v - scale`` there, ``v + scale`` elsewhere (``r`` may be read and written: it is the input)."""
    n = x.size
    for i in range(bits.size):
        b = 0
        for j in range(8):
            k = 8 * i + j
            if k < n:
                v = x[k] + r[k] if has_r else x[k]
                if v >= 0:
                    b |= 1 << j
                    if has_r:
                        r[k] = v - scale
                elif has_r:
                    r[k] = v + scale
        bits[i] = b


@jit
def compress_arrays(x, r, has_r, bits, check_finite):
    """Both passes: (scale as fp32, number of NaN/Inf); with ``check_finite`` nothing is packed (and the
    residual is untouched) when the count is not 0."""
    total, bad = abs_sum_arrays(x, r, has_r)
    scale = np.float32(total / x.size)
    if bad == 0 or not check_finite:
        pack_arrays(x, r, has_r, bits, scale)
    return scale, bad


@jit
def unpack_arrays(bits, s, out, accumulate):
    """``out[k] = +-s`` by bit k (``+`` the old value with ``accumulate``), fp32."""
    n = out.size
    for k in range(n):
        v = s if (bits[k >> 3] >> (k & 7)) & 1 else -s
        out[k] = out[k] + v if accumulate else v


@jit
def compress_ptr(xp, rp, has_r, n, bp, check_finite):
    """:func:`compress_arrays` on addresses: fp32 x and residual [n], bits uint8 [ceil(n / 8)]."""
    x = carray(p_f32(xp), (n,))
    return compress_arrays(x, carray(p_f32(rp), (n,)) if has_r else x, has_r, carray(p_u8(bp), ((n + 7) // 8,)),
                           check_finite)  # fmt: skip


@jit
def unpack_ptr(bp, s, op, n):
    """:func:`unpack_arrays` on addresses into a new fp32 out [n]."""
    unpack_arrays(carray(p_u8(bp), ((n + 7) // 8,)), s, carray(p_f32(op), (n,)), False)


@jit
def abs_sum_ptr(xp, rp, has_r, n):
    x = carray(p_f32(xp), (n,))
    return abs_sum_arrays(x, carray(p_f32(rp), (n,)) if has_r else x, has_r)


@jit
def pack_ptr(xp, rp, has_r, n, bp, scale):
    x = carray(p_f32(xp), (n,))
    pack_arrays(x, carray(p_f32(rp), (n,)) if has_r else x, has_r, carray(p_u8(bp), ((n + 7) // 8,)), scale)


@jit
def unpack_any_ptr(bp, s, op, n, accumulate):
    unpack_arrays(carray(p_u8(bp), ((n + 7) // 8,)), s, carray(p_f32(op), (n,)), accumulate)


def abs_sum(x: torch.Tensor, r: torch.Tensor | None) -> tuple[float, int]:
    """(sum |x + r| as a host float, the non-finite count)."""
    x = f32(x)
    r = f32(r) if r is not None else None
    total, bad = abs_sum_ptr(x.data_ptr(), r.data_ptr() if r is not None else 0, r is not None, x.numel())
    return total, bad


def sign_pack(x, r, bits, scale) -> None:
    x = f32(x)
    n, s = x.numel(), np.float32(scale.item())
    if r is None:
        pack_ptr(x.data_ptr(), 0, False, n, bits.data_ptr(), s)
    else:
        store(r, lambda ra: pack_ptr(x.data_ptr(), ra, True, n, bits.data_ptr(), s))


def unpack_scale(scale: torch.Tensor, alpha: float) -> np.float32:
    """What the unpacking writes, ``+-`` this: ``scale`` (one element) rounded to fp32, times ``alpha`` rounded to
    fp32 unless alpha is 1 (the provider's and the public op's fast path's one definition)."""
    s = np.float32(scale.item())
    return s * np.float32(alpha) if alpha != 1.0 else s


def sign_unpack(bits, scale, out, alpha, accumulate) -> None:
    s = unpack_scale(scale, alpha)
    n = out.numel()
    store(out, lambda o: unpack_any_ptr(bits.data_ptr(), s, o, n, bool(accumulate)))
