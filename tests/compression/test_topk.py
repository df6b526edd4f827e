"""TopK and the gathered decode: decompress_sum of several ranks' payloads."""

from __future__ import annotations

import torch

from tests.helpers import DEVICE, rand
from torsh_kernels.compression import Quantize, TopK


def test_decompress_sum_equals_sum_of_decompressions(gen):
    c = TopK(0.1)
    payloads = []
    states = [c.new_state() for _ in range(3)]
    for s in states:
        payloads.append(c.compress(rand(500, torch.float32, gen), s))
    out = torch.full((500,), float("nan"), device=DEVICE)
    c.decompress_sum(payloads, states[0], out, alpha=1 / 3)
    ref = sum(c.decompress(p, states[0], torch.empty(500, device=DEVICE)) for p in payloads) / 3
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)
    q = Quantize(8, 64)
    qp = [q.compress(rand(500, torch.float32, gen), q.new_state()) for _ in range(2)]
    out2 = q.decompress_sum(qp, None, torch.empty(500, device=DEVICE), alpha=0.5)
    ref2 = (
        q.decompress(qp[0], None, torch.empty(500, device=DEVICE))
        + q.decompress(qp[1], None, torch.empty(500, device=DEVICE))
    ) * 0.5
    torch.testing.assert_close(out2, ref2, atol=1e-6, rtol=1e-6)


def test_payload_and_scheme_bytes():
    assert TopK(0.01).payload_nbytes(2_000_000) == 20_000 * 8
    assert TopK(0.01).payload_nbytes(2_000_000, torch.bfloat16) == 20_000 * 6
    (r,) = TopK(0.01).schemes(2_000_000, torch.float32, 4)["all_gather"]
    assert (r.collective, r.nbytes) == ("all_gather", 20_000 * 8)
    assert TopK(0.01).label() == TopK(0.01).name == "topk:0.01" and TopK(0.01).kind == "TopK"
