"""Torch reference of the orthogonalisation op: the plain oracle the tests compare every provider with (any
device, plain PyTorch; modified Gram-Schmidt in fp64), with the per-dtype tolerance and the matrix-list form
both it and the public op accept."""

from __future__ import annotations

import torch

from ...errors import ArgumentTypeError, ShapeError
from ..common import check_tensor

__all__ = ["default_rtol", "matrix_list", "orthogonalize_ref"]


def matrix_list(matrices: object, what: str) -> list[torch.Tensor]:
    """``matrices`` ([m, r], [B, m, r] or a list of [m_i, r] tensors) as a list of 2-D tensors; typed errors for
    anything else."""
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


def default_rtol(dtype: torch.dtype) -> float:
    """Relative norm below which a projected column counts as dependent (zeroed), per input dtype."""
    return {torch.float64: 1e-10, torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}[dtype]


def orthogonalize_ref(matrices, *, rtol: float | None = None):
    """Modified Gram-Schmidt, twice per column, in fp64; dependent/zero columns become zero columns."""
    mats = matrix_list(matrices, "orthogonalize_ref")
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
