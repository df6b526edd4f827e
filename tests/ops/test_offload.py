"""Offload packing: every provider, format and source dtype against the torch reference, bit for bit;
int8's error bound; preallocated, offset, too-small and misaligned buffers; accumulation; typed errors;
the staged copy to pinned host memory (CUDA only)."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

import torsh_kernels.ops.offload as O
from tests.helpers import DEVICE, poison, rand
from torsh_kernels.errors import ArgumentTypeError, DTypeError, InvalidArgumentError, NonFiniteError, ShapeError

SRC = [torch.float32, torch.float16, torch.bfloat16]
SRC_IDS = ["fp32", "fp16", "bf16"]
SHAPES = [(1,), (7,), (37, 29), (4097,), (3, 5, 7)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("fmt", O.FORMATS)
@pytest.mark.parametrize("dtype", SRC, ids=SRC_IDS)
def test_pack_unpack_match_reference(provider, gen, dtype, fmt, shape):
    x = rand(shape, dtype, gen) * 3
    nbytes = O.packed_nbytes(x.numel(), fmt)
    buf = torch.full((nbytes + 5,), 0xAB, dtype=torch.uint8, device=DEVICE)  # poisoned, and larger
    p = O.pack(x, fmt, out=buf, provider=provider)
    ref = O.pack_ref(x, fmt)
    assert p.data is buf and p.nbytes == nbytes and p.shape == tuple(shape) and p.dtype == dtype
    assert torch.equal(p.codes, ref.codes), "codes bit for bit (fp16/bf16: round to nearest even)"
    if fmt == "int8":
        assert torch.equal(p.scales, ref.scales)
    assert torch.equal(buf[nbytes:], torch.full((5,), 0xAB, dtype=torch.uint8, device=DEVICE)), "no write past"
    y = O.unpack(p, provider=provider)
    assert y.shape == x.shape and y.dtype == dtype
    assert torch.equal(y, O.unpack_ref(ref))
    if fmt == "int8":  # error per element at most scale / 2 (plus fp32 rounding)
        s = ref.scales.repeat_interleave(256)[: x.numel()].view(shape)
        bound = s / 2 * (1 + 1e-6) + torch.finfo(dtype).eps * x.float().abs()
        assert bool(((y.float() - x.float()).abs() <= bound).all())
    else:
        assert torch.equal(y, x.to(O._CODE_DTYPES[fmt]).to(dtype))


@pytest.mark.parametrize("fmt", O.FORMATS)
@pytest.mark.parametrize("out_dtype", SRC, ids=SRC_IDS)
def test_unpack_into_out_and_accumulate(provider, gen, fmt, out_dtype):
    x = rand((9, 31), torch.float32, gen)
    p = O.pack(x, fmt, provider=provider)
    out = poison((9, 31), out_dtype)
    O.unpack(p, out=out, provider=provider)
    want = O.unpack_ref(p, out_dtype)
    assert torch.equal(out, want)
    base = rand((9, 31), out_dtype, gen)
    acc = base.clone()
    O.unpack(p, out=acc, accumulate=True, provider=provider)
    expect = (base.float() + O.unpack_ref(p, torch.float32).float()).to(out_dtype)
    torch.testing.assert_close(acc, expect, atol=0, rtol=0)


def test_unpack_to_other_dtype_and_device_default(provider, gen):
    x = rand((5, 6), torch.float32, gen)
    p = O.pack(x, "bf16", provider=provider)
    y = O.unpack(p, dtype=torch.float16, provider=provider)
    assert y.dtype == torch.float16 and torch.equal(y, x.to(torch.bfloat16).to(torch.float16))


def test_compression_ratio_and_sizes():
    assert O.packed_nbytes(4096, "bf16") == 8192
    assert O.packed_nbytes(4096, "int8") == 4096 + 16 * 4
    assert O.packed_nbytes(7, "int8") == 16 + 4  # codes padded to 16 bytes, then one scale
    p = O.pack(torch.randn(4096), "int8")
    assert p.compression_ratio == pytest.approx(16384 / (4096 + 64))
    assert O.pack(torch.randn(4096), "bf16").compression_ratio == 2.0
    assert O.pack(torch.randn(10).bfloat16(), "fp16").compression_ratio == 1.0


def test_noncontiguous_source(provider, gen):
    x = rand((33, 17), torch.float32, gen).t()
    for fmt in O.FORMATS:
        p = O.pack(x, fmt, provider=provider)
        assert torch.equal(p.codes, O.pack_ref(x.contiguous(), fmt).codes)
        assert torch.equal(O.unpack(p, provider=provider), O.unpack_ref(O.pack_ref(x.contiguous(), fmt)))


def test_buffer_errors(gen):
    x = rand(1000, torch.float32, gen)
    need = O.packed_nbytes(1000, "int8")
    with pytest.raises(ShapeError, match=f"needs {need}") as e:
        O.pack(x, "int8", out=torch.empty(need - 1, dtype=torch.uint8))
    suggested = re.search(r"torch\.empty\(.*\)\)", str(e.value)).group(0)[:-1]
    buf = eval(suggested, {"torch": torch})  # the allocation the message suggests runs here (no CUDA: unpinned)
    assert O.pack(x, "int8", out=buf).data.data_ptr() == buf.data_ptr()
    with pytest.raises(ShapeError, match="uint8"):
        O.pack(x, "bf16", out=torch.empty(2000, dtype=torch.float16))
    with pytest.raises(ShapeError, match="aligned"):
        O.pack(x, "bf16", out=torch.empty(2002, dtype=torch.uint8)[1:])
    with pytest.raises(ShapeError, match="contiguous"):
        O.pack(x, "bf16", out=torch.empty(4000, dtype=torch.uint8)[::2])
    p = O.pack(x, "bf16")
    with pytest.raises(ShapeError, match="shape"):
        O.unpack(p, out=torch.empty(999))
    with pytest.raises(InvalidArgumentError, match="accumulate"):
        O.unpack(p, accumulate=True)


def test_argument_errors():
    x = torch.randn(10)
    with pytest.raises(InvalidArgumentError, match="fmt="):
        O.pack(x, "int4")
    with pytest.raises(InvalidArgumentError, match="block="):
        O.pack(x, "int8", block=100)
    with pytest.raises(DTypeError, match="int64"):
        O.pack(x.long(), "bf16")
    with pytest.raises(ArgumentTypeError):
        O.pack(x.tolist(), "bf16")
    with pytest.raises(ArgumentTypeError, match="Packed"):
        O.unpack(x)
    if not torch.cuda.is_available():
        with pytest.raises((InvalidArgumentError, ArgumentTypeError)):
            O.pack(x, "bf16", stream=object())


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the emulators casting 70000 to fp16
def test_finite_checks(provider):
    big = torch.tensor([1.0, 70000.0, -3.0], device=DEVICE)
    with pytest.raises(NonFiniteError, match="fp16"):
        O.pack(big, "fp16", provider=provider)
    p = O.pack(big, "fp16", check_finite=False, provider=provider)
    assert O.unpack(p).tolist() == [1.0, float("inf"), -3.0]
    assert O.unpack(O.pack(big, "bf16", provider=provider)).tolist()[1] == pytest.approx(70000, rel=1e-2)
    with pytest.raises(NonFiniteError, match="70000"):  # a NaN does not hide the overflow
        O.pack(torch.tensor([float("nan"), 70000.0, float("inf")], device=DEVICE), "fp16", provider=provider)
    nan = torch.tensor([1.0, float("nan"), 2.0], device=DEVICE)
    with pytest.raises(NonFiniteError):
        O.pack(nan, "int8", provider=provider)
    y = O.unpack(O.pack(nan, "bf16", provider=provider))  # fp16/bf16 carry NaN through
    assert y[0] == 1.0 and bool(y[1].isnan()) and y[2] == 2.0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: pinned host memory and a side stream")
@pytest.mark.parametrize("fmt", O.FORMATS)
def test_pack_to_pinned_host_on_a_stream(fmt):
    x = torch.randn(1 << 20, device="cuda")
    buf = torch.empty(O.packed_nbytes(x.numel(), fmt), dtype=torch.uint8, pin_memory=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    p = O.pack(x, fmt, out=buf, stream=side)
    side.synchronize()
    ref = O.pack_ref(x, fmt)
    assert torch.equal(p.codes, ref.codes.cpu())
    y = O.unpack(p, device="cuda", stream=side)
    side.synchronize()
    assert y.device.type == "cuda" and torch.equal(y, O.unpack_ref(ref))


@pytest.mark.parametrize("fmt", O.FORMATS)
def test_pack_refuses_a_buffer_overlapping_its_input(provider, fmt):
    """pack into a buffer over x's own memory: a bare RuntimeError from torch, silently garbage from the
    kernels; now a ShapeError before anything is written."""
    x = rand((64,), torch.float32, torch.Generator().manual_seed(1))
    before = x.clone()
    with pytest.raises(ShapeError, match="out overlaps x"):
        O.pack(x, fmt, out=x.view(torch.uint8), provider=provider)
    assert torch.equal(x, before)


def test_unpack_checks_the_packed_object():
    p = O.pack_ref(torch.randn(37), "int8", block=8)
    bad = {
        "holds 10 bytes": dict(data=torch.zeros(10, dtype=torch.uint8)),
        "need 1500000": dict(shape=(10**6,)),
        "non-negative": dict(shape=(-37,)),
        "fmt=": dict(fmt="int3"),
        "block=": dict(block=7),
        "packed.dtype": dict(dtype=torch.int32),
    }
    for match, change in bad.items():
        with pytest.raises((ShapeError, InvalidArgumentError, DTypeError), match=match):
            O.unpack(dataclasses.replace(p, **change))
    with pytest.raises(InvalidArgumentError, match="not a device"):
        O.unpack(p, device="gpu7")
    store = torch.zeros(80, dtype=torch.uint8)
    q = O.pack(torch.randn(20), "bf16", out=store)
    with pytest.raises(ShapeError, match=r"out overlaps packed\.data"):
        O.unpack(q, out=store[20:60].view(torch.bfloat16), accumulate=True)
    torch.testing.assert_close(O.unpack(p), O.unpack_ref(p))
