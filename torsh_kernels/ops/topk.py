"""Top-k sparsification ops: topk_compress (with error feedback) and topk_decompress.

- ``topk_compress(x, ratio=, residual=, exact=)`` -> ``(values, indices)``: the k = ceil(ratio * n)
  largest magnitudes of ``x + residual``, indices ascending (int32 when n < 2**31). With a residual, the
  residual is left holding exactly what was not sent: ``x + residual_old - scatter(values)``.
  *Approximate mode* (the default, as in Deep Gradient Compression): a threshold is estimated from a
  strided sample, one fused pass compacts the candidates ``|v| >= threshold`` into a buffer of
  ``CAP = k + ceil(TOPK_SLACK * k)`` slots, and the k largest candidates are kept. The estimate is
  *refined* (threshold re-estimated from the sample with the observed count) when the candidate count
  misses the band ``[k, CAP]``: below k (too few) or above ``(1 + TOPK_SLACK) * k`` (overflow), at most
  ``TOPK_REFINE`` times, then the exact path runs. Whenever the count lands in the band, every one of
  the true top k is a candidate, so the result equals the exact top-k (ties at the threshold may be
  broken differently); what is approximate is the threshold, and its cost is one pass plus a top-k
  over at most CAP elements instead of a top-k over n. When the sample would hold every element (n up
  to ``TOPK_MIN_SAMPLE``), approximate mode takes the exact path: the sample's top-k would already be a
  top-k over all n. ``exact=True`` selects with a top-k over all n.
- ``topk_decompress(values, indices, numel, out=, accumulate=, alpha=)``: scatter (or scatter-add, with
  duplicate indices summed: the all-gathered payloads of several ranks) ``alpha * values``.

See ``common`` for what the compression families share (fp32 compute, the non-finite checks).
"""

from __future__ import annotations

import math

import torch

from ..checks import check_int
from ..errors import (
    ArgumentTypeError,
    DeviceMismatchError,
    DTypeError,
    InvalidArgumentError,
    NonFiniteError,
    ShapeError,
)
from . import eager
from .common import (
    HOST_BYTES,
    VEC,
    acc_ref,
    acc_torch,
    as_count,
    check_alpha,
    check_dtype,
    check_tensor,
    decode_out,
    finite_sum,
    flat_inout,
    flat_input,
    new_counter,
    no_overlap,
    nonfinite_count,
    on_device,
    raise_nonfinite,
    scratch_buffer,
    select_provider,
    spans,
)
from .error_feedback import axpby
from .registry import Op, check_provider

__all__ = ["index_dtype", "topk_compress", "topk_compress_ref", "topk_count", "topk_decompress", "topk_decompress_ref"]


# Top-k approximate mode: candidate buffer slack over k, and refinement rounds before the exact path.
TOPK_SLACK = 0.25
TOPK_REFINE = 4
TOPK_MIN_SAMPLE = 65536
TOPK_SAMPLE_PER_K = 1024  # the sample holds about this many expected top-k elements (when n allows)
_TOPK_TARGET = 1 + TOPK_SLACK / 2  # aim at the middle of the band


def topk_count(numel: int, ratio: float) -> int:
    """k for a density ``ratio`` of ``numel`` elements: ceil(ratio * numel), at least 1."""
    if numel.__class__ is not int or ratio.__class__ is not float:  # (the callers' common types: no checks)
        check_int(numel, "torsh_kernels.topk_count", "numel", 0)
        ratio = _check_ratio(ratio, "torsh_kernels.topk_count")
    elif numel < 0 or not 0.0 < ratio <= 1.0:
        check_int(numel, "torsh_kernels.topk_count", "numel", 0)
        _check_ratio(ratio, "torsh_kernels.topk_count")
    return min(numel, max(1, math.ceil(ratio * numel)))


def index_dtype(numel: int) -> torch.dtype:
    return torch.int32 if numel < 2**31 else torch.int64


# --------------------------------------------------------------------------------------------------
# Torch references (the oracles for the tests; plain PyTorch, any device)


