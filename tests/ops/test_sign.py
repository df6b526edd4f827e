"""Sign ops: every provider and dtype against the torch reference, error feedback losing nothing, and
the typed errors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import torsh_kernels.ops.sign as S
from tests.helpers import DEVICE, close, poison, rand
from torsh_kernels.errors import DTypeError, NonFiniteError, ShapeError

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
HYP = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.mark.parametrize("n", [1, 8, 1001, 4097])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_sign_matches_reference(provider, gen, n, dtype, with_residual):
    x = rand(n, dtype, gen)
    r = rand(n, torch.float32, gen) * 0.3 if with_residual else None
    r_ref = r.clone() if r is not None else None
    old = r.clone() if r is not None else None
    bits, scale = S.sign_compress(x, r, provider=provider)
    b_ref, s_ref = S.sign_compress_ref(x, r_ref)
    assert bits.dtype == torch.uint8 and bits.shape == (-(-n // 8),) and scale.shape == ()
    assert torch.equal(bits, b_ref)
    close(scale, s_ref, 0, 1e-6)
    out = poison((n,), dtype)
    S.sign_decompress(bits, scale, n, out=out, provider=provider)
    close(out, S.sign_decompress_ref(b_ref, scale, n, dtype=dtype), 0, 0)
    if with_residual:
        close(r, r_ref, 1e-6, 1e-6)
        sent = S.sign_decompress(bits, scale, n, provider=provider)
        close(sent + r, x.float() + old, 2e-6, 2e-6)  # error feedback loses nothing


# The Triton kernels run a bulk of whole programs unmasked (abs_sum and pack: 4096 elements; unpack: 8192, 16384
# into 16-bit outputs) and the rest in a masked tail of 256-element programs: sizes below, across and above them,
# every element checked in outputs poisoned beforehand.
@pytest.mark.parametrize("n", [17, 4103, 16384 + 9])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_sign_bulk_and_tail(provider, gen, n, dtype):
    x = rand(n, dtype, gen)
    r = rand(n, torch.float32, gen) * 0.3
    r_ref = r.clone()
    bits, scale = S.sign_compress(x, r, provider=provider)
    b_ref, s_ref = S.sign_compress_ref(x, r_ref)
    assert torch.equal(bits, b_ref)
    close(scale, s_ref, 0, 1e-6)
    close(r, r_ref, 1e-6, 1e-6)
    assert torch.equal(S.sign_compress(x, provider=provider)[0], S.sign_compress_ref(x)[0])
    for accumulate in (False, True):
        base = rand(n, dtype, gen)
        out = base.clone() if accumulate else poison((n,), dtype)
        S.sign_decompress(bits, scale, n, out=out, accumulate=accumulate, alpha=-0.5, provider=provider)
        ref = S.sign_decompress_ref(b_ref, scale, n, dtype=dtype, out=base.clone() if accumulate else None,
                                    accumulate=accumulate, alpha=-0.5)  # fmt: skip
        close(out, ref, 0, 0)


@pytest.mark.parametrize("accumulate", [False, True])
def test_sign_decompress_accumulate_and_alpha(provider, gen, accumulate):
    n = 1003
    bits, scale = S.sign_compress_ref(rand(n, torch.float32, gen))
    base = rand(n, torch.float32, gen)
    out = base.clone() if accumulate else poison((n,), torch.float32)
    S.sign_decompress(bits, scale, n, out=out, accumulate=accumulate, alpha=0.25, provider=provider)
    ref = S.sign_decompress_ref(bits, scale, n, out=base.clone() if accumulate else None, accumulate=accumulate,
                                alpha=0.25)  # fmt: skip
    close(out, ref, 0, 0)


@HYP
@given(n=st.integers(1, 3000), seed=st.integers(0, 2**31))
def test_sign_error_feedback_loses_nothing(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g).to(DEVICE)
    r = torch.randn(n, generator=g).to(DEVICE)
    old = r.clone()
    bits, scale = S.sign_compress(x, r, provider="torch")
    sent = S.sign_decompress(bits, scale, n, provider="torch")
    torch.testing.assert_close(sent + r, x + old, atol=1e-5, rtol=1e-6)


# ---------------------------------------------------------------------------------------- non-finite


@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_sign_nonfinite_inputs_are_reported_and_change_nothing(provider, gen, bad):
    n = 2001
    x = rand(n, torch.float32, gen)
    x[1234] = bad
    r = rand(n, torch.float32, gen)
    keep = r.clone()
    with pytest.raises(NonFiniteError):
        S.sign_compress(x, r, provider=provider)
    assert torch.equal(r, keep)


@pytest.mark.filterwarnings("ignore:overflow encountered")  # the interpreter's and simulator's numpy
def test_sign_nonfinite_in_bulk_and_tail_are_counted(provider, gen):
    """An Inf in the Triton bulk and a NaN in its tail are both counted; finite x and residual whose sum
    overflows fp32 count too (v = x + r is what is compressed); the residual is left as it was."""
    n = 4103
    x = rand(n, torch.float32, gen)
    x[100] = float("inf")
    x[n - 2] = float("nan")
    r = rand(n, torch.float32, gen)
    keep = r.clone()
    with pytest.raises(NonFiniteError, match="holds 2 non-finite"):
        S.sign_compress(x, r, provider=provider)
    assert torch.equal(r, keep)
    x = torch.full((n,), 3e38, device=DEVICE)
    with pytest.raises(NonFiniteError, match=f"holds {n} non-finite"):
        S.sign_compress(x, x.clone(), provider=provider)


# -------------------------------------------------------------------------------------------- errors


def test_sign_typed_errors():
    x = torch.randn(100, device=DEVICE)
    bits, scale = S.sign_compress(x)
    with pytest.raises(ShapeError):
        S.sign_decompress(bits, scale, 200)
    with pytest.raises(DTypeError):
        S.sign_decompress(bits.to(torch.int8), scale, 100)


def test_sign_custom_op_passes_opcheck():
    x = torch.randn(300)
    r = torch.randn(300)
    torch.library.opcheck(torch.ops.torsh.sign_compress.default, (x, r, True, "torch"))


def test_decompress_refuses_out_over_its_bits_and_accumulate_without_out(provider):
    from torsh_kernels.errors import InvalidArgumentError

    store = torch.zeros(32, dtype=torch.uint8, device=DEVICE)
    store[:2] = torch.tensor([0b10110011, 1], dtype=torch.uint8)
    with pytest.raises(ShapeError, match="out overlaps bits"):
        S.sign_decompress(store[:2], 0.5, 10, out=store.view(torch.bfloat16)[:10], provider=provider)
    with pytest.raises(InvalidArgumentError, match="accumulate=True needs out="):
        S.sign_decompress(store[:2], 0.5, 10, accumulate=True, provider=provider)
