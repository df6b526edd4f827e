"""Provider implementations of the orthogonalisation op, registered per provider (torch, triton, numba,
cpu). Inputs are validated, contiguous [m, r] matrices (and, for torch, [B, m, r] batches) of one r, dtype
and device (the public op in ``api.py`` sees to it); the kernels are imported on a provider's first launch
(``triton.py``, ``numba.py``, ``cpu.py``).
"""

from __future__ import annotations

import torch

from ..common import ptr_table
from ..registry import Op

__all__ = ["MAX_KERNEL_RANK", "ORTHO_ELEMS", "ORTHO_WARPS", "element_groups", "ortho_impl"]

ortho_impl = Op("orthogonalize")
"""``ortho_impl(provider, mats, rtol, iters)``: the columns of each matrix orthonormalised in place."""

MAX_KERNEL_RANK = 32  # orthogonalize kernels keep an r x r Gram matrix in registers / local memory
ORTHO_ELEMS = 4096  # elements of the [ROWS, RP, RP] product tile in the orthogonalize kernel
# 16 of them a thread (fp64 products): at 4 warps (32 a thread) fp32 rank 8 and 32 and bf16 rank 32 spilled 16 bytes
ORTHO_WARPS = 8


def element_groups(mats: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """The matrices as the Numba kernels take them, one span of memory per group: all of them when they lie
    a whole number of elements apart, else one group each."""
    isz = mats[0].element_size()
    if len({m.data_ptr() % isz for m in mats}) == 1:
        return [mats]
    return [[m] for m in mats]


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


def _as_batch(ms: list[torch.Tensor]) -> torch.Tensor | None:
    """One [B, m, r] view over matrices that lie back to back in memory, else None."""
    m0 = ms[0]
    step = m0.numel() * m0.element_size()
    if all(m.data_ptr() == m0.data_ptr() + i * step for i, m in enumerate(ms)):
        return m0.as_strided((len(ms), *m0.shape), (m0.numel(), m0.shape[1], 1))
    return None


@ortho_impl.register("torch")
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


@ortho_impl.register("triton")
def _ortho_triton(mats, rtol, iters):
    import triton

    from . import triton as K

    r = mats[0].shape[1]
    rp = max(2, triton.next_power_of_2(r))
    rows = max(1, min(256, triton.next_power_of_2(max(1, ORTHO_ELEMS // (rp * rp)))))
    table = ptr_table([v for m in mats for v in (m.data_ptr(), m.shape[0])], mats[0].device, "ortho")
    K._orthogonalize_kernel[(len(mats),)](table, mats[0], r, rtol * rtol, ROWS=rows, RP=rp, ITERS=iters,
                                          num_warps=ORTHO_WARPS)  # fmt: skip


@ortho_impl.register("numba")
def _ortho_numba(mats, rtol, iters):
    from . import numba as K

    K.orthogonalize(mats, rtol, iters)


@ortho_impl.register("cpu")
def _ortho_cpu(mats, rtol, iters):
    from . import cpu as K

    K.orthogonalize(mats, rtol, iters)
