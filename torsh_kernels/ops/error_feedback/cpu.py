"""CPU kernels (Numba's CPU target) of the error-feedback op family (see ``providers.py``).

Imported on the cpu provider's first launch. One pass each: ``out = x + beta * y`` counting the NaN/Inf
it writes (from the result's bit patterns, so the loop vectorises), and ``residual = acc - approx`` with
``approx`` copied into ``out``; fp32 arithmetic as the torch provider's.
"""

from __future__ import annotations

import numpy as np
import torch

from ..cpu_common import carray, f32, f32_bits, jit, p_f32, store


@jit
def axpby_arrays(x, y, out, beta, count_bad):
    """``out = x + beta * y`` (fp32); the number of non-finite results when ``count_bad``, else 0."""
    n = out.size
    b32 = np.float32(beta)
    bad = 0
    if beta == 1.0:
        for i in range(n):
            v = x[i] + y[i]
            out[i] = v
            bad += (f32_bits(v) & 0x7FFFFFFF) >= 0x7F800000
    else:
        for i in range(n):
            v = x[i] + y[i] * b32
            out[i] = v
            bad += (f32_bits(v) & 0x7FFFFFFF) >= 0x7F800000
    return bad if count_bad else 0


@jit
def error_update_arrays(acc, approx, res, out, has_out):
    """``res = acc - approx`` and (``has_out``) ``out = approx``, fp32; ``res`` may be ``acc``, ``out`` may
    be ``approx``."""
    n = res.size
    if has_out:
        for i in range(n):
            a = approx[i]
            res[i] = acc[i] - a
            out[i] = a
    else:
        for i in range(n):
            res[i] = acc[i] - approx[i]


@jit
def axpby_ptr(xp, yp, op, n, beta, count_bad):
    """:func:`axpby_arrays` on the addresses of fp32 tensors of n elements."""
    return axpby_arrays(carray(p_f32(xp), (n,)), carray(p_f32(yp), (n,)), carray(p_f32(op), (n,)), beta, count_bad)


@jit
def error_update_ptr(ap, pp, rp, op, n, has_out):
    """:func:`error_update_arrays` on the addresses of fp32 tensors of n elements (``op`` unread without
    ``has_out``)."""
    r = carray(p_f32(rp), (n,))
    error_update_arrays(carray(p_f32(ap), (n,)), carray(p_f32(pp), (n,)), r,
                        carray(p_f32(op), (n,)) if has_out else r, has_out)  # fmt: skip


def axpby(x: torch.Tensor, y: torch.Tensor, out: torch.Tensor, beta: float, count_bad: bool) -> int | None:
    x, y = f32(x), f32(y)
    n = out.numel()
    bad = store(out, lambda o: axpby_ptr(x.data_ptr(), y.data_ptr(), o, n, float(beta), bool(count_bad)))
    return bad if count_bad else None


def error_update(acc, approx, res, out) -> None:
    a, p = f32(acc), f32(approx)
    n = res.numel()
    if res.dtype is torch.float32 and (out is None or out.dtype is torch.float32):
        error_update_ptr(a.data_ptr(), p.data_ptr(), res.data_ptr(), out.data_ptr() if out is not None else 0, n,
                         out is not None)  # fmt: skip
        return
    store(res, lambda r: error_update_ptr(a.data_ptr(), p.data_ptr(), r, 0, n, False))
    if out is not None:
        out.copy_(p)
