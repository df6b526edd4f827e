"""The FP8 formats' scalar arithmetic (``ops/quantize/fp8.py``), which every provider's kernel transcribes,
against torch's own float8 casts: every code decodes to torch's value; values of every fp32 exponent within the
format's range, the midpoints between neighbouring codes (ties to even) and the signed zeros encode to torch's
code, bit for bit."""

from __future__ import annotations

import pytest
import torch

from torsh_kernels.ops.quantize.fp8 import FP8, fp8_bits_py, fp8_codes, fp8_value_py


@pytest.mark.parametrize("name", sorted(FP8))
def test_every_code_decodes_as_torch(name):
    f = FP8[name]
    ref = torch.arange(256, dtype=torch.uint8).view(f.dtype).float()
    mine = torch.tensor([fp8_value_py(c, f.e4m3) for c in range(256)])
    assert torch.equal(ref.isnan(), mine.isnan())
    assert torch.equal(ref[~ref.isnan()], mine[~mine.isnan()])


@pytest.mark.parametrize("name", sorted(FP8))
def test_encoding_is_torch_cast_of_the_saturated_value(name):
    f = FP8[name]
    g = torch.Generator().manual_seed(1234)
    bits = torch.randint(0, 2**31, (20000,), generator=g, dtype=torch.int64).to(torch.int32)
    vals = bits.view(torch.float32)
    vals = vals[torch.isfinite(vals)] * (2 * torch.randint(0, 2, (1,), generator=g) - 1)
    grid = torch.arange(256, dtype=torch.uint8).view(f.dtype).float()
    grid = grid[torch.isfinite(grid)].double().unique()
    mids = ((grid[1:] + grid[:-1]) / 2).float()  # exact ties: round half to even
    vals = torch.cat([vals, mids, torch.tensor([0.0, -0.0, f.max, -f.max, 1e30, -1e30])])
    want = fp8_codes(vals, f).view(torch.uint8)
    sat = vals.clamp(-f.max, f.max)
    got = torch.tensor([fp8_bits_py(v, f.e4m3) for v in sat.tolist()], dtype=torch.uint8)
    assert torch.equal(got, want), (vals[got != want][:5], got[got != want][:5], want[got != want][:5])


def test_codes_saturate_and_zero_nan():
    f = FP8["e4m3"]
    c = fp8_codes(torch.tensor([1e6, -1e6, float("inf"), float("nan")]), f).float()
    assert c.tolist() == [448.0, -448.0, 448.0, 0.0]
    f = FP8["e5m2"]
    c = fp8_codes(torch.tensor([1e6, float("-inf")]), f).float()
    assert c.tolist() == [57344.0, -57344.0]
