"""CPU kernels (Numba's CPU target) of the top-k op family (see ``providers.py``).

Imported on the cpu provider's first launch.

- The approximate mode's candidate pass: one pass over ``v = x + r`` compacting ``|v| >= threshold`` (in
  index order) into the candidate buffer and counting NaN/Inf.
- The exact selection, used by the cpu provider wherever the exact path runs: ``v = x + r`` into a
  scratch buffer (counting NaN/Inf), the k-th largest magnitude by a selection (``np.partition``, linear
  time), then one pass in index order that keeps every element above it and, of those equal to it, the
  first ones until there are k: the indices come out ascending, no sort; ties go to the lower index.
  With an fp32 ``x`` and residual the residual's update happens in the same pass.
- The scatter of the decompression, with the index range checked before anything is written.
"""

from __future__ import annotations

import numpy as np
import torch

from ...errors import ShapeError
from ..cpu_common import carray, f32, jit, p_f32, p_i32, p_i64, store


@jit
def candidates_arrays(x, r, has_r, thr, cval, cidx):
    """(count of |x + r| >= thr among the finite, number of NaN/Inf); the first ``cval.size`` of them, in
    index order, into ``cval`` (fp32 values) and ``cidx``."""
    cap = cval.size
    count = 0
    bad = 0
    for i in range(x.size):
        v = x[i] + r[i] if has_r else x[i]
        if not np.isfinite(v):
            bad += 1
        elif abs(v) >= thr:
            if count < cap:
                cval[count] = v
                cidx[count] = i
            count += 1
    return count, bad


@jit
def exact_arrays(x, r, has_r, update_r, k, acc, values, idx):
    """The k largest |x + r|: their indices ascending into ``idx`` and fp32 values into ``values``, via
    the scratch ``acc`` [n]; returns the number of NaN/Inf (then nothing is selected or written). With
    ``update_r`` (fp32 ``x``), ``r`` becomes ``x + r`` with 0 where an element was sent."""
    n = x.size
    bad = 0
    for i in range(n):
        v = x[i] + r[i] if has_r else x[i]
        acc[i] = v
        bad += not np.isfinite(v)
    if bad:
        return bad
    a = np.abs(acc)
    if k < n:
        thr = np.partition(a, n - k)[n - k]  # the k-th largest magnitude
    else:
        thr = np.float32(-1.0)
    above = 0
    for i in range(n):
        above += a[i] > thr
    ties = k - above  # how many of the elements equal to thr are kept: the first ones
    j = 0
    for i in range(n):
        ai = a[i]
        keep = ai > thr
        if not keep and ai == thr and ties > 0:
            keep = True
            ties -= 1
        if keep:
            idx[j] = i
            values[j] = acc[i]
            j += 1
        if update_r:
            r[i] = np.float32(0.0) if keep else acc[i]
    return 0


@jit
def scatter_arrays(values, indices, out, alpha, accumulate):
    """``out[indices] (+)= alpha * values`` in fp32, after checking every index against [0, out.size);
    returns -1, or the first index outside (nothing written)."""
    n = out.size
    for i in range(indices.size):
        j = indices[i]
        if j < 0 or j >= n:
            return i
    a32 = np.float32(alpha)
    scaled = alpha != 1.0
    for i in range(indices.size):
        v = values[i] * a32 if scaled else values[i]
        j = indices[i]
        out[j] = out[j] + v if accumulate else v
    return -1


@jit
def exact_ptr(xp, rp, has_r, n, k, accp, vp, ip):
    """:func:`exact_arrays` on addresses: fp32 x, residual (updated) and scratch [n], fp32 values and
    int32 indices [k]."""
    x = carray(p_f32(xp), (n,))
    r = carray(p_f32(rp), (n,)) if has_r else x
    return exact_arrays(x, r, has_r, has_r, k, carray(p_f32(accp), (n,)), carray(p_f32(vp), (k,)),
                        carray(p_i32(ip), (k,)))  # fmt: skip


@jit
def scatter_ptr(vp, ip, wide, k, op, n, alpha):
    """:func:`scatter_arrays` on addresses: fp32 values [k], int64 (``wide``) or int32 indices [k] into
    fp32 out [n] (no accumulation)."""
    v = carray(p_f32(vp), (k,))
    out = carray(p_f32(op), (n,))
    if wide:
        return scatter_arrays(v, carray(p_i64(ip), (k,)), out, alpha, False)
    return scatter_arrays(v, carray(p_i32(ip), (k,)), out, alpha, False)


