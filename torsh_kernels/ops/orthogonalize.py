"""Orthogonalisation op: the step between PowerSGD's two matmuls.

- ``orthogonalize(matrices)``: in-place orthonormalisation of the columns of tall thin matrices
  ([m, r], [B, m, r] or a list of [m_i, r]). The kernels run CholeskyQR2 with the Gram matrix
  accumulated in fp64: two passes over the data per iteration, independent of r, where Gram-Schmidt
  makes r. A column whose component orthogonal to the previous ones is below ``rtol`` of its own norm
  (a zero or linearly dependent column) becomes a zero column, never NaN.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as _np
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
from .common import COMPRESS_DTYPES, Ranges, check_dtype, check_tensor, on_device, ptr_table
from .registry import Op, check_provider

__all__ = ["MAX_ITERS", "default_rtol", "orthogonalize", "orthogonalize_ref"]

ORTHO_DTYPES = (*COMPRESS_DTYPES, torch.float64)
MAX_KERNEL_RANK = 32  # orthogonalize kernels keep an r x r Gram matrix in registers / local memory
MAX_ITERS = 8
"""The most CholeskyQR iterations a call may ask for: 2 (CholeskyQR2, the default) orthogonalises to fp32
rounding for condition numbers up to ~1e7, 3 (CholeskyQR3) beyond; each further one only repeats the last.
(The Triton kernel unrolls its iterations, so a huge ``iters`` would otherwise compile without end.)"""
ORTHO_ELEMS = 4096  # elements of the [ROWS, RP, RP] product tile in the orthogonalize kernel
# 16 of them a thread (fp64 products): at 4 warps (32 a thread) fp32 rank 8 and 32 and bf16 rank 32 spilled 16 bytes
ORTHO_WARPS = 8


# --------------------------------------------------------------------------------------------------
# Validation


def _matrix_list(matrices: object, what: str) -> list[torch.Tensor]:
    if isinstance(matrices, torch.Tensor):
        if matrices.dim() == 2:
            return [matrices]
        if matrices.dim() == 3:
            return list(matrices.unbind(0))
        raise ShapeError(f"{what}: expected a [m, r] or [B, m, r] tensor, got shape {tuple(matrices.shape)}")
    if not isinstance(matrices, (list, tuple)):
        raise ArgumentTypeError(
            f"{what}: matrices must be a tensor or a list of 2-D tensors, got {type(matrices).__name__}"
        )
    for i, m in enumerate(matrices):
        check_tensor(m, what, f"matrices[{i}]")
        if m.dim() != 2:
            raise ShapeError(f"{what}: matrices[{i}] has shape {tuple(m.shape)}; expected [m, r]")
    return list(matrices)


# --------------------------------------------------------------------------------------------------
# Torch references (the oracles for the tests; plain PyTorch, any device)


def default_rtol(dtype: torch.dtype) -> float:
    """Relative norm below which a projected column counts as dependent (zeroed), per input dtype."""
    return {torch.float64: 1e-10, torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}[dtype]


def orthogonalize_ref(matrices, *, rtol: float | None = None):
    """Modified Gram-Schmidt, twice per column, in fp64; dependent/zero columns become zero columns."""
    mats = _matrix_list(matrices, "orthogonalize_ref")
    for m in mats:
        a = m.double()
        q = torch.zeros_like(a)
        tol = default_rtol(m.dtype) if rtol is None else rtol
        for j in range(a.shape[1]):
            v = a[:, j].clone()
            n0 = torch.linalg.vector_norm(v)
            for _ in range(2):
                for i in range(j):
                    v -= (q[:, i] @ v) * q[:, i]
            nv = torch.linalg.vector_norm(v)
            q[:, j] = torch.where((n0 > 0) & (nv > tol * n0), v / nv, 0.0)  # (else the zero column it was)
        m.copy_(q)
    return matrices


# --------------------------------------------------------------------------------------------------
# Provider implementations. Inputs are validated, contiguous and 2-D matrices, on one device.

_ortho = Op("orthogonalize")


def _gram_factor_torch(G: torch.Tensor, rtol2: float) -> torch.Tensor:
    """Batched [B, r, r] fp64 version of the kernels' _gram_factor."""
    B, r, _ = G.shape
    T = torch.zeros_like(G)
    eye = torch.eye(r, dtype=G.dtype, device=G.device)
    for j in range(r):
        t = eye[j].expand(B, r).clone()
        for _ in range(2):
            gt = torch.einsum("bij,bj->bi", G, t)
            c = torch.einsum("bai,ba->bi", T, gt)
            t = t - torch.einsum("bai,bi->ba", T, c)
        nrm2 = torch.einsum("bi,bi->b", t, torch.einsum("bij,bj->bi", G, t))
        gjj = G[:, j, j]
        ok = (nrm2 > rtol2 * gjj) & (gjj > 0)
        inv = torch.where(ok, torch.rsqrt(torch.where(ok, nrm2, 1.0)), 0.0)
        T[:, :, j] = t * inv[:, None]
    return T


