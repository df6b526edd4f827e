"""The row ops of the compressed expert-parallel all-to-all (quantize_rows, dequantize_rows): every provider
against the torch reference (packed bytes bit for bit, decoded values exactly), fresh random data over many
magnitudes (fp8 subnormal codes included), odd widths and partial tiles, gathers with repeated rows and -1 zero
rows, a NaN/Inf tile (scale NaN: decodes to NaN), outputs poisoned before the call; the format's error bound;
bad inputs typed."""

from __future__ import annotations

import pytest
import torch

from tests import helpers
from torsh_kernels.errors import DTypeError, InvalidArgumentError, ShapeError, TorshKernelsError
from torsh_kernels.ops import RowQuantSpec, dequantize_rows, quantize_rows, row_wire_bytes
from torsh_kernels.ops.rowquant import dequantize_rows_ref, quantize_rows_ref

FMTS = ("e4m3", "e5m2", "int8")
SHAPES = [(1, 2), (7, 4), (130, 128), (67, 16)]  # (H, block): one element, odd H, a partial last tile, 5 tiles


def _rows(T, H, dtype, gen):
    mag = torch.logspace(-12, 4, T)[:, None]  # rows from tiny (fp8 subnormal codes) to large
    x = torch.randn(T, H, generator=gen) * mag
    return x.to(dtype).to(helpers.DEVICE)


def _same(a, b):
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a[~a.isnan()], b[~b.isnan()])


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("H,block", SHAPES, ids=[f"H{h}b{b}" for h, b in SHAPES])
def test_quantize_rows_matches_the_reference_bit_for_bit(provider, gen, fmt, dtype, H, block):
    T = 4
    x = _rows(T, H, dtype, gen)
    x[2, H // 2] = float("nan")
    x[3, H - 1] = float("inf")
    index = torch.tensor([2, -1, 0, 0, 3, 1], device=x.device)
    for idx in (None, index):
        want = quantize_rows_ref(x, fmt, block, idx)
        out = torch.full_like(want, 0xA5)  # poisoned, padding bytes included
        got = quantize_rows(x, fmt=fmt, block=block, index=idx, out=out, provider=provider)
        assert got is out
        assert torch.equal(got, want), (got != want).nonzero()[:5].tolist()


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("H,block", SHAPES, ids=[f"H{h}b{b}" for h, b in SHAPES])
def test_dequantize_rows_matches_the_reference(provider, gen, fmt, dtype, H, block):
    x = _rows(4, H, torch.float32, gen)
    x[1, 0] = float("nan")
    packed = quantize_rows_ref(x, fmt, block)
    for idx in (None, torch.tensor([3, 0, -1, 2, 2], device=x.device)):
        want = dequantize_rows_ref(packed, fmt, block, H, dtype, idx)
        out = torch.full(want.shape, float("nan"), dtype=dtype, device=x.device)
        got = dequantize_rows(packed, fmt=fmt, block=block, hidden=H, dtype=dtype, index=idx, out=out,
                              provider=provider)  # fmt: skip
        assert got is out and _same(got.float(), want.float())
    bad_tile = dequantize_rows_ref(packed, fmt, block, H, torch.float32)[1, : min(block, H)]
    assert bool(bad_tile.isnan().all())  # a NaN in a tile: the tile decodes to NaN, like the row it came from


@pytest.mark.parametrize("fmt,rel", [("e4m3", 2.0**-4), ("e5m2", 2.0**-3), ("int8", 0.5 / 127)])
def test_the_round_trip_is_within_the_formats_bound(gen, fmt, rel):
    """|decoded - x| <= rel * |x| for fp8 values in the normal range (half an ulp: 2**-4 for 3 mantissa bits),
    plus half the smallest subnormal step times the scale; int8: half a code step of the tile's scale."""
    H, block = 300, 128
    x = torch.randn(64, H, generator=gen) * torch.logspace(-3, 3, 64)[:, None]
    packed = quantize_rows(x, fmt=fmt, block=block)
    y = dequantize_rows(packed, fmt=fmt, block=block, hidden=H, dtype=torch.float32)
    tiles = torch.nn.functional.pad(x, (0, 384 - H)).view(64, 3, block).abs().amax(2)
    s = tiles.repeat_interleave(block, 1)[:, :H]
    if fmt == "int8":
        bound = 0.5 * s / 127 * (1 + 1e-6)
    else:
        m, bias, fmax = (3, 7, 448.0) if fmt == "e4m3" else (2, 15, 57344.0)
        sub = 2.0 ** (1 - bias - m)  # the smallest subnormal step
        bound = rel * x.abs() + 0.5 * sub * s / fmax + 1e-7 * s
    err = (y - x).abs()
    assert bool((err <= bound).all()), float((err / bound).max())
    assert row_wire_bytes(H, fmt=fmt, block=block) == 300 + 4 * 3


def test_the_spec_and_bad_inputs_are_typed():
    assert RowQuantSpec().fmt == "e4m3" and RowQuantSpec().block == 128
    for bad in ({"fmt": "fp4"}, {"block": 3}, {"block": 0}, {"block": True}, {"block": 1 << 17}):
        with pytest.raises(TorshKernelsError):
            RowQuantSpec(**bad)
    x = torch.randn(4, 8)
    with pytest.raises(TorshKernelsError):
        quantize_rows(x, nonsense=1)
    with pytest.raises(InvalidArgumentError, match="outside"):
        quantize_rows(x, index=torch.tensor([0, 4]))
    with pytest.raises(InvalidArgumentError, match="outside"):
        quantize_rows(x, index=torch.tensor([-2]))
    with pytest.raises(DTypeError):
        quantize_rows(x, index=torch.tensor([0.0]))
    with pytest.raises(ShapeError):
        quantize_rows(x.view(-1))
    with pytest.raises(ShapeError):
        quantize_rows(x.to(torch.int32))
    with pytest.raises(ShapeError):
        quantize_rows(x, out=torch.empty(4, 7, dtype=torch.uint8))
    packed = quantize_rows(x, block=4)
    with pytest.raises(ShapeError, match="uint8"):
        dequantize_rows(packed, hidden=8)  # block 128 rows are another width
    with pytest.raises(DTypeError):
        dequantize_rows(packed, block=4, hidden=8, dtype=torch.int8)
    with pytest.raises(InvalidArgumentError):
        dequantize_rows(packed, block=4, hidden=8, index=torch.tensor([4]))
    assert quantize_rows(torch.empty(0, 8), index=None).shape == (0, row_wire_bytes(8))
    z = quantize_rows(x, index=torch.full((3,), -1))  # padding rows only: zero codes, zero scales
    assert not bool(z.any())
    assert not bool(dequantize_rows(z, hidden=8).any())
