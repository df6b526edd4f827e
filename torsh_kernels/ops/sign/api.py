"""The sign family's public ops (sign_compress, sign_decompress): each validates its inputs (typed errors),
allocates its outputs and runs its provider (``providers.py``), through a ``torsh::`` custom op with a fake
implementation so it composes with ``torch.compile``. Their CPU fast paths run the common fp32 cases straight
from the arguments: the cpu provider's kernels on the tensors' memory, or the torch provider's passes."""

from __future__ import annotations

import math

import torch

from ...checks import check_int
from ...errors import DeviceMismatchError, DTypeError, ShapeError
from .. import eager
from ..common import (
    as_count,
    check_alpha,
    check_tensor,
    decode_out,
    flat_inout,
    flat_input,
    no_overlap,
    on_device,
    raise_nonfinite,
    select_provider,
)
from ..registry import check_provider
from .providers import abs_sum_impl, pack_impl, pack_signs, signs, unpack_impl

__all__ = ["sign_compress", "sign_decompress"]

_F32 = torch.float32
_U8 = torch.uint8
_ZERO = torch.zeros(())  # the torch fast path's 0 (a tensor operand: no scalar wrapped per call)
_EXACT_INT = 1 << 53
_COMPRESS = "torsh_kernels.sign_compress"
_DECOMPRESS = "torsh_kernels.sign_decompress"


def _raise_nonfinite(bad: int, has_residual: bool) -> None:
    raise_nonfinite(bad, _COMPRESS, "x + residual" if has_residual else "x")


def _mean(total: float, n: int) -> torch.Tensor:
    """mean |v| from the fp64 sum as a host float: divided by n in fp64, rounded once to fp32."""
    return torch.scalar_tensor(total / n, dtype=_F32)


# --------------------------------------------------------------------------------------------------
# Custom ops (torch.library): opaque to torch.compile, with fake implementations.


