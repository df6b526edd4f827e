"""Error-feedback ops: the fused steps around a lossy compression.

- ``residual_add(x, residual, out=)``: ``acc = x + residual`` in fp32, in one pass (the input of an
  error-feedback compressor), counting NaN/Inf on the way.
- ``error_update(acc, approx, residual, out=)``: ``residual = acc - approx`` and, optionally, ``approx``
  copied, cast, into ``out`` (typically the gradient), in one pass.

See ``common`` for what the compression families share (fp32 compute, the non-finite checks).
"""

from __future__ import annotations

import math

import torch

from ..errors import DeviceMismatchError, ShapeError
from . import eager
from .common import (
    BLOCK,
    WARPS,
    Memo,
    as_count,
    flat_inout,
    flat_input,
    new_counter,
    no_overlap,
    nonfinite_count,
    on_device,
    raise_nonfinite,
    select_provider,
    spans,
    tensor_guards,
)
from .registry import Op, check_provider

_T = torch.Tensor
_F32 = torch.float32
_CPU = torch.device("cpu")

__all__ = ["error_update", "error_update_ref", "residual_add", "residual_add_ref"]


# --------------------------------------------------------------------------------------------------
# Torch references (the oracles for the tests; plain PyTorch, any device)


def residual_add_ref(x: torch.Tensor, residual: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    acc = x.reshape(-1).float() + residual.reshape(-1).float()
    if out is None:
        return acc.view(x.shape)
    out.view(-1).copy_(acc)
    return out


def error_update_ref(acc, approx, residual, *, out=None) -> None:
    a = approx.reshape(-1).float()
    residual.view(-1).copy_(acc.reshape(-1).float() - a)
    if out is not None:
        out.view(-1).copy_(a)


# --------------------------------------------------------------------------------------------------
# Provider implementations. Inputs are validated, contiguous and 1-D, on one device.

axpby = Op("residual_add")
_err_update = Op("error_update")


# out = x + beta * y; returns the non-finite count tensor (or None)
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
    from . import _error_feedback_triton as K

    bad = new_counter(x.device)
    for grid, start, end in spans(x.numel(), BLOCK):
        K._axpby_kernel[grid](x, y, out, bad, start, end, beta, BLOCK=BLOCK, COUNT_BAD=count_bad, num_warps=WARPS,
                              enable_fp_fusion=False)  # fmt: skip
    return bad if count_bad else None


@axpby.register("numba")
def _axpby_numba(x, y, out, beta, count_bad):
    from . import _error_feedback_numba as K

    return K.axpby(x, y, out, beta, count_bad)


@axpby.register("cpu")
def _axpby_cpu(x, y, out, beta, count_bad):
    from . import _error_feedback_cpu as K

    return K.axpby(x, y, out, beta, count_bad)


@_err_update.register("torch")
def _err_update_torch(acc, approx, res, out):
    a = approx.float()
    if res.dtype == acc.dtype == torch.float32:
        torch.sub(acc, a, out=res)  # one pass, no temporary
    else:
        res.copy_(acc.float() - a)
    if out is not None:
        out.copy_(a)


@_err_update.register("triton")
def _err_update_triton(acc, approx, res, out):
    from . import _error_feedback_triton as K

    block = BLOCK // 2 if out is not None else BLOCK  # four streams: 8 elements a thread keep it at 64 registers
    for grid, start, end in spans(acc.numel(), block):
        K._error_update_kernel[grid](acc, approx, res, out if out is not None else res, start, end, BLOCK=block,
                                     HAS_OUT=out is not None, num_warps=WARPS)  # fmt: skip


@_err_update.register("numba")
def _err_update_numba(acc, approx, res, out):
    from . import _error_feedback_numba as K

    K.error_update(acc, approx, res, out)


@_err_update.register("cpu")
def _err_update_cpu(acc, approx, res, out):
    from . import _error_feedback_cpu as K

    K.error_update(acc, approx, res, out)


# --------------------------------------------------------------------------------------------------
# Custom ops (torch.library): opaque to torch.compile, with fake implementations.


@torch.library.custom_op("torsh::residual_add", mutates_args=("out",))
def _residual_add_op(x: torch.Tensor, residual: torch.Tensor, out: torch.Tensor, check_finite: bool,
                     provider: str, traced: bool = False) -> None:  # fmt: skip
    """``traced``: the public function was traced (torch.compile) and left the memory checks to run here."""
    if traced:
        _residual_add_overlaps(x.view(-1), residual.view(-1), out.view(-1))
    name = select_provider(axpby, x, provider)
    with on_device(x.device):
        bad = axpby(name, x.view(-1), residual.view(-1), out.view(-1), 1.0, check_finite)
    if check_finite and (b := as_count(bad)):
        raise_nonfinite(b, "torsh_kernels.residual_add", "x + residual")


@_residual_add_op.register_fake
def _(x, residual, out, check_finite, provider, traced=False):
    return None


def _residual_add_overlaps(xf: torch.Tensor, rf: torch.Tensor, of: torch.Tensor) -> None:
    for t, nm in ((xf, "x"), (rf, "residual")):
        no_overlap(of, t, "torsh_kernels.residual_add", "out", nm, same_ok=True)


@torch.library.custom_op("torsh::error_update", mutates_args=("residual", "out"))
def _error_update_op(acc: torch.Tensor, approx: torch.Tensor, residual: torch.Tensor, out: torch.Tensor | None,
                     provider: str, traced: bool = False) -> None:  # fmt: skip
    """``traced``: the public function was traced (torch.compile) and left the memory checks to run here."""
    if traced:
        of = out.view(-1) if out is not None else None
        _error_update_overlaps(acc.view(-1), approx.view(-1), residual.view(-1), of)
    name = select_provider(_err_update, acc, provider)
    with on_device(acc.device):
        _err_update(name, acc.view(-1), approx.view(-1), residual.view(-1), out.view(-1) if out is not None else None)


@_error_update_op.register_fake
def _(acc, approx, residual, out, provider, traced=False):
    return None


def _error_update_overlaps(af: torch.Tensor, pf: torch.Tensor, rf: torch.Tensor, of: torch.Tensor | None) -> None:
    what = "torsh_kernels.error_update"
    no_overlap(rf, pf, what, "residual", "approx")
    no_overlap(rf, af, what, "residual", "acc", same_ok=True)
    if of is not None:
        no_overlap(of, rf, what, "out", "residual")
        no_overlap(of, af, what, "out", "acc")
        no_overlap(of, pf, what, "out", "approx", same_ok=True)


# --------------------------------------------------------------------------------------------------
# Public API


_RA_LAYOUTS = Memo(64)
_cpu_kernels = eager.lazy_module("_error_feedback_cpu")  # the cpu provider's kernels, for the fast paths


def _residual_add_fast_layout(x: torch.Tensor, r: torch.Tensor, out: torch.Tensor, ptrs: tuple[int, int, int]) -> bool:
    """Plain fp32 CPU tensors of one shape, contiguous, not empty; out either is x (or r) or shares no
    byte with it."""
    if not (
        x.dtype is _F32 and r.dtype is _F32 and out.dtype is _F32 and x.is_cpu and r.is_cpu and out.is_cpu
        and x.is_contiguous() and r.is_contiguous() and out.is_contiguous() and x.shape == r.shape == out.shape
        and not x.is_meta
    ):  # fmt: skip
        return False
    nb = 4 * x.numel()
    px, pr, po = ptrs
    return bool(nb) and all(po == p or po + nb <= p or p + nb <= po for p in (px, pr))


def _add_nograd(x: torch.Tensor, y: torch.Tensor, out: torch.Tensor) -> None:
    with torch.no_grad():
        torch.add(x, y, out=out)


def residual_add(
    x: torch.Tensor,
    residual: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    check_finite: bool = True,
    provider: str | None = None,
) -> torch.Tensor:
    """``x + residual`` in fp32, in one pass: the error-feedback input of a lossy compressor.

    ``out`` (any of fp32/fp16/bf16, x's element count, contiguous) defaults to a new fp32 tensor of x's
    shape; it may be ``residual`` or ``x`` itself. With ``check_finite``, NaN/Inf in the sum raise
    :class:`NonFiniteError` (after the pass: an ``out`` that aliases an input has been written).
    """
    if type(out) is _T and type(x) is _T and type(residual) is _T and eager.fast():
        # The common case, fp32 on the CPU: what the torch provider does, without the flattening views
        # and the custom op (equal shapes, contiguous: the same elements in the same order). The layout
        # check below is remembered per (addresses) and confirmed by a C-level guard on everything else
        # it read (type, dtype, device, shape, strides, requires_grad).
        key = (x.data_ptr(), residual.data_ptr(), out.data_ptr())
        hit = _RA_LAYOUTS.get(key)  # (guard, numel, any requires_grad): all fixed by what the guard checks
        if hit is None or not hit[0].check(x, residual, out):
            hit = None
            if _residual_add_fast_layout(x, residual, out, key):
                hit = (tensor_guards((x, residual, out)), x.numel(),
                       x.requires_grad or residual.requires_grad or out.requires_grad)  # fmt: skip
                if hit[0] is not None:
                    _RA_LAYOUTS.put(key, hit)
        sel = axpby.select(_CPU, _F32, hit[1], provider or None) if hit is not None else None
        if sel == "cpu":  # its kernel straight on the tensors' memory (plain fp32 arrays: no grad semantics)
            K = _cpu_kernels()
            b = K.axpby_ptr(key[0], key[1], key[2], hit[1], 1.0, bool(check_finite))
            eager.bump(out)
            if b:
                raise_nonfinite(b, "torsh_kernels.residual_add", "x + residual")
            return out
        if sel == "torch":
            if hit[2]:
                _add_nograd(x, residual, out)  # as the custom op ran: the result never requires grad
            else:
                torch.add(x, residual, out=out)
            if check_finite and not math.isfinite(out.sum().item()):
                b = int((~torch.isfinite(out)).sum())
                if b:
                    raise_nonfinite(b, "torsh_kernels.residual_add", "x + residual")
            return out
    what = "torsh_kernels.residual_add"
    check_provider(provider)
    xf = flat_input(x, what, "x")
    rf = flat_inout(residual, what, "residual", xf.numel(), xf.device)
    if out is None:
        out = torch.empty(x.shape, dtype=torch.float32, device=xf.device)
    of = flat_inout(out, what, "out", xf.numel(), xf.device)
    traced = eager.deferred(xf, rf, of)  # the memory checks then run in the op, at run time
    if not traced:
        for t, nm in ((xf, "x"), (rf, "residual")):
            no_overlap(of, t, what, "out", nm, same_ok=True)
    if xf.numel():
        eager.call(_residual_add_op, (2,), xf, rf, of, bool(check_finite), provider or "", traced)
    return out


def error_update(
    acc: torch.Tensor,
    approx: torch.Tensor,
    residual: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    provider: str | None = None,
) -> None:
    """``residual = acc - approx`` and, if ``out`` is given, ``out = approx`` (cast), in one pass.

    The error-feedback step after decompression: ``acc`` is what was compressed (gradient + old
    residual), ``approx`` what the compressed payload decodes to (for PowerSGD, ``P @ Q.T``), ``out``
    typically the gradient tensor that receives the approximation. ``residual`` may be ``acc`` itself.
    """
    if (
        type(acc) is _T and type(approx) is _T and type(residual) is _T
        and acc.dtype is _F32 and approx.dtype is _F32 and residual.dtype is _F32
        and acc.is_cpu and approx.is_cpu and residual.is_cpu
        and acc.shape == approx.shape == residual.shape
        and acc.is_contiguous() and approx.is_contiguous() and residual.is_contiguous()
        and (n := acc.numel())
        and (out is None or (type(out) is _T and out.dtype is _F32 and out.is_cpu and out.shape == acc.shape
                             and out.is_contiguous()))
        and eager.fast()
        and eager.disjoint(residual, approx, 4 * n) and eager.disjoint_or_same(residual, acc, 4 * n)
        and (out is None or (eager.disjoint(out, residual, 4 * n) and eager.disjoint(out, acc, 4 * n)
                             and eager.disjoint_or_same(out, approx, 4 * n)))
        and (sel := _err_update.select(_CPU, _F32, n, provider or None)) in ("torch", "cpu")
    ):  # fmt: skip
        if sel == "cpu":  # its kernel straight on the tensors' memory
            K = _cpu_kernels()
            K.error_update_ptr(acc.data_ptr(), approx.data_ptr(), residual.data_ptr(),
                               out.data_ptr() if out is not None else 0, n, out is not None)  # fmt: skip
            eager.bump(residual, out)
            return
        # The common case, fp32 on the CPU: the torch provider's two calls, without the flattening views
        # and the custom op (equal shapes, contiguous: the same elements in the same order).
        with eager.no_grad():
            torch.sub(acc, approx, out=residual)
            if out is not None:
                out.copy_(approx)
        return
    what = "torsh_kernels.error_update"
    check_provider(provider)
    af = flat_input(acc, what, "acc")
    n, dev = af.numel(), af.device
    pf = flat_input(approx, what, "approx")
    if pf.numel() != n:
        raise ShapeError(f"{what}: approx has {pf.numel()} elements, acc has {n}")
    if pf.device != dev:
        raise DeviceMismatchError(f"{what}: approx is on {pf.device}, acc on {dev}")
    rf = flat_inout(residual, what, "residual", n, dev)
    of = flat_inout(out, what, "out", n, dev) if out is not None else None
    traced = eager.deferred(af, pf, rf, of)  # the memory checks then run in the op, at run time
    if not traced:
        _error_update_overlaps(af, pf, rf, of)
    if n:
        eager.call(_error_update_op, (2, 3), af, pf, rf, of, provider or "", traced)
