"""Orthogonalisation op: the step between PowerSGD's two matmuls.

- ``orthogonalize(matrices)``: in-place orthonormalisation of the columns of tall thin matrices
  ([m, r], [B, m, r] or a list of [m_i, r]). The kernels run CholeskyQR2 with the Gram matrix
  accumulated in fp64: two passes over the data per iteration, independent of r, where Gram-Schmidt
  makes r. A column whose component orthogonal to the previous ones is below ``rtol`` of its own norm
  (a zero or linearly dependent column) becomes a zero column, never NaN.

The family's modules:

- ``api.py``: the public op, its ``torsh::orthogonalize`` custom op (``ortho_op``) and fake implementation,
  the validation and its CPU fast path;
- ``reference.py``: the torch reference ``orthogonalize_ref`` (modified Gram-Schmidt in fp64), the oracle of
  the tests, with ``default_rtol``;
- ``providers.py``: the implementations registered per provider, the kernels' geometry; the kernels, one
  module per provider, imported on its first launch: ``triton.py``, ``numba.py`` (CUDA), ``cpu.py`` (Numba's
  CPU target).
"""

from __future__ import annotations

from .api import MAX_ITERS, orthogonalize
from .reference import default_rtol, orthogonalize_ref

__all__ = ["MAX_ITERS", "default_rtol", "orthogonalize", "orthogonalize_ref"]