@torch.library.custom_op("torsh::sign_compress", mutates_args=("residual",))
def _sign_op(x: torch.Tensor, residual: torch.Tensor | None, check_finite: bool,
             provider: str, traced: bool = False) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``traced``: the public function was traced (torch.compile) and left the memory check to run here."""
    if traced and residual is not None:
        no_overlap(residual.view(-1), x.view(-1), _COMPRESS, "residual", "x")
    n = x.numel()
    bits = torch.empty(-(-n // 8), dtype=_U8, device=x.device)
    if n == 0:
        return bits, torch.zeros((), dtype=_F32, device=x.device)
    name = select_provider(abs_sum_impl, x, provider)
    r = residual.view(-1) if residual is not None else None
    with on_device(x.device):
        total, bad = abs_sum_impl(name, x.view(-1), r)
        if check_finite and (b := as_count(bad)):
            _raise_nonfinite(b, r is not None)
        # mean |v|: the fp64 sum divided by n in fp64, rounded once to fp32 (a host float from the cpu provider)
        scale = _mean(total, n) if type(total) is float else (total / n).to(_F32)
        pack_impl(name, x.view(-1), r, bits, scale)
    return bits, scale


@_sign_op.register_fake
def _(x, residual, check_finite, provider, traced=False):
    return x.new_empty(-(-x.numel() // 8), dtype=_U8), x.new_empty((), dtype=_F32)


@torch.library.custom_op("torsh::sign_decompress", mutates_args=("out",))
def _sign_decompress_op(bits: torch.Tensor, scale: torch.Tensor, out: torch.Tensor, alpha: float, accumulate: bool,
                        provider: str) -> None:  # fmt: skip
    if out.numel():
        name = select_provider(unpack_impl, out, provider)
        with on_device(out.device):
            unpack_impl(name, bits, scale.reshape(()).float(), out.view(-1), alpha, accumulate)


@_sign_decompress_op.register_fake
def _(bits, scale, out, alpha, accumulate, provider):
    return None


# --------------------------------------------------------------------------------------------------
# Public API

_cpu_kernels = eager.lazy_module("sign.cpu")  # the cpu provider's kernels, for the fast paths


def sign_compress(
    x: torch.Tensor,
    residual: torch.Tensor | None = None,
    *,
    check_finite: bool = True,
    provider: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """1-bit compression of ``v = x + residual``: ``(bits, scale)``, bits uint8 [ceil(n/8)] (bit j of byte
    i is 1 where element 8i+j is >= 0), scale = mean |v| (fp32, 0-dim). With ``residual`` (updated in
    place): ``residual = v - scale * sign(v)``."""
    if eager.cpu_dense(x) and 0 < (n := x.numel()) < _EXACT_INT:
        if (
            eager.cpu_dense_or_none(residual, n)
            and eager.picks(abs_sum_impl, n, provider, "cpu")
            and (residual is None or eager.disjoint(x, residual, 4 * n))
        ):
            # The common case on the CPU with the cpu provider: its two passes straight on the tensors' memory.
            K = _cpu_kernels()
            bits = torch.empty((n + 7) // 8, dtype=_U8)
            scale, bad = K.compress_ptr(x.data_ptr(), residual.data_ptr() if residual is not None else 0,
                                        residual is not None, n, bits.data_ptr(), bool(check_finite))  # fmt: skip
            if bad and check_finite:
                _raise_nonfinite(bad, residual is not None)
            if residual is not None:
                eager.bump(residual)
            return bits, torch.scalar_tensor(scale, dtype=_F32)
        if residual is None and not n % 8 and eager.picks(abs_sum_impl, n, provider, "torch"):
            # The common case, fp32 on the CPU without a residual, whole bytes: the torch provider's two passes
            # with its constants cached. mean |x| is the fp64 sum (read once for the finite check anyway)
            # divided by n in fp64 and rounded to fp32, here in Python: the same IEEE operations.
            with eager.no_grad():
                total = x.abs().sum(dtype=torch.float64).item()
                if math.isfinite(total):
                    return pack_signs(x.ge(_ZERO).view(-1)), _mean(total, n)
    check_provider(provider)
    xf = flat_input(x, _COMPRESS, "x")
    rf, traced = None, False
    if residual is not None:
        rf = flat_inout(residual, _COMPRESS, "residual", xf.numel(), xf.device)
        traced = eager.deferred(xf, rf)  # the memory check then runs in the op, at run time
        if not traced:
            no_overlap(rf, xf, _COMPRESS, "residual", "x")
    return eager.call(_sign_op, (1,), xf, rf, bool(check_finite), provider or "", traced)


def sign_decompress(
    bits: torch.Tensor,
    scale: torch.Tensor | float,
    numel: int,
    *,
    out: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
    accumulate: bool = False,
    alpha: float = 1.0,
    provider: str | None = None,
) -> torch.Tensor:
    """``+-alpha * scale`` per element from packed signs (plus ``out`` with ``accumulate``)."""
    if (
        out is None and dtype is _F32 and not accumulate and type(numel) is int and numel > 0
        and eager.cpu_dense(bits, _U8) and bits.dim() == 1 and eager.cpu_dense(scale) and eager.finite_scalar(alpha)
    ):  # fmt: skip
        # The common case on the CPU into a new fp32 tensor (a one-element fp32 scale, whole bits).
        if scale.numel() == 1 and bits.numel() == (numel + 7) // 8 and eager.picks(unpack_impl, numel, provider, "cpu"):
            # With the cpu provider: its kernel.
            K = _cpu_kernels()
            out = torch.empty(numel)
            K.unpack_ptr(bits.data_ptr(), K.unpack_scale(scale, alpha), out.data_ptr(), numel)
            return out
        if (
            alpha == 1.0 and scale.dim() == 0 and not numel % 8 and bits.numel() * 8 == numel
            and eager.picks(unpack_impl, numel, provider, "torch")
        ):  # fmt: skip
            # Whole bytes with the torch provider: its unpacking, its +-scale returned instead of copied into a
            # new buffer.
            with eager.no_grad():
                return signs(bits, scale)
    check_provider(provider)
    bits = check_tensor(bits, _DECOMPRESS, "bits")
    if bits.dtype != _U8:
        raise DTypeError(f"{_DECOMPRESS}: bits have dtype {bits.dtype}; expected uint8")
    numel = check_int(numel, _DECOMPRESS, "numel", 0)
    if bits.numel() != -(-numel // 8):
        raise ShapeError(f"{_DECOMPRESS}: {numel} signs need {-(-numel // 8)} bytes, bits has {bits.numel()}")
    if isinstance(scale, (int, float)) and not isinstance(scale, bool):
        scale = torch.tensor(float(scale), device=bits.device)
    scale = check_tensor(scale, _DECOMPRESS, "scale")
    if not scale.is_floating_point():
        raise DTypeError(
            f"{_DECOMPRESS}: scale has dtype {scale.dtype}; expected a floating-point scale (from sign_compress)"
        )
    if scale.numel() != 1:
        raise ShapeError(f"{_DECOMPRESS}: scale must be one element, got {scale.numel()}")
    if scale.device != bits.device:
        raise DeviceMismatchError(f"{_DECOMPRESS}: scale is on {scale.device}, bits on {bits.device}")
    alpha = check_alpha(alpha, _DECOMPRESS)
    out, of = decode_out(out, numel, dtype, bits.device, _DECOMPRESS, bool(accumulate))
    if not eager.deferred(bits, scale, of):
        no_overlap(of, bits, _DECOMPRESS, "out", "bits")
        no_overlap(of, scale, _DECOMPRESS, "out", "scale")
    eager.call(
        _sign_decompress_op, (2,), bits.reshape(-1).contiguous(), scale, of, alpha, bool(accumulate), provider or ""
    )
    return out
