"""Triton kernels of the error-feedback op family (see ``providers.py``).

Imported by the triton launchers on first use, so ``import torsh_kernels`` does not import Triton. Triton
reads ``TRITON_INTERPRET`` when these kernels are defined, i.e. on that first import.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..triton_common import cast, nonfinite


@triton.jit
def _axpby_kernel(x_ptr, y_ptr, out_ptr, bad_ptr, start, end, beta, BLOCK: tl.constexpr, COUNT_BAD: tl.constexpr):
    """out = x + beta * y in fp32 over [start, end) (see common.spans); optionally count non-finite results."""
    offs = start + tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < end
    v = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
    v = v + beta * tl.load(y_ptr + offs, mask=m, other=0.0).to(tl.float32)
    if COUNT_BAD:
        tl.atomic_add(bad_ptr, tl.sum((nonfinite(v) & m).to(tl.int64)))
    tl.store(out_ptr + offs, cast(v, out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _error_update_kernel(acc_ptr, approx_ptr, res_ptr, out_ptr, start, end, BLOCK: tl.constexpr,
                         HAS_OUT: tl.constexpr):  # fmt: skip
    """residual = acc - approx; out = approx (cast), over [start, end) (see common.spans)."""
    offs = start + tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < end
    a = tl.load(approx_ptr + offs, mask=m, other=0.0).to(tl.float32)
    v = tl.load(acc_ptr + offs, mask=m, other=0.0).to(tl.float32) - a
    tl.store(res_ptr + offs, cast(v, res_ptr.dtype.element_ty), mask=m)
    if HAS_OUT:
        tl.store(out_ptr + offs, cast(a, out_ptr.dtype.element_ty), mask=m)
