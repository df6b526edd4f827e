"""all_reduce_sparse on real gloo processes: the average of sparse COO tensors whose entries differ per rank
(one rank with none), against the dense average; and against gloo's own sparse all-reduce."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from torsh_kernels.collectives import all_reduce_sparse, run_local
from torsh_kernels.errors import ArgumentTypeError, InvalidArgumentError


def _rank_tensor(rank: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows of a [41, 3, 2] tensor, a different (repeating, unsorted) set per rank; rank 2 holds none."""
    g = torch.Generator().manual_seed(100 + rank)
    nnz = {0: 9, 1: 23}.get(rank, 0)
    rows = torch.randint(0, 41, (1, nnz), generator=g)
    vals = torch.randn(nnz, 3, 2, generator=g).to(dtype)
    return torch.sparse_coo_tensor(rows, vals, (41, 3, 2))  # uncoalesced: repeated rows are summed


def _worker(comm, dtype):
    t = _rank_tensor(comm.rank, dtype)
    keep = t.clone()
    out, sent = all_reduce_sparse(comm, t)
    total, _ = all_reduce_sparse(comm, t, average=False)
    want = sum(_rank_tensor(r, dtype).to_dense().double() for r in range(comm.world_size))
    theirs = None
    if dtype == torch.float32:  # gloo's own sparse sum (it has no fp16 one)
        theirs = t.clone().coalesce()
        dist.all_reduce(theirs)
    return {
        "avg_err": (out.to_dense().double() - want / comm.world_size).abs().max().item(),
        "sum_err": (total.to_dense().double() - want).abs().max().item(),
        "vs_gloo": None if theirs is None else (total.to_dense() - theirs.to_dense()).double().abs().max().item(),
        "layout": (out.layout, out.is_coalesced(), out.dtype, tuple(out.shape)),
        "input_kept": torch.equal(t.to_dense(), keep.to_dense()),
        "sent": sent,
        "bits": out.to_dense(),
    }


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-6), (torch.float16, 2e-3)], ids=["fp32", "fp16"])
def test_sparse_average_equals_the_dense_one_on_every_rank(dtype, tol):
    out = run_local(_worker, 3, dtype, op_timeout=60)
    for r, o in enumerate(out):
        assert o["avg_err"] <= tol and o["sum_err"] <= 3 * tol, (r, o)
        assert dtype != torch.float32 or o["vs_gloo"] <= 3 * tol, (r, o)
        assert o["layout"] == (torch.sparse_coo, True, dtype, (41, 3, 2))
        assert o["input_kept"]
        assert torch.equal(o["bits"], out[0]["bits"])  # the same bits on every rank
    assert out[2]["sent"] > 0  # the rank without entries still sends its (padded) share


def _world_one(comm):
    t = _rank_tensor(0, torch.float32).coalesce()
    out, sent = all_reduce_sparse(comm, t)
    same = torch.equal(out.to_dense(), t.to_dense())
    out.values().mul_(2)  # a new tensor: the input does not change with it
    return same, sent, torch.equal(out.to_dense(), 2 * t.to_dense())


def test_world_size_one_and_bad_input():
    assert run_local(_world_one, 1, op_timeout=60) == [(True, 0, True)]
    comm = type("C", (), {"world_size": 2})()
    with pytest.raises(InvalidArgumentError, match="sparse COO"):
        all_reduce_sparse(comm, torch.zeros(3))
    with pytest.raises(ArgumentTypeError, match=r"torch\.Tensor"):
        all_reduce_sparse(comm, [1, 2])


@pytest.mark.parametrize("index", [41, -1, 10**6])
def test_indices_outside_the_size_are_refused_before_anything_is_sent(index):
    """A COO tensor made without torch's invariant check may hold indices outside its size; summing or sending
    it wrote out of bounds (torch aborted later: "double free or corruption", or a segfault). It is refused,
    typed and naming the index, before any collective (the communicator here records none)."""
    calls = []
    comm = type("C", (), {"world_size": 2, "all_gather": lambda self, *a: calls.append(a)})()
    rows = torch.tensor([[3, index, 7]])
    t = torch.sparse_coo_tensor(rows, torch.ones(3, 2), (41, 2), check_invariants=False)
    with pytest.raises(InvalidArgumentError, match=rf"sparse index {index} in dimension 0 \(entry 1\) is outside"):
        all_reduce_sparse(comm, t)
    assert calls == []
    ok = torch.sparse_coo_tensor(torch.tensor([[0, 40]]), torch.ones(2, 2), (41, 2))
    one = type("C", (), {"world_size": 1})()
    out, sent = all_reduce_sparse(one, ok)
    assert sent == 0 and torch.equal(out.to_dense(), ok.to_dense())
