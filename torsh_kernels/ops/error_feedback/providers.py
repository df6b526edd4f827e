"""Provider implementations of the error-feedback ops, registered per provider (torch, triton, numba, cpu).
Inputs are validated, contiguous and 1-D, on one device (the public ops in ``api.py`` see to it); the
kernels are imported on a provider's first launch (``triton.py``, ``numba.py``, ``cpu.py``).

``axpby`` is also the top-k family's first pass (``acc = x + residual``, counting NaN/Inf).
"""

from __future__ import annotations

import torch

from ..common import BLOCK, WARPS, new_counter, nonfinite_count, spans
from ..registry import Op

__all__ = ["axpby", "error_update_impl"]

axpby = Op("residual_add")
"""``out = x + beta * y`` in fp32: ``axpby(provider, x, y, out, beta, count_bad)`` returns the NaN/Inf count
of ``out`` (a tensor or an int; None without ``count_bad``)."""
error_update_impl = Op("error_update")
"""``res = acc - approx`` and (``out`` not None) ``out = approx``: ``error_update_impl(provider, acc, approx,
res, out)``."""


@axpby.register("torch")
def _axpby_torch(x, y, out, beta, count_bad):
    if beta == 1.0 and out.dtype == x.dtype == y.dtype == torch.float32:
        torch.add(x, y, alpha=beta, out=out)  # one pass, no temporary
        v = out
    else:
        v = x.float() + y.float() * beta if beta != 1.0 else x.float() + y.float()
        out.copy_(v)
    return nonfinite_count(v) if count_bad else None


@axpby.register("triton")
def _axpby_triton(x, y, out, beta, count_bad):
    from . import triton as K

    bad = new_counter(x.device)
    for grid, start, end in spans(x.numel(), BLOCK):
        K._axpby_kernel[grid](x, y, out, bad, start, end, beta, BLOCK=BLOCK, COUNT_BAD=count_bad, num_warps=WARPS,
                              enable_fp_fusion=False)  # fmt: skip
    return bad if count_bad else None


@axpby.register("numba")
def _axpby_numba(x, y, out, beta, count_bad):
    from . import numba as K

    return K.axpby(x, y, out, beta, count_bad)


@axpby.register("cpu")
def _axpby_cpu(x, y, out, beta, count_bad):
    from . import cpu as K

    return K.axpby(x, y, out, beta, count_bad)


@error_update_impl.register("torch")
def _error_update_torch(acc, approx, res, out):
    a = approx.float()
    if res.dtype == acc.dtype == torch.float32:
        torch.sub(acc, a, out=res)  # one pass, no temporary
    else:
        res.copy_(acc.float() - a)
    if out is not None:
        out.copy_(a)


@error_update_impl.register("triton")
def _error_update_triton(acc, approx, res, out):
    from . import triton as K

    block = BLOCK // 2 if out is not None else BLOCK  # four streams: 8 elements a thread keep it at 64 registers
    for grid, start, end in spans(acc.numel(), block):
        K._error_update_kernel[grid](acc, approx, res, out if out is not None else res, start, end, BLOCK=block,
                                     HAS_OUT=out is not None, num_warps=WARPS)  # fmt: skip


@error_update_impl.register("numba")
def _error_update_numba(acc, approx, res, out):
    from . import numba as K

    K.error_update(acc, approx, res, out)


@error_update_impl.register("cpu")
def _error_update_cpu(acc, approx, res, out):
    from . import cpu as K

    K.error_update(acc, approx, res, out)
