"""ReplicaCommunicator: collectives answered as a group whose ranks all hold this rank's data, and the
rounds it records (what ``compressor="auto"`` and ``measure_compute`` price)."""

from __future__ import annotations

import pytest
import torch

from torsh_kernels.collectives import Round
from torsh_kernels.collectives.replica import ReplicaCommunicator
from torsh_kernels.compression import FP16, Quantize, Sign, TopK, compressed_all_reduce
from torsh_kernels.errors import ArgumentTypeError, InvalidArgumentError


def test_collectives_answer_as_equal_ranks():
    c = ReplicaCommunicator(3)
    x = torch.tensor([1.0, -2.0, 4.0])
    c.all_reduce(x)
    assert torch.equal(x, torch.tensor([3.0, -6.0, 12.0]))  # three equal contributions
    y = torch.tensor([1.0, 5.0])
    c.all_reduce(y, "max")
    assert torch.equal(y, torch.tensor([1.0, 5.0]))
    out = torch.full((6,), float("nan"))
    assert c.all_gather(out, torch.tensor([7.0, 8.0]), async_op=True).is_completed()
    assert torch.equal(out, torch.tensor([7.0, 8.0] * 3))
    send = torch.arange(6.0)  # blocks of 2 for ranks 0, 1, 2: this (rank 0) gets block 0 from everyone
    recv = torch.full((6,), float("nan"))
    c.all_to_all(recv, send)
    assert torch.equal(recv, torch.tensor([0.0, 1.0] * 3))
    assert [r.collective for r in c.rounds] == ["all_reduce", "all_reduce", "all_gather", "all_to_all"]
    assert [r.nbytes for r in c.rounds] == [12, 8, 8, 24]


@pytest.mark.parametrize("compressor", [None, FP16(), TopK(0.05), Quantize(8), Sign()], ids=str)
def test_a_reduction_over_replicas_equals_one_rank_and_records_its_wire(compressor):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(37, 29, generator=gen)
    results = {}
    for ws in (1, 3):
        c = ReplicaCommunicator(ws)
        state = compressor.new_state() if compressor is not None else None
        y = x.clone()
        compressed_all_reduce(y, c, compressor, state)
        results[ws] = (y, c.rounds)
    # equal contributions average to one rank's decoded value (fp16 prescales by 1/3 before the cast:
    # one fp16 rounding apart)
    # Sign shards the server phase (rank d serves chunk d): replicas all serve chunk 0, so its values are
    # not comparable, only its work and its wire
    if not isinstance(compressor, Sign):
        tol = 1e-3 if isinstance(compressor, FP16) else 1e-5
        torch.testing.assert_close(results[3][0], results[1][0], atol=tol, rtol=tol)
    rounds = results[3][1]
    assert rounds and all(isinstance(r, Round) and r.nbytes > 0 for r in rounds)
    if compressor is not None:
        # what was recorded is one of the ways the compressor says its payload travels (give or take the
        # packing's alignment bytes)
        sent = sum(r.nbytes for r in rounds)
        schemes = compressor.schemes((37, 29), torch.float32, 3).values()
        assert min(abs(sent - sum(r.nbytes for r in sch)) for sch in schemes) <= 8 * len(rounds)


def test_bad_arguments():
    with pytest.raises(InvalidArgumentError):
        ReplicaCommunicator(0)
    with pytest.raises(InvalidArgumentError):
        ReplicaCommunicator(2, rank=2)
    c = ReplicaCommunicator(2)
    with pytest.raises(ArgumentTypeError):
        c.all_reduce([1.0])
    with pytest.raises(InvalidArgumentError):
        c.all_reduce(torch.ones(2), "mean")
    with pytest.raises(InvalidArgumentError):
        c.send(torch.ones(1), 1)
