"""Provider implementations of the top-k ops, registered per provider (torch, triton, numba, cpu): the
approximate mode's candidate pass (``candidates_impl``, the registry's ``topk_compress``) and the scatter of
the decompression and of the residual's update (``scatter_impl``, ``topk_decompress``). Inputs are validated,
contiguous and 1-D, on one device (``api.py``); the kernels are imported on a provider's first launch
(``triton.py``, ``numba.py``, ``cpu.py``), so importing the family imports neither Triton nor Numba.
"""

from __future__ import annotations

import torch

from ..common import VEC, acc_torch, new_counter, nonfinite_count, scratch_buffer, spans
from ..registry import Op

__all__ = ["CAND_BLOCK", "CAND_WARPS", "SCATTER_BLOCK", "SCATTER_WARPS", "candidates_impl", "scatter_impl"]

# candidates: (x, r, thr, cap, idx_dtype) -> (cval fp32 [cap], cidx [cap], cnt = (count, non-finite)): the
# elements with |x + r| >= thr, the first cap of them kept; cnt an int64 [2] tensor or a host tuple
candidates_impl = Op("topk_compress")
# scatter: (values, indices, out, alpha, accumulate, unique): out[idx] (+)= alpha * values; ``unique``
# promises no repeated index (no atomics needed)
scatter_impl = Op("topk_decompress")

# Triton launches (see triton.py): the candidate pass's int32 block scan and one-element compaction stores keep
# 8 elements a thread under 64 registers (16 took 124-129); the scatter's 64-bit scattered addresses likewise.
CAND_BLOCK, CAND_WARPS = 4096, 16
SCATTER_BLOCK, SCATTER_WARPS = 1024, 4


def _spans(n: int, block: int, warps: int) -> list[tuple[tuple[int], int, int, int, int]]:
    """:func:`common.spans` with each launch's block and warps: the tail (fewer than VEC elements) is one
    program of one warp over VEC elements, not a block of ``block`` elements nearly all masked off."""
    return [(g, s, e, block, warps) if e - s >= VEC else (g, s, e, VEC, 1) for g, s, e in spans(n, block)]


@candidates_impl.register("torch")
def _cand_torch(x, r, thr, cap, idx_dtype):
    # |x + r| in a per-thread scratch buffer (no 4-byte-per-element allocation and first touch per call);
    # the candidates' signed values are re-read from x and r, k elements instead of n
    a = scratch_buffer(x.device, x.numel())
    if r is None:
        a.copy_(x)
    elif x.dtype == r.dtype == torch.float32:
        torch.add(x, r, out=a)
    else:
        a.copy_(acc_torch(x, r))
    bad = nonfinite_count(a)
    a.abs_()
    sel = a >= thr  # NaN compares false
    if bool(bad):
        sel &= torch.isfinite(a)
    idx = sel.nonzero().view(-1)
    cnt = torch.cat([idx.new_tensor([idx.numel()]), bad.to(idx.dtype)])
    idx = idx[:cap]
    return acc_torch(x[idx], r[idx] if r is not None else None), idx.to(idx_dtype), cnt


@candidates_impl.register("triton")
def _cand_triton(x, r, thr, cap, idx_dtype):
    from . import triton as K

    cval = torch.empty(cap, dtype=torch.float32, device=x.device)
    cidx = torch.empty(cap, dtype=idx_dtype, device=x.device)
    cnt = new_counter(x.device, 2)
    vec = 16 // min(x.element_size(), (r if r is not None else x).element_size())  # elements in 16 bytes
    for grid, start, end, block, warps in _spans(x.numel(), CAND_BLOCK, CAND_WARPS):
        K._topk_candidates_kernel[grid](x, r if r is not None else x, cval, cidx, cnt, start, end, thr, cap,
                                        BLOCK=block, VEC=vec, HAS_R=r is not None, num_warps=warps)  # fmt: skip
    return cval, cidx, cnt


@candidates_impl.register("numba")
def _cand_numba(x, r, thr, cap, idx_dtype):
    from . import numba as K

    return K.candidates(x, r, thr, cap, idx_dtype)


@candidates_impl.register("cpu")
def _cand_cpu(x, r, thr, cap, idx_dtype):
    from . import cpu as K

    return K.candidates(x, r, thr, cap, idx_dtype)


@scatter_impl.register("torch")
def _scatter_torch(values, indices, out, alpha, accumulate, unique):
    v = values.float() * alpha if alpha != 1.0 else values.float()
    idx = indices.long()
    if accumulate:
        if out.dtype == torch.float32:
            out.index_add_(0, idx, v)
        else:
            acc = out.float()
            acc.index_add_(0, idx, v)
            out.copy_(acc)
    else:
        out.scatter_(0, idx, v.to(out.dtype))  # (out[idx] = v, without advanced indexing's Python cost)


def _scatter_with(launch, values, indices, out, alpha, accumulate, unique):
    """Repeated indices with a 16-bit destination accumulate in an fp32 copy (no 16-bit atomics)."""
    if accumulate and not unique and out.dtype != torch.float32:
        acc = out.float()
        launch(values, indices, acc, alpha, True, True)
        out.copy_(acc)
    else:
        launch(values, indices, out, alpha, accumulate, accumulate and not unique)


@scatter_impl.register("triton")
def _scatter_triton(values, indices, out, alpha, accumulate, unique):
    from . import triton as K

    def launch(values, indices, out, alpha, accumulate, atomic):
        vec = 16 // min(values.element_size(), indices.element_size())  # elements in 16 bytes
        for grid, start, end, block, warps in _spans(values.numel(), SCATTER_BLOCK, SCATTER_WARPS):
            K._scatter_kernel[grid](values, indices, out, start, end, out.numel(), alpha, BLOCK=block, VEC=vec,
                                    ACCUMULATE=accumulate, ATOMIC=atomic, num_warps=warps)  # fmt: skip

    _scatter_with(launch, values, indices, out, alpha, accumulate, unique)


@scatter_impl.register("numba")
def _scatter_numba(values, indices, out, alpha, accumulate, unique):
    from . import numba as K

    _scatter_with(K.scatter, values, indices, out, alpha, accumulate, unique)


@scatter_impl.register("cpu")
def _scatter_cpu(values, indices, out, alpha, accumulate, unique):
    from . import cpu as K

    K.scatter(values, indices, out, alpha, accumulate, unique)