@jit
def candidates_ptr(xp, rp, has_r, n, thr, vp, ip, wide, cap):
    """:func:`candidates_arrays` on addresses: fp32 x and r [n], fp32 values and int64 (``wide``) or int32
    indices [cap]."""
    x = carray(p_f32(xp), (n,))
    r = carray(p_f32(rp), (n,)) if has_r else x
    v = carray(p_f32(vp), (cap,))
    if wide:
        return candidates_arrays(x, r, has_r, thr, v, carray(p_i64(ip), (cap,)))
    return candidates_arrays(x, r, has_r, thr, v, carray(p_i32(ip), (cap,)))


@jit
def exact_any_ptr(xp, rp, has_r, update_r, n, k, accp, vp, ip, wide):
    """:func:`exact_arrays` on addresses, int64 (``wide``) or int32 indices."""
    x = carray(p_f32(xp), (n,))
    r = carray(p_f32(rp), (n,)) if has_r else x
    acc, v = carray(p_f32(accp), (n,)), carray(p_f32(vp), (k,))
    if wide:
        return exact_arrays(x, r, has_r, update_r, k, acc, v, carray(p_i64(ip), (k,)))
    return exact_arrays(x, r, has_r, update_r, k, acc, v, carray(p_i32(ip), (k,)))


@jit
def scatter_any_ptr(vp, ip, wide, k, op, n, alpha, accumulate):
    """:func:`scatter_arrays` on addresses, with accumulation."""
    v = carray(p_f32(vp), (k,))
    out = carray(p_f32(op), (n,))
    if wide:
        return scatter_arrays(v, carray(p_i64(ip), (k,)), out, alpha, accumulate)
    return scatter_arrays(v, carray(p_i32(ip), (k,)), out, alpha, accumulate)


def candidates(x, r, thr, cap, idx_dtype):
    x = f32(x)
    r = f32(r) if r is not None else None
    cval = torch.empty(cap, dtype=torch.float32)
    cidx = torch.empty(cap, dtype=idx_dtype)
    count, bad = candidates_ptr(x.data_ptr(), r.data_ptr() if r is not None else 0, r is not None, x.numel(),
                                float(thr), cval.data_ptr(), cidx.data_ptr(), idx_dtype is torch.int64,
                                cap)  # fmt: skip
    return cval, cidx, (count, bad)


def exact(x: torch.Tensor, r: torch.Tensor | None, k: int, idx_dtype: torch.dtype):
    """(values fp32 [k], indices ascending [k], non-finite count); with ``r`` the residual is left holding
    ``x + r`` minus what was sent (rounded once into r's dtype), unless the count is not 0."""
    n = x.numel()
    xf = f32(x)
    acc = torch.empty(n, dtype=torch.float32)
    values = torch.empty(k, dtype=torch.float32)
    idx = torch.empty(k, dtype=idx_dtype)
    fused = r is not None and x.dtype is torch.float32 and r.dtype is torch.float32
    rf = f32(r) if r is not None else None
    bad = exact_any_ptr(xf.data_ptr(), rf.data_ptr() if rf is not None else 0, r is not None, fused, n, k,
                        acc.data_ptr(), values.data_ptr(), idx.data_ptr(), idx_dtype is torch.int64)  # fmt: skip
    if r is not None and not fused and not bad:  # a 16-bit x or residual: what the values' rounding leaves
        sent = values.to(x.dtype).float()
        acc.index_put_((idx.long(),), values - sent)
        r.copy_(acc)
    return values, idx, bad


def scatter(values, indices, out, alpha, accumulate, unique) -> None:
    v = f32(values)
    k, n = v.numel(), out.numel()
    bad = store(out, lambda o: scatter_any_ptr(v.data_ptr(), indices.data_ptr(), indices.dtype is torch.int64, k, o,
                                               n, float(alpha), bool(accumulate)))  # fmt: skip
    if bad >= 0:  # validated by the public op; a provider call with a bad index must still not write
        raise ShapeError(f"torsh_kernels.topk_decompress: index {int(indices[bad])} is outside [0, {n}); nothing was "
                         "written")  # fmt: skip
