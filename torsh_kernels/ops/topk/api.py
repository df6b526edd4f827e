"""The top-k family's public ops (topk_compress, topk_decompress): each validates its inputs (typed errors),
allocates its outputs and runs its provider (``providers.py``) through a ``torsh::`` custom op with a fake
implementation, so it composes with ``torch.compile``; on plain fp32 CPU tensors a fast path runs the
selected provider's exact path straight on the tensors. Also the approximate mode's host side: its
constants, the strided sample (:func:`_sample_stride`, :func:`_sample_threshold`) and the refinement loop."""

from __future__ import annotations

import math

import torch

from ... import recording
from ...checks import check_int
from ...errors import DeviceMismatchError, DTypeError, ShapeError
from .. import eager
from ..common import (
    HOST_BYTES,
    as_count,
    check_alpha,
    check_dtype,
    check_tensor,
    decode_out,
    finite_sum,
    flat_inout,
    flat_input,
    no_overlap,
    nonfinite_count,
    on_device,
    raise_nonfinite,
    scratch_buffer,
    select_provider,
)
from ..error_feedback import axpby
from ..registry import check_provider
from .providers import candidates_impl, scatter_impl
from .reference import check_ratio, index_dtype, topk_count

__all__ = ["TOPK_MIN_SAMPLE", "TOPK_REFINE", "TOPK_SAMPLE_PER_K", "TOPK_SLACK", "topk_compress", "topk_decompress"]


# Top-k approximate mode: candidate buffer slack over k, and refinement rounds before the exact path.
TOPK_SLACK = 0.25
TOPK_REFINE = 4
TOPK_MIN_SAMPLE = 65536
TOPK_SAMPLE_PER_K = 1024  # the sample holds about this many expected top-k elements (when n allows)
_TOPK_TARGET = 1 + TOPK_SLACK / 2  # aim at the middle of the band

_F32 = torch.float32
_I32 = torch.int32
_I64 = torch.int64
_CPU = torch.device("cpu")


def _sample_stride(n: int, k: int) -> int:
    """The stride of the approximate mode's strided sample for a top-k of ``k`` of ``n`` elements: a sample of
    about ``TOPK_SAMPLE_PER_K`` expected top-k elements and at least ``TOPK_MIN_SAMPLE`` elements (at most n).
    1: the sample would hold every element, and the exact path runs (the sample's top-k would already be a
    top-k over all n). The one definition the custom op and the fast paths read."""
    return n // min(n, max(TOPK_MIN_SAMPLE, math.ceil(TOPK_SAMPLE_PER_K * n / k)))


# --------------------------------------------------------------------------------------------------
# Custom ops (torch.library): opaque to torch.compile, with fake implementations.


