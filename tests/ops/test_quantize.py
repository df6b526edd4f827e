"""Quantization ops: every provider bit for bit against the torch reference, the documented error
bound, lossless int4 packing, unbiased and reproducible stochastic rounding, and the typed errors.

The package re-exports the function ``quantize``, which is therefore what ``torsh_kernels.ops.quantize`` is as
an attribute: the package's names are imported from it directly."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers import DEVICE, DTYPE_TOLS, close, poison, rand
from torsh_kernels.errors import DTypeError, InvalidArgumentError, NonFiniteError, ProviderError, ShapeError
from torsh_kernels.ops.quantize import (
    CPU_SLICE,
    dequantize,
    dequantize_ref,
    quantize,
    quantize_ref,
)
from torsh_kernels.ops.quantize.api import dequantize_op, quantize_op

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
HYP = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.mark.parametrize("n", [1, 3, 255, 1000, pytest.param(4097, marks=pytest.mark.slow)])  # (the simulator)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
def test_quantize_matches_reference_bit_for_bit(provider, gen, n, dtype, bits, stochastic):
    x = rand(n, dtype, gen) * 3
    block = 64 if n % 2 else 256
    q, s = quantize(x, bits=bits, block=block, stochastic=stochastic, seed=1234, provider=provider)
    q_ref, s_ref = quantize_ref(x, bits=bits, block=block, stochastic=stochastic, seed=1234)
    assert q.dtype == q_ref.dtype and q.shape == q_ref.shape and s.shape == s_ref.shape
    assert torch.equal(q, q_ref)
    assert torch.equal(s, s_ref)


@pytest.mark.parametrize("dtype,atol,rtol", DTYPE_TOLS)
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("accumulate", [False, True])
def test_dequantize_matches_reference(provider, gen, dtype, atol, rtol, bits, accumulate):
    n = 4095
    q, s = quantize_ref(rand(n, torch.float32, gen), bits=bits, block=128)
    base = rand(n, dtype, gen)
    out = base.clone() if accumulate else poison((n,), dtype)
    got = dequantize(q, s, block=128, numel=n, out=out, accumulate=accumulate, alpha=-0.75, provider=provider)
    ref = dequantize_ref(q, s, numel=n, block=128, dtype=dtype, out=base.clone() if accumulate else None,
                           accumulate=accumulate, alpha=-0.75)  # fmt: skip
    close(got, ref, atol, rtol)


# The Triton kernels run a bulk of whole programs (4096 elements; 1024 for fp32 -> int4) unmasked and the rest in
# a masked tail of 256-element programs: sizes below, at and across a program, whose last block straddles the
# end, every element checked in outputs poisoned beforehand.
@pytest.mark.parametrize("n", [17, 257, 1025, 4096 + 300])
@pytest.mark.parametrize("bits", [8, 4])
def test_quantize_bulk_and_tail_bit_for_bit(provider, gen, n, bits):
    x = rand(n, torch.float32, gen) * 3
    q = torch.full((n if bits == 8 else -(-n // 2),), 0x5A, dtype=torch.int8 if bits == 8 else torch.uint8,
                   device=DEVICE)  # fmt: skip
    s = poison((-(-n // 256),), torch.float32)
    quantize(x, bits=bits, block=256, stochastic=True, seed=77, out=(q, s), provider=provider)
    q_ref, s_ref = quantize_ref(x, bits=bits, block=256, stochastic=True, seed=77)
    assert torch.equal(q, q_ref) and torch.equal(s, s_ref)
    for accumulate in (False, True):
        base = rand(n, torch.bfloat16, gen)
        out = base.clone() if accumulate else poison((n,), torch.bfloat16)
        dequantize(q, s, block=256, numel=n, out=out, accumulate=accumulate, alpha=0.5, provider=provider)
        ref = dequantize_ref(q_ref, s_ref, numel=n, block=256, dtype=torch.bfloat16,
                             out=base.clone() if accumulate else None, accumulate=accumulate, alpha=0.5)  # fmt: skip
        assert torch.equal(out, ref)


def test_int4_codes_at_an_odd_address(provider, gen):
    """The Triton int4 bulk stores packed codes as 16-bit words: a code buffer one byte off takes the byte path
    (on a GPU a 16-bit store there would fault); the codes are the same."""
    n = 4096 + 300
    x = rand(n, torch.float32, gen)
    buf = torch.full((-(-n // 2) + 1,), 0x5A, dtype=torch.uint8, device=DEVICE)
    q, s = buf[1:], poison((-(-n // 256),), torch.float32)
    assert q.data_ptr() % 2 == 1
    quantize(x, bits=4, block=256, out=(q, s), provider=provider)
    q_ref, s_ref = quantize_ref(x, bits=4, block=256)
    assert torch.equal(q, q_ref) and torch.equal(s, s_ref) and buf[0] == 0x5A


@pytest.mark.parametrize("n", [3, 4097, 8192 + 300])
@pytest.mark.parametrize("block", [2, 16, 2048])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("bits", [8, 4])
def test_triton_blocks_across_bulk_and_tail(gen, n, block, dtype, bits):
    """The Triton layouts at block sizes below a 16-element vector, at it and above a program's usual tile
    (the numba simulator is too slow at these sizes for small blocks; the other providers are covered above)."""
    x = rand(n, dtype, gen) * 3
    for stochastic in (False, True):
        q, s = quantize(x, bits=bits, block=block, stochastic=stochastic, seed=5, provider="triton")
        q_ref, s_ref = quantize_ref(x, bits=bits, block=block, stochastic=stochastic, seed=5)
        assert torch.equal(q, q_ref) and torch.equal(s, s_ref), stochastic
    out = poison((n,), dtype)
    dequantize(q, s, block=block, numel=n, out=out, alpha=-2.0, provider="triton")
    assert torch.equal(out, dequantize_ref(q_ref, s_ref, numel=n, block=block, dtype=dtype, alpha=-2.0))


@HYP
@given(n=st.integers(1, 700), block=st.sampled_from([2, 16, 64, 256]), bits=st.sampled_from([8, 4]),
       stochastic=st.booleans(), seed=st.integers(0, 2**40), scale=st.floats(1e-6, 1e6))  # fmt: skip
def test_dequantize_error_within_the_documented_bound(n, block, bits, stochastic, seed, scale):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, generator=g) * scale).to(DEVICE)
    q, s = quantize(x, bits=bits, block=block, stochastic=stochastic, seed=seed, provider="torch")
    d = dequantize(q, s, block=block, numel=n, provider="torch")
    per_elem = s.repeat_interleave(block)[:n]
    bound = per_elem * (1.0 if stochastic else 0.5) * (1 + 1e-5) + per_elem * 1e-6
    assert bool(((d - x).abs() <= bound).all())


@pytest.mark.parametrize("n", [2, 9, 513])
def test_int4_packing_is_lossless_on_codes(provider, gen, n):
    """Values that are exact multiples of their block scale come back exactly, and the bytes hold the
    codes two's-complement nibble by nibble (low nibble first)."""
    block = 32
    codes = torch.randint(-7, 8, (n,), generator=gen)
    codes[::block] = 7  # each block's absmax is 7 * its scale
    scales = 2.0 ** torch.randint(-4, 5, (-(-n // block),), generator=gen).float()  # 7 * s / 7 == s exactly
    x = (codes.float() * scales.repeat_interleave(block)[:n]).to(DEVICE)
    q, s = quantize(x, bits=4, block=block, provider=provider)
    padded = torch.cat([codes, codes.new_zeros(n % 2)]).view(-1, 2) & 15
    assert torch.equal(q.cpu(), (padded[:, 0] | (padded[:, 1] << 4)).to(torch.uint8))
    d = dequantize(q, s, block=block, numel=n, provider=provider)
    assert torch.equal(d, x)


def test_stochastic_rounding_is_unbiased_and_reproducible(provider):
    """Blocks whose absmax is 127 * 0.01 and whose other elements sit at y = 0.3 and -2.7 code units:
    the mean code must be y to within 5 standard errors (fixed seed: deterministic, no flakiness)."""
    n, block = 256 * 48, 256
    x = torch.full((n,), 0.003)
    x[1::2] = -0.027
    x[::block] = 1.27  # scale = 0.01 per block
    x = x.to(DEVICE)
    q, s = quantize(x, bits=8, block=block, stochastic=True, seed=2026, provider=provider)
    assert torch.allclose(s, torch.full_like(s, 0.01))
    codes = q.float().cpu()
    for sl, y in ((slice(2, None, 2), 0.3), (slice(1, None, 2), -2.7)):
        sel = codes[sl]
        sel = sel[(torch.arange(n)[sl] % block) != 0]
        se = 0.5 / math.sqrt(sel.numel())  # Bernoulli standard deviation <= 0.5
        assert abs(sel.mean().item() - y) < 5 * se, (sel.mean().item(), y)
        assert set(sel.unique().tolist()) <= {math.floor(y), math.floor(y) + 1}
    q2, _ = quantize(x, bits=8, block=block, stochastic=True, seed=2026, provider=provider)
    q3, _ = quantize(x, bits=8, block=block, stochastic=True, seed=2027, provider=provider)
    assert torch.equal(q, q2)
    assert not torch.equal(q, q3)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
def test_torch_quantize_in_cpu_slices_matches_reference(gen, bits, stochastic):
    """On the CPU the torch provider quantizes in slices of CPU_SLICE elements: several slices, a ragged
    last block and (int4) an odd count give the reference's codes and scales bit for bit."""
    n = 3 * CPU_SLICE + 1001
    x = rand(n, torch.float32, gen).cpu()
    q, s = quantize(x, bits=bits, block=128, stochastic=stochastic, seed=5, provider="torch")
    q_ref, s_ref = quantize_ref(x, bits=bits, block=128, stochastic=stochastic, seed=5)
    assert torch.equal(q, q_ref) and torch.equal(s, s_ref)
    out = torch.full((n,), 0.5)
    dequantize(q, s, block=128, numel=n, out=out, accumulate=True, provider="torch")
    torch.testing.assert_close(out, dequantize_ref(q, s, numel=n, block=128) + 0.5, atol=0, rtol=0)


# ---------------------------------------------------------------------------------------- non-finite


@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_quantize_nonfinite_inputs_are_reported(provider, gen, bad):
    n = 2001
    x = rand(n, torch.float32, gen)
    x[1234] = bad
    with pytest.raises(NonFiniteError):
        quantize(x, provider=provider)
    _, s = quantize(x, block=256, check_finite=False, provider=provider)
    assert torch.isnan(s[1234 // 256]) and torch.isfinite(torch.cat([s[: 1234 // 256], s[1234 // 256 + 1 :]])).all()


@pytest.mark.parametrize("bits", [8, 4])
def test_quantize_nonfinite_in_bulk_and_tail_blocks(provider, gen, bits):
    """An Inf in the Triton bulk and a NaN in the tail's last, partial block: both counted in the error, both
    blocks (only they) get NaN scales, every other block's codes and scale as the reference's (the codes of a
    NaN-scaled block decode to NaN whatever they are; the torch provider's differ)."""
    n = 4096 + 300
    x = rand(n, torch.float32, gen)
    x[1000] = float("inf")
    x[n - 5] = float("nan")
    with pytest.raises(NonFiniteError, match="holds 2 non-finite"):
        quantize(x, bits=bits, provider=provider)
    q, s = quantize(x, bits=bits, check_finite=False, provider=provider)
    q_ref, s_ref = quantize_ref(x, bits=bits)
    bad = torch.zeros(s.numel(), dtype=torch.bool, device=s.device)
    bad[[1000 // 256, (n - 5) // 256]] = True
    assert torch.equal(torch.isnan(s), bad) and torch.equal(s[~bad], s_ref[~bad])
    keep = ~bad.repeat_interleave(256 if bits == 8 else 128)[: q.numel()]
    assert torch.equal(q[keep], q_ref[keep])


# -------------------------------------------------------------------------------------------- errors


def test_quantize_typed_errors():
    x = torch.randn(100, device=DEVICE)
    with pytest.raises(DTypeError):
        quantize(x.double())
    for bits in (3, 16):
        with pytest.raises(InvalidArgumentError):
            quantize(x, bits=bits)
    for block in (0, 1, 100, 2**20):
        with pytest.raises(InvalidArgumentError):
            quantize(x, block=block)
    q, s = quantize(x, block=32)
    with pytest.raises(ShapeError, match="scales"):
        dequantize(q, s, block=64)
    with pytest.raises(ShapeError):
        dequantize(q, s, block=32, numel=99)
    with pytest.raises(DTypeError):
        dequantize(q.to(torch.int32), s, block=32)
    with pytest.raises(ShapeError):
        dequantize(q, s, block=32, out=torch.empty(50, device=DEVICE))
    with pytest.raises(ProviderError):
        quantize(x, provider="nope")


def test_quantize_custom_ops_pass_opcheck():
    x = torch.randn(300)
    torch.library.opcheck(quantize_op, (x, 4, 64, True, 99, True, "torch"))
    q, s = quantize(x, block=64)
    torch.library.opcheck(dequantize_op, (q, s, torch.empty(300), 8, 64, 1.0, False, "torch"))


def test_out_buffers_overlapping_the_input_or_each_other_are_refused(provider):
    from torsh_kernels.ops.quantize import dequantize

    x = torch.randn(40, device=DEVICE)
    with pytest.raises(ShapeError, match=r"out\[0\] \(q\) overlaps x"):
        quantize(x[:37], block=8, out=(x.view(torch.int8)[100:137], torch.empty(5, device=DEVICE)), provider=provider)
    buf = torch.zeros(64, dtype=torch.uint8, device=DEVICE)
    with pytest.raises(ShapeError, match="overlaps out"):
        quantize(x[:37], block=8, out=(buf[:37].view(torch.int8), buf[32:52].view(torch.float32)), provider=provider)
    q, s = quantize(x[:37], block=8, provider=provider)
    store = torch.zeros(64, device=DEVICE)
    store.view(torch.int8)[:37] = q
    with pytest.raises(ShapeError, match="out overlaps q"):
        dequantize(store.view(torch.int8)[:37], s, block=8, out=store[:37], provider=provider)
    with pytest.raises(InvalidArgumentError, match="accumulate=True needs out="):
        dequantize(q, s, block=8, accumulate=True, provider=provider)
