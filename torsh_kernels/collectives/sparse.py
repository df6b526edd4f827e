"""The average of a sparse COO tensor over the ranks of any :class:`~torsh_kernels.collectives.Communicator`.

Sparse gradients (``nn.Embedding(sparse=True)``, ``nn.EmbeddingBag(sparse=True)``) hold a different
set of rows on every rank, so they cannot be summed element by element in place. What gloo does for
``dist.all_reduce`` on a sparse tensor is done here over any transport: the ranks' entry counts are
all-gathered, then every rank's indices and values (padded to the largest count), and each rank adds
them up (``coalesce``): every rank sums the same entries in the same order.
Each rank's values are divided by the world size before the sum, as DDP's default hook divides a
bucket before its all-reduce.

Three collectives, each waited for: the result's shape depends on what the other ranks hold, so it
cannot be produced before they answer.
"""

from __future__ import annotations

import torch

from ..errors import ArgumentTypeError, InvalidArgumentError
from .protocol import Communicator

__all__ = ["all_reduce_sparse", "sparse_nbytes"]


def sparse_nbytes(t: torch.Tensor) -> int:
    """Bytes a sparse COO tensor holds: its indices and values (what its statistics count, not its dense size)."""
    return t._indices().nbytes + t._values().nbytes


def _check_indices(t: torch.Tensor, what: str) -> None:
    """Every index of a COO tensor inside its size, checked before anything is sent or summed: a tensor made with
    ``check_invariants=False`` may hold others, and torch then writes out of bounds (a crash or a corrupted heap
    later, far from the cause)."""
    idx = t._indices()
    if idx.numel() == 0:
        return
    size = torch.tensor(t.shape[: idx.shape[0]], dtype=idx.dtype, device=idx.device).view(-1, 1)
    bad = (idx < 0) | (idx >= size)
    if bool(bad.any()):
        dim, entry = (int(v) for v in bad.nonzero()[0])
        raise InvalidArgumentError(
            f"{what}: sparse index {int(idx[dim, entry])} in dimension {dim} (entry {entry}) is outside the size "
            f"{tuple(t.shape)}; make the tensor with torch.sparse_coo_tensor(..., check_invariants=True) to find where"
        )


def all_reduce_sparse(comm: Communicator, tensor: torch.Tensor, *, average: bool = True) -> tuple[torch.Tensor, int]:
    """The sum (``average=False``) or the average of a sparse COO ``tensor`` over ``comm``'s ranks, as a
    new coalesced sparse tensor of the same size, dtype and device (the input is not changed). Returns it
    and the bytes this rank put on the wire (its padded indices and values)."""
    what = "all_reduce_sparse"
    if not isinstance(tensor, torch.Tensor):
        raise ArgumentTypeError(f"{what}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.sparse_coo:
        raise InvalidArgumentError(
            f"{what}: expected a sparse COO tensor, got layout {tensor.layout}; dense tensors go through all_reduce"
        )
    _check_indices(tensor, what)
    ws = comm.world_size
    t = tensor.detach().coalesce()
    idx, val = t.indices(), t.values()  # [sparse_dim, nnz], [nnz, *dense dims]
    if average and ws > 1:
        val = val / ws
    if ws == 1:
        return torch.sparse_coo_tensor(idx.clone(), val.clone(), t.shape, is_coalesced=True), 0
    dev = val.device
    nnz = torch.tensor([idx.shape[1]], dtype=torch.int64, device=dev)
    counts = torch.empty(ws, dtype=torch.int64, device=dev)
    comm.all_gather(counts, nnz)
    counts = counts.tolist()
    top = max(counts)
    if top == 0:
        return torch.sparse_coo_tensor(idx.clone(), val.clone(), t.shape, is_coalesced=True), nnz.nbytes
    pad = top - idx.shape[1]
    # rows of indices ([top, sparse_dim]) and of values ([top, *dense dims]), this rank's first, padding after
    my_idx = torch.nn.functional.pad(idx.t(), (0, 0, 0, pad)).contiguous()
    my_val = torch.cat([val, val.new_zeros((pad, *val.shape[1:]))]) if pad else val.contiguous()
    all_idx = my_idx.new_empty((ws * top, idx.shape[0]))
    all_val = my_val.new_empty((ws * top, *val.shape[1:]))
    comm.all_gather(all_idx, my_idx)
    comm.all_gather(all_val, my_val)
    keep = torch.cat([torch.arange(r * top, r * top + c, device=dev) for r, c in enumerate(counts)])
    out = torch.sparse_coo_tensor(all_idx[keep].t(), all_val[keep], t.shape).coalesce()
    return out, nnz.nbytes + my_idx.nbytes + my_val.nbytes