def topk_compress_ref(
    x: torch.Tensor, *, ratio: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact top-k of |x + residual| by torch.topk, indices ascending; residual keeps what was not sent."""
    acc = acc_ref(x, residual)
    if torch.compiler.is_compiling():  # no host read while tracing: a run-time assertion (a RuntimeError)
        torch._assert_async(torch.isfinite(acc).all(), "topk_compress_ref: non-finite input")
    elif not torch.isfinite(acc).all():
        raise NonFiniteError("topk_compress_ref: non-finite input")
    k = topk_count(acc.numel(), ratio)
    idx = torch.topk(acc.abs(), k, sorted=False).indices.sort().values
    values = acc[idx].to(x.dtype)
    if residual is not None:
        acc[idx] -= values.float()
        residual.view(-1).copy_(acc)
    return values, idx.to(index_dtype(acc.numel()))


def topk_decompress_ref(values, indices, numel, *, out=None, accumulate=False, alpha=1.0) -> torch.Tensor:
    if out is None:
        out = torch.zeros(numel, dtype=values.dtype, device=values.device)
    acc = out.reshape(-1).float() if accumulate else torch.zeros(numel, device=values.device)
    acc.index_add_(0, indices.long(), values.float() * alpha)
    out.view(-1).copy_(acc)
    return out


# --------------------------------------------------------------------------------------------------
# Provider implementations. Inputs are validated, contiguous and 1-D, on one device.

_candidates = Op("topk_compress")
_scatter = Op("topk_decompress")
_T = torch.Tensor
_F32 = torch.float32
_I32 = torch.int32
_I64 = torch.int64
_CPU = torch.device("cpu")
# Triton launches (see _topk_triton): the candidate pass's int32 block scan and one-element compaction stores keep
# 8 elements a thread under 64 registers (16 took 124-129); the scatter's 64-bit scattered addresses likewise.
CAND_BLOCK, CAND_WARPS = 4096, 16
SCATTER_BLOCK, SCATTER_WARPS = 1024, 4


def _spans(n: int, block: int, warps: int) -> list[tuple[tuple[int], int, int, int, int]]:
    """:func:`common.spans` with each launch's block and warps: the tail (fewer than VEC elements) is one
    program of one warp over VEC elements, not a block of ``block`` elements nearly all masked off."""
    return [(g, s, e, block, warps) if e - s >= VEC else (g, s, e, VEC, 1) for g, s, e in spans(n, block)]


# candidates: (cval fp32 [cap], cidx [cap], cnt int64 [2] = (count, non-finite))
@_candidates.register("torch")
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


@_candidates.register("triton")
def _cand_triton(x, r, thr, cap, idx_dtype):
    from . import _topk_triton as K

    cval = torch.empty(cap, dtype=torch.float32, device=x.device)
    cidx = torch.empty(cap, dtype=idx_dtype, device=x.device)
    cnt = new_counter(x.device, 2)
    vec = 16 // min(x.element_size(), (r if r is not None else x).element_size())  # elements in 16 bytes
    for grid, start, end, block, warps in _spans(x.numel(), CAND_BLOCK, CAND_WARPS):
        K._topk_candidates_kernel[grid](x, r if r is not None else x, cval, cidx, cnt, start, end, thr, cap,
                                        BLOCK=block, VEC=vec, HAS_R=r is not None, num_warps=warps)  # fmt: skip
    return cval, cidx, cnt


@_candidates.register("numba")
def _cand_numba(x, r, thr, cap, idx_dtype):
    from . import _topk_numba as K

    return K.candidates(x, r, thr, cap, idx_dtype)


@_candidates.register("cpu")
def _cand_cpu(x, r, thr, cap, idx_dtype):
    from . import _topk_cpu as K

    return K.candidates(x, r, thr, cap, idx_dtype)


# out[idx] (+)= alpha * values; ``unique`` promises no repeated index (no atomics needed)
@_scatter.register("torch")
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


@_scatter.register("triton")
def _scatter_triton(values, indices, out, alpha, accumulate, unique):
    from . import _topk_triton as K

    def launch(values, indices, out, alpha, accumulate, atomic):
        vec = 16 // min(values.element_size(), indices.element_size())  # elements in 16 bytes
        for grid, start, end, block, warps in _spans(values.numel(), SCATTER_BLOCK, SCATTER_WARPS):
            K._scatter_kernel[grid](values, indices, out, start, end, out.numel(), alpha, BLOCK=block, VEC=vec,
                                    ACCUMULATE=accumulate, ATOMIC=atomic, num_warps=warps)  # fmt: skip

    _scatter_with(launch, values, indices, out, alpha, accumulate, unique)


@_scatter.register("numba")
def _scatter_numba(values, indices, out, alpha, accumulate, unique):
    from . import _topk_numba as K

    _scatter_with(K.scatter, values, indices, out, alpha, accumulate, unique)


@_scatter.register("cpu")
def _scatter_cpu(values, indices, out, alpha, accumulate, unique):
    from . import _topk_cpu as K

    K.scatter(values, indices, out, alpha, accumulate, unique)


# --------------------------------------------------------------------------------------------------
# Custom ops (torch.library): opaque to torch.compile, with fake implementations.


@torch.library.custom_op("torsh::topk_compress", mutates_args=("residual",))
def _topk_op(x: torch.Tensor, residual: torch.Tensor | None, k: int, exact: bool, check_finite: bool,
             provider: str, traced: bool = False) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``traced``: the public function was traced (torch.compile) and left the memory check to run here."""
    if traced and residual is not None:
        no_overlap(residual.view(-1), x.view(-1), "torsh_kernels.topk_compress", "residual", "x")
    name = select_provider(_candidates, x, provider)
    with on_device(x.device):
        return _topk_run(name, x.view(-1), residual.view(-1) if residual is not None else None, k, exact, check_finite)


@_topk_op.register_fake
def _(x, residual, k, exact, check_finite, provider, traced=False):
    return x.new_empty(k), x.new_empty(k, dtype=index_dtype(x.numel()))


def _sample_threshold(x: torch.Tensor, r: torch.Tensor | None, stride: int, target: int) -> float:
    """The ``target``-th largest |x + r| over the strided sample x[::stride] (a host scalar)."""
    s = x[::stride].float()
    if r is not None:
        s = s + r[::stride].float()
    s = s.abs().nan_to_num_(nan=0.0, posinf=0.0)
    target = min(max(target, 1), s.numel())
    return float(torch.topk(s, target, sorted=False).values.min().item())


def _topk_run(name: str, x, r, k: int, exact: bool, check_finite: bool):
    n = x.numel()
    idt = index_dtype(n)
    what = "torsh_kernels.topk_compress"
    chosen = None
    sample = min(n, max(TOPK_MIN_SAMPLE, math.ceil(TOPK_SAMPLE_PER_K * n / k)))
    stride = max(1, n // sample)
    if not exact and stride > 1:  # a sample of every element would be a top-k over all n: the exact path is less work
        cap = min(n, k + math.ceil(TOPK_SLACK * k))
        ns = -(-n // stride)
        target = _TOPK_TARGET * k * ns / n
        for _ in range(TOPK_REFINE):
            thr = _sample_threshold(x, r, stride, math.ceil(target))
            cval, cidx, cnt = _candidates(name, x, r, thr, cap, idt)
            count, bad = cnt if type(cnt) is tuple else cnt.tolist()
            if bad and check_finite:
                raise_nonfinite(bad, what, "x + residual" if r is not None else "x")
            if k <= count <= cap:
                sel = torch.topk(cval[:count].abs(), k, sorted=False).indices
                chosen = cidx[sel], cval[sel]
                break
            # re-aim: the sample rank that should give k * _TOPK_TARGET candidates, given what this gave
            new = target * (_TOPK_TARGET * k) / max(count, 1)
            if math.ceil(new) == math.ceil(target):
                new = target + (1 if count < k else -1)
            if new < 1 or new > ns:
                break
            target = new
    if chosen is None and name == "cpu":  # the cpu kernel's exact selection (ties: the lower index)
        from . import _topk_cpu as K

        vals, idx, bad = K.exact(x, r, k, idt)
        if not bad:
            return vals.to(x.dtype), idx
        if check_finite:
            raise_nonfinite(bad, what, "x + residual" if r is not None else "x")
    if chosen is None:  # exact path (also the fallback)
        if r is None and name == "torch":  # x itself in fp32 (a copy only for 16-bit x)
            acc = x.float()
            bad = nonfinite_count(acc) if check_finite else None
        else:
            acc = torch.empty(n, dtype=torch.float32, device=x.device)
            bad = axpby(name, x, r if r is not None else torch.zeros_like(x), acc, 1.0, check_finite)
        if check_finite and (b := as_count(bad)):
            raise_nonfinite(b, what, "x + residual" if r is not None else "x")
        sel = torch.topk(acc.abs(), k, sorted=False).indices
        chosen = sel.to(idt), acc.index_select(0, sel)
    idx, order = torch.sort(chosen[0])
    acc = chosen[1].index_select(0, order)  # fp32 x + residual at the chosen indices
    values = acc.to(x.dtype)
    if r is not None:  # error feedback: residual = x + residual, then what the sent values leave of it
        axpby(name, x, r, r, 1.0, False)
        _scatter(name, acc - values.float(), idx, r, 1.0, False, True)  # rounded once into r's dtype
    return values, idx


@torch.library.custom_op("torsh::topk_decompress", mutates_args=("out",))
def _topk_decompress_op(values: torch.Tensor, indices: torch.Tensor, out: torch.Tensor, accumulate: bool,
                        alpha: float, provider: str, traced: bool = False) -> None:  # fmt: skip
    """``traced``: the public function was traced (torch.compile) and left the index range and memory checks
    to run here, before anything is written."""
    if traced:
        _check_index_range(indices, out.numel())
        _decompress_overlaps(out, values, indices)
    name = select_provider(_scatter, out, provider)
    with on_device(out.device):
        if not accumulate:
            out.zero_()
        if values.numel():
            _scatter(name, values, indices, out.view(-1), alpha, accumulate, False)


@_topk_decompress_op.register_fake
def _(values, indices, out, accumulate, alpha, provider, traced=False):
    return None


def _check_index_range(indices: torch.Tensor, numel: int) -> None:
    """Every index in [0, numel) (one pass and a host read), else ShapeError naming one outside."""
    if indices.numel():
        lo, hi = torch.aminmax(indices)
        lo, hi = int(lo), int(hi)
        if lo < 0 or hi >= numel:
            bad = lo if lo < 0 else hi
            raise ShapeError(f"torsh_kernels.topk_decompress: index {bad} is outside [0, {numel}); nothing was written")


def _decompress_overlaps(of: torch.Tensor, values: torch.Tensor, indices: torch.Tensor) -> None:
    what = "torsh_kernels.topk_decompress"
    no_overlap(of, values, what, "out", "values")
    no_overlap(of, indices, what, "out", "indices")


# --------------------------------------------------------------------------------------------------
# Public API

_cpu_kernels = eager.lazy_module("_topk_cpu")  # the cpu provider's kernels, for the fast paths
_FAST_NUMEL = HOST_BYTES // 4  # the fast paths allocate numel fp32 elements: larger sizes take the checks


def _check_ratio(ratio: object, what: str) -> float:
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)):
        raise ArgumentTypeError(f"{what}: ratio must be a number in (0, 1], got {type(ratio).__name__}")
    if not (0.0 < ratio <= 1.0):
        raise InvalidArgumentError(f"{what}: ratio must be in (0, 1] (the fraction of elements sent), got {ratio}")
    return float(ratio)


def topk_compress(
    x: torch.Tensor,
    *,
    ratio: float,
    residual: torch.Tensor | None = None,
    exact: bool = False,
    check_finite: bool = True,
    provider: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The k = ceil(ratio * x.numel()) largest magnitudes of ``x + residual``, with error feedback.

    Returns ``(values, indices)``: values in x's dtype, indices ascending, int32 when x has fewer than
    2**31 elements (else int64), both of length k. With ``residual`` (fp32/fp16/bf16, x's element count,
    contiguous), it is updated in place to ``x + residual - decompress(values, indices)``: exactly what
    was not sent (for each element, computed in fp32 and rounded once into the residual's dtype). See the
    module docstring for the approximate mode and ``exact``.
    """
    if (
        type(x) is _T and x.dtype is _F32 and x.is_cpu and x.is_contiguous()
        and ratio.__class__ is float and 0.0 < ratio <= 1.0 and (n := x.numel()) and n < 2**31
        and (residual is None or (type(residual) is _T and residual.dtype is _F32 and residual.is_cpu
                                  and residual.is_contiguous() and residual.numel() == n))
        and eager.fast()  # (before anything reads addresses: false while torch.compile traces)
        and (residual is None or eager.disjoint(x, residual, 4 * n))
        and _candidates.select(_CPU, _F32, n, provider or None) == "cpu"
        and (exact or n // min(n, max(TOPK_MIN_SAMPLE, math.ceil(TOPK_SAMPLE_PER_K * n / topk_count(n, ratio)))) <= 1)
    ):  # fmt: skip
        # The exact path on the CPU with the cpu provider (the small case, or exact=True): its kernel
        # straight on the tensors' memory. NaN/Inf are left to the general path, which reports them (or,
        # with check_finite=False, selects anyway).
        K = _cpu_kernels()
        k = topk_count(n, ratio)
        values = torch.empty(k)
        idx = torch.empty(k, dtype=_I32)
        if not K.exact_ptr(x.data_ptr(), residual.data_ptr() if residual is not None else 0, residual is not None,
                           n, k, scratch_buffer(_CPU, n).data_ptr(), values.data_ptr(), idx.data_ptr()):  # fmt: skip
            if residual is not None:
                eager.bump(residual)
            return values, idx
    if (
        residual is None and type(x) is _T and x.dtype is _F32 and x.is_cpu and x.is_contiguous()
        and ratio.__class__ is float and 0.0 < ratio <= 1.0 and (n := x.numel()) and n < 2**31
        and eager.fast()
        and _candidates.select(_CPU, _F32, n, provider or None) == "torch"
    ):  # fmt: skip
        k = topk_count(n, ratio)
        if exact or n // min(n, max(TOPK_MIN_SAMPLE, math.ceil(TOPK_SAMPLE_PER_K * n / k))) <= 1:
            # The common small case, fp32 on the CPU without a residual, where the torch provider takes
            # its exact path: the same top-k of |x|, its indices sorted and x gathered at them (the
            # provider gathers then permutes: the same elements). A non-finite sum (NaN/Inf, or an
            # overflow) is left to the general path, which counts and reports (or selects anyway).
            with eager.no_grad():
                xf = x if x.dim() == 1 else x.view(-1)
                if not check_finite or finite_sum(xf):
                    idx = torch.topk(xf.abs(), k, sorted=False).indices.sort().values
                    return xf.index_select(0, idx), idx.to(_I32)
    what = "torsh_kernels.topk_compress"
    check_provider(provider)
    xf = flat_input(x, what, "x")
    ratio = _check_ratio(ratio, what)
    if xf.numel() == 0:
        raise ShapeError(f"{what}: x is empty; there is nothing to select")
    rf, traced = None, False
    if residual is not None:
        rf = flat_inout(residual, what, "residual", xf.numel(), xf.device)
        traced = eager.deferred(xf, rf)  # the memory check then runs in the op, at run time
        if not traced:
            no_overlap(rf, xf, what, "residual", "x")
    k = topk_count(xf.numel(), ratio)
    return eager.call(_topk_op, (1,), xf, rf, k, bool(exact), bool(check_finite), provider or "", traced)


def topk_decompress(
    values: torch.Tensor,
    indices: torch.Tensor,
    numel: int,
    *,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
    alpha: float = 1.0,
    dtype: torch.dtype | None = None,
    provider: str | None = None,
) -> torch.Tensor:
    """Scatter ``alpha * values`` to ``indices`` of a zero tensor of ``numel`` elements (or of ``out``).

    With ``accumulate`` the values are added to ``out`` (repeated indices add up, e.g. the concatenated
    payloads of several ranks); without, ``out`` is zeroed first and a repeated index keeps one of its
    values (unspecified which). Indices outside [0, numel) raise ``ShapeError`` before anything is written.
    """
    if (
        out is None and not accumulate and type(values) is _T and type(indices) is _T and type(numel) is int
        and 0 < numel <= _FAST_NUMEL and (dtype is None or dtype is _F32)
        and (alpha.__class__ is float or alpha.__class__ is int) and -math.inf < alpha < math.inf
        and values.dtype is _F32 and (indices.dtype is _I64 or indices.dtype is _I32)
        and values.is_cpu and indices.is_cpu and values.dim() == 1 and indices.dim() == 1
        and values.is_contiguous() and indices.is_contiguous() and indices.numel() == values.numel()
        and eager.fast()
        and _scatter.select(_CPU, _F32, numel, provider or None) == "cpu"
    ):  # fmt: skip
        # The common case on the CPU with the cpu provider, into a new fp32 tensor: its kernel, which checks
        # every index before writing; one outside [0, numel) is left to the general path, which says which.
        K = _cpu_kernels()
        out = torch.zeros(numel)
        if K.scatter_ptr(values.data_ptr(), indices.data_ptr(), indices.dtype is _I64, values.numel(), out.data_ptr(),
                         numel, float(alpha)) < 0:  # fmt: skip
            return out
    if (
        out is None and not accumulate and type(values) is _T and type(indices) is _T and type(numel) is int
        and 0 < numel <= _FAST_NUMEL and (dtype is None or dtype is _F32)
        and (alpha.__class__ is float or alpha.__class__ is int) and alpha == 1.0
        and values.dtype is _F32 and (indices.dtype is _I64 or indices.dtype is _I32)
        and values.is_cpu and indices.is_cpu and values.dim() == 1 and indices.dim() == 1
        and (k := values.numel()) and indices.numel() == k
        and eager.fast()
        and _scatter.select(_CPU, _F32, numel, provider or None) == "torch"
    ):  # fmt: skip
        # The common case, fp32 on the CPU into a new tensor: the torch provider's zeroed buffer and
        # scatter_. scatter_ checks every index against [0, numel) before it writes; one outside (a
        # RuntimeError, in a tensor nobody else has seen) is left to the general path, which says which.
        with eager.no_grad():
            try:
                return torch.zeros(numel).scatter_(0, indices.long(), values)
            except RuntimeError:
                pass
    what = "torsh_kernels.topk_decompress"
    check_provider(provider)
    values, indices = _check_payload(values, indices, what)
    numel = check_int(numel, what, "numel", 0)
    alpha = check_alpha(alpha, what)
    # the index range and memory checks run in the op while torch.compile traces (meta: nothing to check)
    traced = eager.deferred(values, indices, out if isinstance(out, torch.Tensor) else None)
    if not traced:
        _check_index_range(indices, numel)  # (before out is allocated: an index names the size it needs)
    out, of = decode_out(out, numel, dtype or values.dtype, values.device, what, bool(accumulate))
    if not traced:
        _decompress_overlaps(of, values, indices)
    eager.call(_topk_decompress_op, (2,), values.contiguous(), indices.contiguous(), of, bool(accumulate), alpha,
                provider or "", traced)  # fmt: skip
    return out


def _check_payload(values: object, indices: object, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``topk_decompress``'s (values, indices), checked: tensors, dtypes, 1-D of one length, one device."""
    values = check_tensor(values, what, "values")
    indices = check_tensor(indices, what, "indices")
    check_dtype(values, what, "values")
    if indices.dtype not in (torch.int32, torch.int64):
        raise DTypeError(f"{what}: indices have dtype {indices.dtype}; expected int32 or int64")
    if values.dim() != 1 or indices.dim() != 1 or values.numel() != indices.numel():
        raise ShapeError(
            f"{what}: values and indices must be 1-D of one length, got {tuple(values.shape)} and "
            f"{tuple(indices.shape)}"
        )
    if values.device != indices.device:
        raise DeviceMismatchError(f"{what}: values are on {values.device}, indices on {indices.device}")
    return values, indices