@torch.library.custom_op("torsh::topk_compress", mutates_args=("residual",))
def _topk_op(x: torch.Tensor, residual: torch.Tensor | None, k: int, exact: bool, check_finite: bool,
             provider: str, traced: bool = False) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``traced``: the public function was traced (torch.compile) and left the memory check to run here."""
    if traced and residual is not None:
        no_overlap(residual.view(-1), x.view(-1), "torsh_kernels.topk_compress", "residual", "x")
    name = select_provider(candidates_impl, x, provider)
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
    source = "x + residual" if r is not None else "x"  # (what a non-finite count is reported of)
    chosen = None
    stride = _sample_stride(n, k)
    if not exact and stride > 1:  # a sample of every element would be a top-k over all n: the exact path is less work
        cap = min(n, k + math.ceil(TOPK_SLACK * k))
        ns = -(-n // stride)
        target = _TOPK_TARGET * k * ns / n
        for _ in range(TOPK_REFINE):
            thr = _sample_threshold(x, r, stride, math.ceil(target))
            cval, cidx, cnt = candidates_impl(name, x, r, thr, cap, idt)
            count, bad = cnt if type(cnt) is tuple else cnt.tolist()
            if bad and check_finite:
                raise_nonfinite(bad, what, source)
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
        rec = recording.recorder  # a launch of the op's cpu kernel, as a provider call through the Op reports
        if rec is None:
            vals, idx, bad = _cpu_kernels().exact(x, r, k, idt)
        else:
            with rec.op(candidates_impl.name, name, (x, r, k)):
                vals, idx, bad = _cpu_kernels().exact(x, r, k, idt)
        if not bad:
            return vals.to(x.dtype), idx
        if check_finite:
            raise_nonfinite(bad, what, source)
    if chosen is None:  # exact path (also the fallback)
        if r is None and name == "torch":  # x itself in fp32 (a copy only for 16-bit x)
            acc = x.float()
            bad = nonfinite_count(acc) if check_finite else None
        else:
            acc = torch.empty(n, dtype=torch.float32, device=x.device)
            bad = axpby(name, x, r if r is not None else torch.zeros_like(x), acc, 1.0, check_finite)
        if check_finite and (b := as_count(bad)):
            raise_nonfinite(b, what, source)
        sel = torch.topk(acc.abs(), k, sorted=False).indices
        chosen = sel.to(idt), acc.index_select(0, sel)
    idx, order = torch.sort(chosen[0])
    acc = chosen[1].index_select(0, order)  # fp32 x + residual at the chosen indices
    values = acc.to(x.dtype)
    if r is not None:  # error feedback: residual = x + residual, then what the sent values leave of it
        axpby(name, x, r, r, 1.0, False)
        scatter_impl(name, acc - values.float(), idx, r, 1.0, False, True)  # rounded once into r's dtype
    return values, idx


@torch.library.custom_op("torsh::topk_decompress", mutates_args=("out",))
def _topk_decompress_op(values: torch.Tensor, indices: torch.Tensor, out: torch.Tensor, accumulate: bool,
                        alpha: float, provider: str, traced: bool = False) -> None:  # fmt: skip
    """``traced``: the public function was traced (torch.compile) and left the index range and memory checks
    to run here, before anything is written."""
    if traced:
        _check_index_range(indices, out.numel())
        _decompress_overlaps(out, values, indices)
    name = select_provider(scatter_impl, out, provider)
    with on_device(out.device):
        if not accumulate:
            out.zero_()
        if values.numel():
            scatter_impl(name, values, indices, out.view(-1), alpha, accumulate, False)


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

_cpu_kernels = eager.lazy_module("topk.cpu")  # the cpu provider's kernels (the fast paths, the exact selection)
_FAST_NUMEL = HOST_BYTES // 4  # the fast paths allocate numel fp32 elements: larger sizes take the checks


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
    package docstring for the approximate mode and ``exact``.
    """
    if (
        eager.cpu_dense(x) and ratio.__class__ is float and 0.0 < ratio <= 1.0 and 0 < (n := x.numel()) < 2**31
        and (k := topk_count(n, ratio)) and (exact or _sample_stride(n, k) == 1)
    ):  # fmt: skip
        # fp32 on the CPU where the exact path runs (the small case, or exact=True): the selected provider's
        # exact path straight from the arguments, if it is the cpu or the torch provider
        if (
            eager.cpu_dense_or_none(residual, n)
            and eager.picks(candidates_impl, n, provider, "cpu")  # (before anything reads addresses)
            and (residual is None or eager.disjoint(x, residual, 4 * n))
        ):
            # The cpu provider: its kernel straight on the tensors' memory. NaN/Inf are left to the general
            # path, which reports them (or, with check_finite=False, selects anyway).
            values = torch.empty(k)
            idx = torch.empty(k, dtype=_I32)
            if not _cpu_kernels().exact_ptr(x.data_ptr(), residual.data_ptr() if residual is not None else 0,
                                            residual is not None, n, k, scratch_buffer(_CPU, n).data_ptr(),
                                            values.data_ptr(), idx.data_ptr()):  # fmt: skip
                if residual is not None:
                    eager.bump(residual)
                return values, idx
        elif residual is None and eager.picks(candidates_impl, n, provider, "torch"):
            # The torch provider without a residual: the same top-k of |x|, its indices sorted and x gathered at
            # them (the provider gathers then permutes: the same elements). A non-finite sum (NaN/Inf, or an
            # overflow) is left to the general path, which counts and reports (or selects anyway).
            with eager.no_grad():
                xf = x if x.dim() == 1 else x.view(-1)
                if not check_finite or finite_sum(xf):
                    idx = torch.topk(xf.abs(), k, sorted=False).indices.sort().values
                    return xf.index_select(0, idx), idx.to(_I32)
    what = "torsh_kernels.topk_compress"
    check_provider(provider)
    xf = flat_input(x, what, "x")
    ratio = check_ratio(ratio, what)
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
        out is None and not accumulate and type(numel) is int and 0 < numel <= _FAST_NUMEL
        and (dtype is None or dtype is _F32) and eager.finite_scalar(alpha)
        and eager.cpu_dense(values) and values.dim() == 1
        and (eager.cpu_dense(indices, _I32) or eager.cpu_dense(indices, _I64)) and indices.dim() == 1
        and (k := values.numel()) == indices.numel()
    ):  # fmt: skip
        # fp32 payloads on the CPU into a new fp32 tensor: the selected provider straight from the arguments, if
        # it is the cpu or the torch provider
        if eager.picks(scatter_impl, numel, provider, "cpu"):
            # The cpu provider: its kernel, which checks every index before writing; one outside [0, numel) is
            # left to the general path, which says which.
            out = torch.zeros(numel)
            if _cpu_kernels().scatter_ptr(values.data_ptr(), indices.data_ptr(), indices.dtype is _I64, k,
                                          out.data_ptr(), numel, float(alpha)) < 0:  # fmt: skip
                return out
        elif alpha == 1.0 and k and eager.picks(scatter_impl, numel, provider, "torch"):
            # The torch provider's zeroed buffer and scatter_. scatter_ checks every index against [0, numel)
            # before it writes; one outside (a RuntimeError, in a tensor nobody else has seen) is left to the
            # general path, which says which.
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
