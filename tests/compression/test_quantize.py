"""Quantize's choice between its two schemes on the wire (the all-reduce itself is tested in test_allreduce)."""

from __future__ import annotations

import torch

from torsh_kernels.collectives import Link
from torsh_kernels.compression import Quantize, quantize_codes_dtype, quantize_shared_scale_cheaper

LINK = Link(latency=10e-6, bandwidth=1e9)


def test_quantize_scheme_depends_on_world_size():
    n = 10_000_000
    # int4: codes sum in int8 up to 18 ranks; the all-gather grows with p, the all-reduce does not
    assert not quantize_shared_scale_cheaper(n, Quantize(4), 2, LINK)
    assert quantize_shared_scale_cheaper(n, Quantize(4), 16, LINK)
    # int8: the sum needs int32 (4 bytes per code), so gathering wins until p is large
    assert not quantize_shared_scale_cheaper(n, Quantize(8), 4, LINK)
    assert quantize_shared_scale_cheaper(n, Quantize(8), 32, LINK)


def test_codes_are_summed_in_the_narrowest_integer_that_holds_the_sum():
    assert quantize_codes_dtype(4, 18) == torch.int8  # 7 * 18 = 126
    assert quantize_codes_dtype(4, 19) == torch.int32
    assert quantize_codes_dtype(8, 1) == torch.int8
    assert quantize_codes_dtype(8, 2) == torch.int32
    schemes = Quantize(4, block=32).schemes(1000, torch.float32, 4)
    (scales, codes) = schemes["shared_scale_all_reduce"]
    assert (scales.nbytes, codes.nbytes) == (4 * 32, 1000)
    assert schemes["all_gather"][0].nbytes == Quantize(4, block=32).payload_nbytes(1000)
