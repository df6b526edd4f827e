"""The orthogonalisation family's public op: ``orthogonalize`` validates its matrices (typed errors), picks a
provider and runs it (``providers.py``) through the ``torsh::orthogonalize`` custom op, which has a fake
implementation so it composes with ``torch.compile``; one fp32/fp64 matrix or batch on the CPU takes a fast path
straight to the cpu kernel (one call for the whole batch), or one fp32 matrix to the torch provider's arithmetic
(``eager``'s predicates decide when)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as _np
import torch

from ...checks import check_int
from ...errors import (
    ArgumentTypeError,
    DeviceMismatchError,
    DTypeError,
    InvalidArgumentError,
    NonFiniteError,
    ShapeError,
)
from .. import eager
from ..common import COMPRESS_DTYPES, Ranges, check_dtype, on_device
from ..registry import check_provider
from .providers import MAX_KERNEL_RANK, ortho_impl
from .reference import default_rtol, matrix_list

__all__ = ["MAX_ITERS", "ORTHO_DTYPES", "ortho_op", "orthogonalize"]

ORTHO_DTYPES = (*COMPRESS_DTYPES, torch.float64)
MAX_ITERS = 8
"""The most CholeskyQR iterations a call may ask for: 2 (CholeskyQR2, the default) orthogonalises to fp32
rounding for condition numbers up to ~1e7, 3 (CholeskyQR3) beyond; each further one only repeats the last.
(The Triton kernel unrolls its iterations, so a huge ``iters`` would otherwise compile without end.)"""
_FAST_DTYPES = {torch.float32: default_rtol(torch.float32), torch.float64: default_rtol(torch.float64)}
"""The dtypes of the fast path, with their default rtol."""
_F32 = torch.float32
_CPU = torch.device("cpu")
_FAST = ("cpu", "torch")  # the providers the fast path runs


# --------------------------------------------------------------------------------------------------
# Custom op (torch.library): opaque to torch.compile, with a fake implementation.


@torch.library.custom_op("torsh::orthogonalize", mutates_args=("matrices",))
def ortho_op(matrices: list[torch.Tensor], rtol: float, iters: int, provider: str, traced: bool = False,
             check_finite: bool = False) -> None:  # fmt: skip
    """``matrices``: [m, r] matrices and/or [B, m, r] batches, one r. ``traced``: the public function was
    traced (torch.compile) and left the memory check and (with ``check_finite``) the NaN/Inf check to run
    here, before anything is written."""
    if traced:  # (the list as the caller passed it: the indices in a message are the caller's)
        _ortho_checks(matrices, check_finite)
        matrices = [m for m in matrices if m.numel()]
    m0 = matrices[0]
    requested = provider or None
    name = ortho_impl.select(m0.device, m0.dtype, m0.numel(), requested)
    if name in ("triton", "numba") and m0.shape[-1] > MAX_KERNEL_RANK:
        if requested is not None:
            raise ShapeError(
                f"torsh_kernels.orthogonalize: the {name} kernel handles up to {MAX_KERNEL_RANK} columns, got "
                f"{m0.shape[-1]}; use provider='torch' (or None) for wider matrices"
            )
        name = "torch"  # the GPU kernels keep r x r in registers; wider matrices take the batched torch path
    with on_device(m0.device):
        if name == "torch":
            ortho_impl(name, matrices, rtol, iters)
        else:  # the kernels take one table row per matrix
            ortho_impl(name, [v for m in matrices for v in (m.unbind(0) if m.dim() == 3 else (m,))], rtol, iters)


@ortho_op.register_fake
def _(matrices, rtol, iters, provider, traced=False, check_finite=False):
    return None


def _ortho_checks(mats: list[torch.Tensor], check_finite: bool) -> None:
    """The checks that read memory and values (the public function's, run here for a traced call): no
    two of ``mats`` share memory; with ``check_finite``, no NaN/Inf."""
    _check_clash(mats)
    if check_finite:
        _check_finite(mats)


def _check_clash(mats: list[torch.Tensor]) -> None:
    if len(mats) > 1:
        clash = Ranges.of(mats).contiguous_clash()
        if clash is not None:
            raise ShapeError(f"torsh_kernels.orthogonalize: matrices[{clash[0]}] and matrices[{clash[1]}] share memory")


def _check_finite(mats: list[torch.Tensor]) -> None:
    """NonFiniteError for NaN/Inf: the fp64 sum (finite inputs cannot overflow it), then the exact count
    where it is not finite."""
    if not math.isfinite(float(sum(m.sum(dtype=torch.float64) for m in mats))):
        bad = sum(int((~torch.isfinite(m)).sum()) for m in mats)
        if bad:
            raise NonFiniteError(
                f"torsh_kernels.orthogonalize: the matrices hold {bad} non-finite element(s); nothing was written"
            )


# --------------------------------------------------------------------------------------------------
# Fast path: one contiguous fp32/fp64 [rows, cols] CPU matrix or [B, rows, cols] batch, nothing tracing
# (``eager.fast``), the cpu provider chosen; or one fp32 matrix, rows >= cols, the torch provider chosen.

_cpu_kernels = eager.lazy_module("orthogonalize.cpu")  # the cpu provider's kernels, for the fast paths


def _ortho_fast(m: torch.Tensor, rtol: float, check_finite: bool) -> bool:
    """The torch provider on one contiguous fp32 [rows, cols] CPU matrix, rows >= cols, when every column
    passes the Householder path's test: the same batched QR, norms and sign fix on the same [1, rows,
    cols] view, with the per-column test and the signs read on the host (cols numbers each; fp32
    arithmetic reproduced exactly: the product of two fp32 values is exact in a double and rounded once).
    The finite check reads the column norms it needs anyway: a NaN/Inf element makes its column's norm
    non-finite (so does an fp32 overflow of a square, which the general path's exact check then clears).
    False, with nothing written, when the general path must run (a non-finite norm, which it checks and
    reports; a column for the CholeskyQR path)."""
    with eager.no_grad():
        a = m.unsqueeze(0)
        norms = torch.linalg.vector_norm(a, dim=1).tolist()[0]
        if check_finite and not all(map(math.isfinite, norms)):
            return False  # NaN/Inf (or an fp32 overflow of a square): the general path checks and reports
        q, r = torch.linalg.qr(a)
        rr = r.tolist()[0]
        t32 = float(_np.float32(rtol))
        signs = []
        for j, nj in enumerate(norms):
            dj = rr[j][j]
            if not (nj > 0 and abs(dj) > float(_np.float32(t32 * nj))):
                return False
            signs.append(-1.0 if dj < 0 else 1.0)
        if -1.0 in signs:
            torch.mul(q, torch.tensor(signs), out=a)
        else:
            a.copy_(q)  # (q * 1.0 is q)
        return True


# --------------------------------------------------------------------------------------------------
# Public API


def _checked_matrices(matrices: object, what: str) -> list[torch.Tensor]:
    """``orthogonalize``'s matrices as a list (a 3-D batch as one entry), checked: dtypes, one dtype, one
    device, one column count, contiguous."""
    if isinstance(matrices, torch.Tensor) and matrices.dim() == 3:  # one batch: validated and passed whole
        check_dtype(matrices, what, "matrices", ORTHO_DTYPES)
        if not matrices.is_contiguous():
            raise ShapeError(f"{what}: matrices must be contiguous (they are orthogonalised in place)")
        mats = [matrices]
    else:
        mats = matrix_list(matrices, what)
    m0 = mats[0] if mats else None
    for i, m in enumerate(mats):
        check_dtype(m, what, f"matrices[{i}]", ORTHO_DTYPES)
        if m.dtype != m0.dtype:
            raise DTypeError(f"{what}: matrices[{i}] is {m.dtype}, matrices[0] is {m0.dtype}")
        if m.device != m0.device:
            raise DeviceMismatchError(f"{what}: matrices[{i}] is on {m.device}, matrices[0] on {m0.device}")
        if m.shape[-1] != m0.shape[-1]:
            raise ShapeError(f"{what}: matrices[{i}] has {m.shape[-1]} columns, matrices[0] has {m0.shape[-1]}")
        if not m.is_contiguous():
            raise ShapeError(f"{what}: matrices[{i}] must be contiguous (it is orthogonalised in place)")
    return mats


def orthogonalize(
    matrices: torch.Tensor | Sequence[torch.Tensor],
    *,
    rtol: float | None = None,
    iters: int = 2,
    check_finite: bool = True,
    provider: str | None = None,
) -> torch.Tensor | Sequence[torch.Tensor]:
    """Orthonormalise the columns of each tall thin matrix in place (the PowerSGD step) and return it.

    ``matrices``: a contiguous [m, r] or [B, m, r] tensor, or a list of contiguous [m_i, r] tensors
    (one r, one dtype, one device), fp32/fp64/fp16/bf16. Column j becomes the normalised part of column j
    orthogonal to columns < j (the Q of a thin QR with a positive diagonal); if that part is below
    ``rtol`` (default per dtype: fp32 1e-4, fp16 1e-2, bf16 5e-2, fp64 1e-10) of the column's norm, the
    column is zero or dependent on the previous ones and becomes zero. ``iters`` CholeskyQR iterations, 1
    to :data:`MAX_ITERS` (2 is CholeskyQR2: orthogonal to fp32 rounding for condition numbers up to ~1e7); the
    cpu provider stops early once a further iteration would move no column by more than its rounding.
    NaN/Inf raise :class:`NonFiniteError` before anything is written (``check_finite``). Meta tensors are
    accepted (nothing is computed: the shapes are the result).
    """
    if (
        type(matrices) is torch.Tensor and matrices.dtype in _FAST_DTYPES and matrices.is_cpu
        and 2 <= matrices.dim() <= 3 and matrices.numel() and matrices.is_contiguous()
        and (rtol is None or (rtol.__class__ is float and 0.0 <= rtol < 1.0))
        and iters.__class__ is int and 1 <= iters <= MAX_ITERS
        and eager.fast()
        and (sel := ortho_impl.select(_CPU, matrices.dtype, matrices.numel(), provider or None)) in _FAST
    ):  # fmt: skip
        # The common cases, one fp32/fp64 matrix or batch on the CPU: the cpu provider's kernel on its memory
        # (False, nothing written, on a NaN/Inf: the general path reports it), or one fp32 matrix through the
        # torch provider's arithmetic, without the custom op.
        tol = _FAST_DTYPES[matrices.dtype] if rtol is None else rtol
        done = False
        if sel == "cpu":
            done = _cpu_kernels().ortho_tensor(matrices, tol, iters, bool(check_finite))
            if done:
                eager.bump(matrices)
        elif matrices.dtype is _F32 and matrices.dim() == 2 and matrices.shape[1] <= matrices.shape[0]:
            done = _ortho_fast(matrices, tol, check_finite)
        if done:
            return matrices
    what = "torsh_kernels.orthogonalize"
    check_provider(provider)
    mats = _checked_matrices(matrices, what)
    if not mats:
        return matrices
    m0 = mats[0]
    # While torch.compile traces, or on meta tensors (no memory, no values: the op's fake implementation
    # runs), the memory and NaN/Inf checks are left to the op (at run time) or have nothing to read.
    traced = eager.compiling() or m0.is_meta
    if not traced:
        _check_clash(mats)
    iters = check_int(iters, what, "iters", 1, MAX_ITERS)
    tol = default_rtol(m0.dtype) if rtol is None else rtol
    if isinstance(tol, bool) or not isinstance(tol, (int, float)):
        raise ArgumentTypeError(f"{what}: rtol must be None or a number in [0, 1), got {type(rtol).__name__}")
    if not (0.0 <= tol < 1.0):
        raise InvalidArgumentError(f"{what}: rtol must be a number in [0, 1), got {rtol!r}")
    live = [m for m in mats if m.numel()]
    if not live or m0.shape[-1] == 0:
        return matrices
    if traced:
        ortho_op([m.detach() for m in mats], float(tol), iters, provider or "", True, bool(check_finite))
        return matrices
    mats = live
    if check_finite:
        _check_finite(mats)
    eager.call(ortho_op, (0,), [m.detach() for m in mats], float(tol), iters, provider or "")
    return matrices
