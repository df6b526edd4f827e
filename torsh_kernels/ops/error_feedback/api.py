"""The error-feedback family's public ops (residual_add, error_update): each validates its inputs (typed
errors), allocates its outputs and runs its provider (``providers.py``), through a ``torsh::`` custom op with a
fake implementation so it composes with ``torch.compile``; its common case, fp32 on the CPU, takes a fast
path straight to the cpu kernel or the torch provider's arithmetic."""

from __future__ import annotations

import math

import torch

from ...errors import DeviceMismatchError, ShapeError
from .. import eager
from ..common import (
    Memo,
    as_count,
    flat_inout,
    flat_input,
    no_overlap,
    on_device,
    raise_nonfinite,
    select_provider,
    tensor_guards,
)
from ..registry import check_provider
from .providers import axpby, error_update_impl

__all__ = ["cpu_kernels", "error_update", "residual_add"]

_T = torch.Tensor
_F32 = torch.float32
_CPU = torch.device("cpu")
_FAST = ("cpu", "torch")  # the providers a fast path runs


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
    name = select_provider(error_update_impl, acc, provider)
    with on_device(acc.device):
        error_update_impl(name, acc.view(-1), approx.view(-1), residual.view(-1),
                          out.view(-1) if out is not None else None)  # fmt: skip


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
# Fast paths: fp32 CPU tensors of one shape, contiguous (``eager.cpu_dense``), nothing tracing
# (``eager.fast``, tested before an address is read), the cpu or torch provider chosen. A call the memory
# checks above would refuse goes to the general path, which raises.

cpu_kernels = eager.lazy_module("error_feedback.cpu")  # the cpu provider's kernels, for the fast paths
_RA_LAYOUTS = Memo(64)


def _residual_add_layout(
    x: torch.Tensor, r: torch.Tensor, out: torch.Tensor, ptrs: tuple[int, int, int]
) -> tuple | None:
    """``(guard, numel, any requires_grad)`` when residual_add's fast path may run on these tensors at these
    addresses: :func:`eager.cpu_dense` fp32, one shape, not empty; out either is x (or r) or shares no byte
    with it. Remembered per addresses (``_RA_LAYOUTS``), where a C-level guard on everything else it read
    (type, dtype, device, shape, strides, requires_grad) confirms it on the next call."""
    if not (eager.cpu_dense(x) and eager.cpu_dense(r) and eager.cpu_dense(out) and x.shape == r.shape == out.shape):
        return None
    nb = 4 * x.numel()
    px, pr, po = ptrs
    if not (nb and all(po == p or po + nb <= p or p + nb <= po for p in (px, pr))):
        return None
    hit = (tensor_guards((x, r, out)), x.numel(), x.requires_grad or r.requires_grad or out.requires_grad)
    if hit[0] is not None:
        _RA_LAYOUTS.put(ptrs, hit)
    return hit


def _error_update_ptrs(acc: torch.Tensor, approx: torch.Tensor, res: torch.Tensor, out: torch.Tensor | None,
                       n: int) -> tuple[int, int, int, int] | None:  # fmt: skip
    """The addresses of error_update's fp32 tensors of n elements (0 for no ``out``), each read once, when its
    fast path may write them: what :func:`_error_update_overlaps` allows (residual may be acc, out may be
    approx; nothing else shares a byte); else None."""
    nb = 4 * n
    pa, pp, pr = acc.data_ptr(), approx.data_ptr(), res.data_ptr()
    if not ((pr + nb <= pp or pp + nb <= pr) and (pr == pa or pr + nb <= pa or pa + nb <= pr)):
        return None
    if out is None:
        return pa, pp, pr, 0
    po = out.data_ptr()
    if (
        (po + nb <= pr or pr + nb <= po) and (po + nb <= pa or pa + nb <= po)
        and (po == pp or po + nb <= pp or pp + nb <= po)
    ):  # fmt: skip
        return pa, pp, pr, po
    return None


# --------------------------------------------------------------------------------------------------
# Public API


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
        # The common case, fp32 on the CPU (equal shapes, contiguous: the same elements in the same order).
        key = (x.data_ptr(), residual.data_ptr(), out.data_ptr())
        hit = _RA_LAYOUTS.get(key)  # (guard, numel, any requires_grad): all fixed by what the guard checks
        if hit is None or not hit[0].check(x, residual, out):
            hit = _residual_add_layout(x, residual, out, key)
        sel = axpby.select(_CPU, _F32, hit[1], provider or None) if hit is not None else None
        if sel == "cpu":  # its kernel straight on the tensors' memory (plain fp32 arrays: no grad semantics)
            b = cpu_kernels().axpby_ptr(key[0], key[1], key[2], hit[1], 1.0, bool(check_finite))
            eager.bump(out)
            if b:
                raise_nonfinite(b, "torsh_kernels.residual_add", "x + residual")
            return out
        if sel == "torch":  # what the torch provider does, without the flattening views and the custom op
            if hit[2]:
                with eager.no_grad():  # as the custom op ran: the result never requires grad
                    torch.add(x, residual, out=out)
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
        _residual_add_overlaps(xf, rf, of)
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
        eager.cpu_dense(acc) and eager.cpu_dense(approx) and eager.cpu_dense(residual)
        and acc.shape == approx.shape == residual.shape
        and (n := acc.numel())
        and (out is None or (eager.cpu_dense(out) and out.shape == acc.shape))
        and eager.fast()
        and (ptrs := _error_update_ptrs(acc, approx, residual, out, n)) is not None
        and (sel := error_update_impl.select(_CPU, _F32, n, provider or None)) in _FAST
    ):  # fmt: skip
        # The common case, fp32 on the CPU (equal shapes, contiguous: the same elements in the same order).
        if sel == "cpu":  # its kernel straight on the tensors' memory
            cpu_kernels().error_update_ptr(*ptrs, n, out is not None)
            eager.bump(residual, out)
            return
        # the torch provider's two calls, without the flattening views and the custom op
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