@_ortho.register("torch")
def _ortho_torch(mats, rtol, iters):
    """Householder QR (torch.linalg.qr, batched per shape) with the signs fixed to a positive diagonal of
    R: the same Q as Gram-Schmidt. A matrix with a dependent or zero column (|R_jj| below rtol of the
    column's norm) takes the CholeskyQR path instead, because Householder fills such a column with an
    arbitrary direction that the later columns are then made orthogonal to."""
    groups: dict[tuple[int, ...], list[torch.Tensor]] = {}
    batches = [m for m in mats if m.dim() == 3]
    for m in mats:
        if m.dim() == 2:
            groups.setdefault(tuple(m.shape), []).append(m)
    work = [(b.shape[1], b.shape[2], list(b.unbind(0)), b) for b in batches]
    work += [(rows, cols, ms, _as_batch(ms)) for (rows, cols), ms in groups.items()]
    for rows, cols, ms, view in work:  # view: the [B, m, r] tensor holding ms, when there is one
        cdt = torch.float64 if ms[0].dtype == torch.float64 else torch.float32
        a = view.to(cdt) if view is not None else torch.stack([m.to(cdt) for m in ms])  # [B, m, r]
        ok = torch.zeros(len(ms), dtype=torch.bool, device=a.device)
        if rows >= cols:
            q, r = torch.linalg.qr(a)
            d = torch.diagonal(r, dim1=-2, dim2=-1)  # [B, r]
            norms = torch.linalg.vector_norm(a, dim=1)
            ok = ((d.abs() > rtol * norms) & (norms > 0)).all(dim=1)
            q = q * torch.where(d < 0, -1.0, 1.0).to(cdt)[:, None, :]
        slow = (~ok).nonzero().view(-1).tolist()
        if slow:  # rank-deficient (or wider than tall): Gram-Schmidt in the Gram-matrix metric, in fp64
            b = a[slow].double()
            for _ in range(iters):
                b = b @ _gram_factor_torch(b.transpose(1, 2) @ b, rtol * rtol)
        if rows >= cols and view is not None:
            if slow:
                q[slow] = b.to(cdt)
            view.copy_(q)
            continue
        for i, m in enumerate(ms):
            m.copy_(b[slow.index(i)] if i in slow else q[i])


_T = torch.Tensor
_F32 = torch.float32
_CPU = torch.device("cpu")


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


def _as_batch(ms: list[torch.Tensor]) -> torch.Tensor | None:
    """One [B, m, r] view over matrices that lie back to back in memory, else None."""
    m0 = ms[0]
    step = m0.numel() * m0.element_size()
    if all(m.data_ptr() == m0.data_ptr() + i * step for i, m in enumerate(ms)):
        return m0.as_strided((len(ms), *m0.shape), (m0.numel(), m0.shape[1], 1))
    return None


