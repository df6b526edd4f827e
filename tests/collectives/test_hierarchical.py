"""hierarchical_all_reduce against a flat all-reduce on real processes (gloo)."""

from __future__ import annotations

import pytest
import torch

from torsh_kernels.collectives import TorchCommunicator, hierarchical_all_reduce, node_groups, run_local
from torsh_kernels.errors import InvalidArgumentError


def _worker(comm: TorchCommunicator, local_size: int) -> int:
    me = comm.rank
    checks = 0
    intra, inter = node_groups(comm, local_size)
    assert intra.global_ranks == [me // local_size * local_size + i for i in range(local_size)]
    assert inter.global_ranks == list(range(me % local_size, comm.world_size, local_size))
    for shape in [(1,), (3,), (1001,), (17, 5)]:
        g = torch.Generator().manual_seed(me * 31 + shape[0])
        # integer-valued floats and int64: every summation order gives the same bits
        for x in (torch.randint(-1000, 1000, shape, generator=g).float(),
                  torch.randint(-2**40, 2**40, shape, generator=g)):  # fmt: skip
            flat, hier = x.clone(), x.clone()
            comm.all_reduce(flat)
            assert hierarchical_all_reduce(hier, comm, local_size) is hier
            assert torch.equal(flat, hier), (shape, x.dtype)
            checks += 1
        # random floats: equal up to the summation order
        x = torch.randn(shape, generator=g)
        for op in ("sum", "avg"):
            flat, hier = x.clone(), x.clone()
            comm.all_reduce(flat, op)
            hierarchical_all_reduce(hier, comm, local_size, op=op)
            torch.testing.assert_close(hier, flat, rtol=1e-6, atol=1e-6)
            checks += 1
    return checks


@pytest.mark.parametrize(("world_size", "local_size"), [(4, 2), (4, 4), (4, 1), (3, 3), (2, 1)])
def test_hierarchical_equals_flat(world_size, local_size):
    assert run_local(_worker, world_size, local_size, op_timeout=30) == [16] * world_size


def _bad_worker(comm: TorchCommunicator) -> str:
    for bad in (3, 0, True):
        with pytest.raises(InvalidArgumentError):
            hierarchical_all_reduce(torch.ones(4), comm, bad)
    with pytest.raises(InvalidArgumentError):
        hierarchical_all_reduce(torch.ones(4, dtype=torch.int64), comm, 2, op="avg")
    with pytest.raises(InvalidArgumentError):
        hierarchical_all_reduce(torch.ones(4), comm, 2, op="max")
    return "ok"


def test_hierarchical_argument_errors():
    assert run_local(_bad_worker, 4, op_timeout=60) == ["ok"] * 4  # generous: 4 ranks on a loaded 2-core VM