@_ortho.register("triton")
def _ortho_triton(mats, rtol, iters):
    import triton

    from . import _orthogonalize_triton as K

    r = mats[0].shape[1]
    rp = max(2, triton.next_power_of_2(r))
    rows = max(1, min(256, triton.next_power_of_2(max(1, ORTHO_ELEMS // (rp * rp)))))
    table = ptr_table([v for m in mats for v in (m.data_ptr(), m.shape[0])], mats[0].device, "ortho")
    K._orthogonalize_kernel[(len(mats),)](table, mats[0], r, rtol * rtol, ROWS=rows, RP=rp, ITERS=iters,
                                          num_warps=ORTHO_WARPS)  # fmt: skip


@_ortho.register("numba")
def _ortho_numba(mats, rtol, iters):
    from . import _orthogonalize_numba as K

    K.orthogonalize(mats, rtol, iters)


@_ortho.register("cpu")
def _ortho_cpu(mats, rtol, iters):
    from . import _orthogonalize_cpu as K

    K.orthogonalize(mats, rtol, iters)


# --------------------------------------------------------------------------------------------------
# Custom ops (torch.library): opaque to torch.compile, with fake implementations.


@torch.library.custom_op("torsh::orthogonalize", mutates_args=("matrices",))
def _ortho_op(matrices: list[torch.Tensor], rtol: float, iters: int, provider: str, traced: bool = False,
              check_finite: bool = False) -> None:  # fmt: skip
    """``matrices``: [m, r] matrices and/or [B, m, r] batches, one r. ``traced``: the public function was
    traced (torch.compile) and left the memory check and (with ``check_finite``) the NaN/Inf check to run
    here, before anything is written."""
    if traced:  # (the list as the caller passed it: the indices in a message are the caller's)
        _ortho_checks(matrices, check_finite)
        matrices = [m for m in matrices if m.numel()]
    m0 = matrices[0]
    requested = provider or None
    name = _ortho.select(m0.device, m0.dtype, m0.numel(), requested)
    if name in ("triton", "numba") and m0.shape[-1] > MAX_KERNEL_RANK:
        if requested is not None:
            raise ShapeError(
                f"torsh_kernels.orthogonalize: the {name} kernel handles up to {MAX_KERNEL_RANK} columns, got "
                f"{m0.shape[-1]}; use provider='torch' (or None) for wider matrices"
            )
        name = "torch"  # the GPU kernels keep r x r in registers; wider matrices take the batched torch path
    with on_device(m0.device):
        if name == "torch":
            _ortho(name, matrices, rtol, iters)
        else:  # the kernels take one table row per matrix
            _ortho(name, [v for m in matrices for v in (m.unbind(0) if m.dim() == 3 else (m,))], rtol, iters)


@_ortho_op.register_fake
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
# Public API

_cpu_kernels = eager.lazy_module("_orthogonalize_cpu")  # the cpu provider's kernels, for the fast paths


def _checked_matrices(matrices: object, what: str) -> list[torch.Tensor]:
    """``orthogonalize``'s matrices as a list (a 3-D batch as one entry), checked: dtypes, one dtype, one
    device, one column count, contiguous."""
    if isinstance(matrices, torch.Tensor) and matrices.dim() == 3:  # one batch: validated and passed whole
        check_dtype(matrices, what, "matrices", ORTHO_DTYPES)
        if not matrices.is_contiguous():
            raise ShapeError(f"{what}: matrices must be contiguous (they are orthogonalised in place)")
        mats = [matrices]
    else:
        mats = _matrix_list(matrices, what)
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
    to :data:`MAX_ITERS` (2 is CholeskyQR2: orthogonal to fp32 rounding for condition numbers up to ~1e7).
    NaN/Inf raise :class:`NonFiniteError` before anything is written (``check_finite``). Meta tensors are
    accepted (nothing is computed: the shapes are the result).
    """
    if (
        type(matrices) is _T and matrices.dtype is _F32 and matrices.is_cpu and matrices.dim() == 2
        and matrices.is_contiguous() and 1 <= matrices.shape[1] <= matrices.shape[0]
        and (rtol is None or (rtol.__class__ is float and 0.0 <= rtol < 1.0))
        and iters.__class__ is int and 1 <= iters <= MAX_ITERS
        and eager.fast()
        and (sel := _ortho.select(_CPU, _F32, matrices.numel(), provider or None)) in ("torch", "cpu")
    ):  # fmt: skip
        tol = 1e-4 if rtol is None else rtol
        if sel == "cpu":  # its kernel on the matrix's memory; False (nothing written) on a NaN/Inf
            K = _cpu_kernels()
            done = K.ortho_ptr(matrices.data_ptr(), matrices.shape[0], matrices.shape[1], tol * tol, iters,
                               bool(check_finite))  # fmt: skip
            if done:
                eager.bump(matrices)
        else:
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
        _ortho_op([m.detach() for m in mats], float(tol), iters, provider or "", True, bool(check_finite))
        return matrices
    mats = live
    if check_finite:
        _check_finite(mats)
    eager.call(_ortho_op, (0,), [m.detach() for m in mats], float(tol), iters, provider or "")
    return matrices
