"""Compression ops: every provider and dtype against the torch reference, plus the properties the
compressors rely on (error feedback loses nothing, error bounds, lossless int4 packing, unbiased
stochastic rounding, orthonormal columns) and the typed errors."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import DEVICE, DTYPE_TOLS, poison, rand
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import torsh_kernels.ops.compress as C
from torsh_kernels.errors import (
    ArgumentTypeError,
    DeviceMismatchError,
    DTypeError,
    InvalidArgumentError,
    NonFiniteError,
    ProviderError,
    ShapeError,
)

SIZES = [1, 7, 1000, 4097]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
HYP = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _close(a, b, atol, rtol):
    torch.testing.assert_close(a.float().cpu(), b.float().cpu(), atol=atol, rtol=rtol, equal_nan=False)


# ---------------------------------------------------------------------------------------------- top-k


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("exact", [False, True], ids=["approx", "exact"])
def test_topk_matches_reference(provider, gen, n, dtype, with_residual, exact):
    x = rand(n, dtype, gen)
    r = rand(n, torch.float32, gen) * 0.5 if with_residual else None
    old = r.clone() if r is not None else None
    r_ref = r.clone() if r is not None else None
    ratio = 0.01 if n > 100 else 0.3
    values, idx = C.topk_compress(x, ratio=ratio, residual=r, exact=exact, provider=provider)
    v_ref, i_ref = C.topk_compress_ref(x, ratio=ratio, residual=r_ref)
    k = C.topk_count(n, ratio)
    assert values.shape == (k,) and idx.shape == (k,) and idx.dtype == torch.int32 and values.dtype == dtype
    assert bool((idx[1:] > idx[:-1]).all()), "indices ascending and distinct"
    full = x.float() + (old if with_residual else 0)
    # the selected magnitudes are exactly the k largest (ties in low precision may pick other indices)
    assert torch.equal(full.abs()[idx.long()].sort().values, full.abs()[i_ref.long()].sort().values)
    assert torch.equal(values, full[idx.long()].to(dtype))
    if torch.equal(idx, i_ref):
        assert torch.equal(values, v_ref)
        if with_residual:
            assert torch.equal(r, r_ref)
    if with_residual:
        # error feedback: sent + new residual == x + old residual; untouched where nothing was sent
        sent = torch.zeros(n, device=DEVICE).index_add_(0, idx.long(), values.float())
        unsent = torch.ones(n, dtype=torch.bool, device=DEVICE)
        unsent[idx.long()] = False
        assert torch.equal(r[unsent], full[unsent])
        _close(sent + r, full, 1e-6, 1e-6)


@pytest.mark.parametrize("rdtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_topk_16bit_residual_rounds_once(provider, gen, rdtype):
    """A 16-bit residual ends bit-equal to the reference's: x + residual - sent in fp32, rounded once
    (rounding x + residual first and subtracting after would leave up to an ulp of |x + residual|)."""
    n = 2001
    x = rand(n, torch.float32, gen)
    r = (rand(n, torch.float32, gen) * 0.3).to(rdtype)
    r_ref = r.clone()
    _, idx = C.topk_compress(x, ratio=0.05, residual=r, provider=provider)
    _, i_ref = C.topk_compress_ref(x, ratio=0.05, residual=r_ref)
    assert torch.equal(idx, i_ref)
    assert torch.equal(r, r_ref)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16", "bf16"])
def test_topk_no_ties_gives_the_reference_indices(provider, gen, dtype):
    n = 3001
    x = torch.randperm(n, generator=gen).float().sub_(n / 2).to(dtype).to(DEVICE)  # distinct magnitudes in fp32
    x = rand(n, torch.float32, gen) if dtype == torch.float32 else x
    values, idx = C.topk_compress(x, ratio=0.02, provider=provider)
    v_ref, i_ref = C.topk_compress_ref(x, ratio=0.02)
    if dtype == torch.float32:
        assert torch.equal(idx, i_ref) and torch.equal(values, v_ref)
    else:
        assert torch.equal(x.abs()[idx.long()].sort().values, x.abs()[i_ref.long()].sort().values)


def _count_rounds(monkeypatch, provider):
    calls = []
    impl = C._candidates.impls[provider]

    def counting(*args):
        calls.append(args[2])
        return impl(*args)

    monkeypatch.setitem(C._candidates.impls, provider, counting)
    return calls


@pytest.mark.parametrize("aim", [0.3, 1.125, 4.0], ids=["too-few", "on-target", "too-many"])
def test_topk_sampled_threshold_and_refinement(provider, gen, monkeypatch, aim):
    """A small sample (so the threshold really is estimated), aimed too low, right or too high: the
    refinement brings the candidate count into [k, CAP] and the result is still the exact top-k."""
    monkeypatch.setattr(C, "TOPK_MIN_SAMPLE", 64)
    monkeypatch.setattr(C, "TOPK_SAMPLE_PER_K", 8)
    monkeypatch.setattr(C, "_TOPK_TARGET", aim)
    calls = _count_rounds(monkeypatch, provider)
    n = 6007
    x = rand(n, torch.float32, gen)
    _, idx = C.topk_compress(x, ratio=0.02, provider=provider)
    _, i_ref = C.topk_compress_ref(x, ratio=0.02)
    assert torch.equal(idx, i_ref)
    assert 1 <= len(calls) <= C.TOPK_REFINE
    if aim != 1.125:
        assert len(calls) >= 2, "a threshold aimed outside the band must be refined"


def test_topk_falls_back_to_exact_when_ties_defeat_the_threshold(provider, gen):
    x = torch.ones(5000, device=DEVICE)
    x[17] = 3.0
    values, idx = C.topk_compress(x, ratio=0.01, provider=provider)
    assert idx.numel() == 50 and 17 in idx.tolist()
    assert bool((x[idx.long()] == values).all())


@pytest.mark.parametrize("dtype,atol,rtol", DTYPE_TOLS)
@pytest.mark.parametrize("accumulate", [False, True])
def test_topk_decompress_matches_reference(provider, gen, dtype, atol, rtol, accumulate):
    n, k = 4097, 300
    values = rand(k, dtype, gen)
    idx = torch.randperm(n, generator=gen)[:k].to(torch.int32).to(DEVICE)
    base = rand(n, dtype, gen)
    out = base.clone() if accumulate else poison((n,), dtype)
    got = C.topk_decompress(values, idx, n, out=out, accumulate=accumulate, alpha=0.5, provider=provider)
    ref = C.topk_decompress_ref(values, idx, n, out=base.clone() if accumulate else None, accumulate=accumulate,
                                alpha=0.5)  # fmt: skip
    assert got is out
    _close(got, ref, atol, rtol)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_topk_decompress_sums_repeated_indices(provider, gen, out_dtype):
    """Concatenated payloads of several ranks: repeated indices add up (atomics, or an fp32 copy)."""
    n = 999
    idx = torch.cat([torch.randperm(n, generator=gen)[:200] for _ in range(3)]).to(torch.int32).to(DEVICE)
    values = rand(600, torch.float32, gen)
    out = torch.zeros(n, dtype=out_dtype, device=DEVICE)
    C.topk_decompress(values, idx, n, out=out, accumulate=True, provider=provider)
    ref = torch.zeros(n, device=DEVICE).index_add_(0, idx.long(), values)
    _close(
        out,
        ref.to(out_dtype),
        1e-5 if out_dtype == torch.float32 else 8e-3,
        1e-5 if out_dtype == torch.float32 else 8e-3,
    )


def test_topk_decompress_rejects_out_of_range_indices(provider):
    out = torch.full((10,), 7.0, device=DEVICE)
    with pytest.raises(ShapeError, match="outside"):
        C.topk_decompress(torch.ones(2, device=DEVICE), torch.tensor([3, 10], device=DEVICE), 10, out=out,
                          provider=provider)  # fmt: skip
    assert bool((out == 7.0).all()), "nothing written"


# ------------------------------------------------------------------------------------------ quantize


@pytest.mark.parametrize("n", [1, 3, 255, 1000, 4097])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
def test_quantize_matches_reference_bit_for_bit(provider, gen, n, dtype, bits, stochastic):
    x = rand(n, dtype, gen) * 3
    block = 64 if n % 2 else 256
    q, s = C.quantize(x, bits=bits, block=block, stochastic=stochastic, seed=1234, provider=provider)
    q_ref, s_ref = C.quantize_ref(x, bits=bits, block=block, stochastic=stochastic, seed=1234)
    assert q.dtype == q_ref.dtype and q.shape == q_ref.shape and s.shape == s_ref.shape
    assert torch.equal(q, q_ref)
    assert torch.equal(s, s_ref)


@pytest.mark.parametrize("dtype,atol,rtol", DTYPE_TOLS)
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("accumulate", [False, True])
def test_dequantize_matches_reference(provider, gen, dtype, atol, rtol, bits, accumulate):
    n = 4095
    q, s = C.quantize_ref(rand(n, torch.float32, gen), bits=bits, block=128)
    base = rand(n, dtype, gen)
    out = base.clone() if accumulate else poison((n,), dtype)
    got = C.dequantize(q, s, block=128, numel=n, out=out, accumulate=accumulate, alpha=-0.75, provider=provider)
    ref = C.dequantize_ref(q, s, numel=n, block=128, dtype=dtype, out=base.clone() if accumulate else None,
                           accumulate=accumulate, alpha=-0.75)  # fmt: skip
    _close(got, ref, atol, rtol)


@HYP
@given(n=st.integers(1, 700), block=st.sampled_from([2, 16, 64, 256]), bits=st.sampled_from([8, 4]),
       stochastic=st.booleans(), seed=st.integers(0, 2**40), scale=st.floats(1e-6, 1e6))  # fmt: skip
def test_dequantize_error_within_the_documented_bound(n, block, bits, stochastic, seed, scale):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, generator=g) * scale).to(DEVICE)
    q, s = C.quantize(x, bits=bits, block=block, stochastic=stochastic, seed=seed, provider="torch")
    d = C.dequantize(q, s, block=block, numel=n, provider="torch")
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
    q, s = C.quantize(x, bits=4, block=block, provider=provider)
    padded = torch.cat([codes, codes.new_zeros(n % 2)]).view(-1, 2) & 15
    assert torch.equal(q.cpu(), (padded[:, 0] | (padded[:, 1] << 4)).to(torch.uint8))
    d = C.dequantize(q, s, block=block, numel=n, provider=provider)
    assert torch.equal(d, x)


def test_stochastic_rounding_is_unbiased_and_reproducible(provider):
    """Blocks whose absmax is 127 * 0.01 and whose other elements sit at y = 0.3 and -2.7 code units:
    the mean code must be y to within 5 standard errors (fixed seed: deterministic, no flakiness)."""
    n, block = 256 * 48, 256
    x = torch.full((n,), 0.003)
    x[1::2] = -0.027
    x[::block] = 1.27  # scale = 0.01 per block
    x = x.to(DEVICE)
    q, s = C.quantize(x, bits=8, block=block, stochastic=True, seed=2026, provider=provider)
    assert torch.allclose(s, torch.full_like(s, 0.01))
    codes = q.float().cpu()
    for sl, y in ((slice(2, None, 2), 0.3), (slice(1, None, 2), -2.7)):
        sel = codes[sl]
        sel = sel[(torch.arange(n)[sl] % block) != 0]
        se = 0.5 / math.sqrt(sel.numel())  # Bernoulli standard deviation <= 0.5
        assert abs(sel.mean().item() - y) < 5 * se, (sel.mean().item(), y)
        assert set(sel.unique().tolist()) <= {math.floor(y), math.floor(y) + 1}
    q2, _ = C.quantize(x, bits=8, block=block, stochastic=True, seed=2026, provider=provider)
    q3, _ = C.quantize(x, bits=8, block=block, stochastic=True, seed=2027, provider=provider)
    assert torch.equal(q, q2)
    assert not torch.equal(q, q3)


# ------------------------------------------------------------------------------------------- signs


@pytest.mark.parametrize("n", [1, 8, 1001, 4097])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_sign_matches_reference(provider, gen, n, dtype, with_residual):
    x = rand(n, dtype, gen)
    r = rand(n, torch.float32, gen) * 0.3 if with_residual else None
    r_ref = r.clone() if r is not None else None
    old = r.clone() if r is not None else None
    bits, scale = C.sign_compress(x, r, provider=provider)
    b_ref, s_ref = C.sign_compress_ref(x, r_ref)
    assert bits.dtype == torch.uint8 and bits.shape == (-(-n // 8),) and scale.shape == ()
    assert torch.equal(bits, b_ref)
    _close(scale, s_ref, 0, 1e-6)
    out = poison((n,), dtype)
    C.sign_decompress(bits, scale, n, out=out, provider=provider)
    _close(out, C.sign_decompress_ref(b_ref, scale, n, dtype=dtype), 0, 0)
    if with_residual:
        _close(r, r_ref, 1e-6, 1e-6)
        sent = C.sign_decompress(bits, scale, n, provider=provider)
        _close(sent + r, x.float() + old, 2e-6, 2e-6)  # error feedback loses nothing


@pytest.mark.parametrize("accumulate", [False, True])
def test_sign_decompress_accumulate_and_alpha(provider, gen, accumulate):
    n = 1003
    bits, scale = C.sign_compress_ref(rand(n, torch.float32, gen))
    base = rand(n, torch.float32, gen)
    out = base.clone() if accumulate else poison((n,), torch.float32)
    C.sign_decompress(bits, scale, n, out=out, accumulate=accumulate, alpha=0.25, provider=provider)
    ref = C.sign_decompress_ref(bits, scale, n, out=base.clone() if accumulate else None, accumulate=accumulate,
                                alpha=0.25)  # fmt: skip
    _close(out, ref, 0, 0)


# ------------------------------------------------------------------------------- error-feedback steps


@pytest.mark.parametrize("dtype,atol,rtol", DTYPE_TOLS)
def test_residual_add_and_error_update(provider, gen, dtype, atol, rtol):
    n = 4097
    x, r = rand(n, dtype, gen), rand(n, torch.float32, gen)
    out = poison((n,), torch.float32)
    C.residual_add(x, r, out=out, provider=provider)
    _close(out, C.residual_add_ref(x, r), 0, 0)
    approx = rand(n, torch.float32, gen)
    res, grad = poison((n,), torch.float32), poison((n,), dtype)
    C.error_update(out, approx, res, out=grad, provider=provider)
    res_ref, grad_ref = torch.empty(n, device=DEVICE), torch.empty(n, dtype=dtype, device=DEVICE)
    C.error_update_ref(out, approx, res_ref, out=grad_ref)
    _close(res, res_ref, 0, 0)
    _close(grad, grad_ref, atol, rtol)
    C.residual_add(x, r, out=r, provider=provider)  # in place into the residual
    _close(r, out, 0, 0)


@HYP
@given(n=st.integers(1, 3000), ratio=st.floats(0.001, 1.0), steps=st.integers(1, 3), seed=st.integers(0, 2**31))
def test_topk_error_feedback_loses_nothing(n, ratio, steps, seed):
    """Over several steps: everything sent plus the final residual equals the sum of the inputs."""
    g = torch.Generator().manual_seed(seed)
    r = torch.zeros(n, device=DEVICE)
    sent = torch.zeros(n, dtype=torch.float64, device=DEVICE)
    total = torch.zeros(n, dtype=torch.float64, device=DEVICE)
    for _ in range(steps):
        x = torch.randn(n, generator=g).to(DEVICE)
        total += x.double()
        v, i = C.topk_compress(x, ratio=ratio, residual=r, provider="torch")
        sent.index_add_(0, i.long(), v.double())
    torch.testing.assert_close(sent + r.double(), total, atol=1e-5 * steps, rtol=1e-6)


@HYP
@given(n=st.integers(1, 3000), seed=st.integers(0, 2**31))
def test_sign_error_feedback_loses_nothing(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g).to(DEVICE)
    r = torch.randn(n, generator=g).to(DEVICE)
    old = r.clone()
    bits, scale = C.sign_compress(x, r, provider="torch")
    sent = C.sign_decompress(bits, scale, n, provider="torch")
    torch.testing.assert_close(sent + r, x + old, atol=1e-5, rtol=1e-6)


# ---------------------------------------------------------------------------------- orthogonalize


def _check_orthonormal(m: torch.Tensor, zero_cols=(), tol=1e-5):
    q = m.double()
    nz = [j for j in range(q.shape[1]) if j not in zero_cols]
    for j in zero_cols:
        assert bool((q[:, j] == 0).all()), f"column {j} should be zero"
    g = q[:, nz].T @ q[:, nz]
    assert torch.allclose(g, torch.eye(len(nz), dtype=torch.float64, device=g.device), atol=tol), g


@pytest.mark.parametrize(
    "shape", [(1, 1), (7, 3), (300, 5), (3, 129, 8), (2, 70, 32), (5, 5)], ids=lambda s: "x".join(map(str, s))
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=["fp32", "fp64", "bf16"])
def test_orthogonalize_matches_reference(provider, gen, shape, dtype):
    m = rand(shape, torch.float32, gen).to(dtype)
    ref = m.clone()
    got = C.orthogonalize(m, provider=provider)
    C.orthogonalize_ref(ref)
    assert got is m
    tol = {torch.float32: 2e-5, torch.float64: 1e-12, torch.bfloat16: 1.6e-2}[dtype]
    _close(m, ref, tol, tol)
    for mat, rmat in zip(m.view(-1, *shape[-2:]), ref.view(-1, *shape[-2:])):
        dropped = [j for j in range(shape[-1]) if bool((rmat[:, j] == 0).all())]  # near-dependent in bf16
        assert len(dropped) <= (1 if dtype == torch.bfloat16 else 0)
        _check_orthonormal(mat, zero_cols=dropped, tol=max(tol, 1e-6) * 4)


def test_orthogonalize_zero_and_dependent_columns(provider, gen):
    m = rand((200, 6), torch.float32, gen)
    m[:, 1] = 0  # zero column
    m[:, 3] = 2 * m[:, 0] - m[:, 2]  # linearly dependent on earlier columns
    m[:, 5] = m[:, 4] * 1e-3  # dependent, and tiny
    C.orthogonalize(m, provider=provider)
    assert torch.isfinite(m).all()
    _check_orthonormal(m, zero_cols=(1, 3, 5))
    z = torch.zeros(50, 4, device=DEVICE)
    C.orthogonalize(z, provider=provider)
    assert bool((z == 0).all())


def test_orthogonalize_list_of_different_heights(provider, gen):
    mats = [rand((m, 4), torch.float32, gen) for m in (5, 130, 64, 4)]
    refs = [m.clone() for m in mats]
    C.orthogonalize(mats, provider=provider)
    C.orthogonalize_ref(refs)
    for a, b in zip(mats, refs):
        _close(a, b, 2e-5, 2e-5)


def test_orthogonalize_views_of_one_buffer(provider, gen):
    buf = rand(3 * 40 * 3 + 1, torch.float32, gen)
    mats = [buf[1 + i * 120 : 1 + (i + 1) * 120].view(40, 3) for i in range(3)]
    refs = [m.clone() for m in mats]
    C.orthogonalize(mats, provider=provider)
    C.orthogonalize_ref(refs)
    for a, b in zip(mats, refs):
        _close(a, b, 2e-5, 2e-5)


def test_orthogonalize_wide_rank_uses_torch_or_raises(gen):
    m = rand((100, 33), torch.float32, gen)
    ref = m.clone()
    C.orthogonalize(m)  # automatic: beyond the kernels' 32 columns, the torch path
    C.orthogonalize_ref(ref)
    _close(m, ref, 2e-5, 2e-5)
    with pytest.raises(ShapeError, match="32 columns"):
        C.orthogonalize(m.clone(), provider="triton")


# ---------------------------------------------------------------------------------------- non-finite


@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_nonfinite_inputs_are_reported_and_change_nothing(provider, gen, bad):
    n = 2001
    x = rand(n, torch.float32, gen)
    x[1234] = bad
    r = rand(n, torch.float32, gen)
    keep = r.clone()
    for exact in (False, True):
        with pytest.raises(NonFiniteError, match="non-finite"):
            C.topk_compress(x, ratio=0.01, residual=r, exact=exact, provider=provider)
        assert torch.equal(r, keep)
    with pytest.raises(NonFiniteError):
        C.sign_compress(x, r, provider=provider)
    assert torch.equal(r, keep)
    with pytest.raises(NonFiniteError):
        C.quantize(x, provider=provider)
    _, s = C.quantize(x, block=256, check_finite=False, provider=provider)
    assert torch.isnan(s[1234 // 256]) and torch.isfinite(torch.cat([s[: 1234 // 256], s[1234 // 256 + 1 :]])).all()
    with pytest.raises(NonFiniteError):
        C.residual_add(x, r, provider=provider)
    m = rand((30, 3), torch.float32, gen)
    m[4, 1] = bad
    mk = m.clone()
    with pytest.raises(NonFiniteError):
        C.orthogonalize(m, provider=provider)
    assert torch.equal(m.nan_to_num(), mk.nan_to_num())


# ------------------------------------------------------------------------------------------- errors


def test_typed_errors():
    x = torch.randn(100, device=DEVICE)
    with pytest.raises(DTypeError):
        C.topk_compress(torch.arange(10, device=DEVICE), ratio=0.1)
    with pytest.raises(DTypeError):
        C.quantize(x.double())
    with pytest.raises(ArgumentTypeError):
        C.topk_compress([1.0, 2.0], ratio=0.1)
    for ratio in (0, 1.5, -0.1, float("nan")):
        with pytest.raises(InvalidArgumentError):
            C.topk_compress(x, ratio=ratio)
    with pytest.raises(ArgumentTypeError):
        C.topk_compress(x, ratio="0.1")
    with pytest.raises(ShapeError):
        C.topk_compress(x, ratio=0.1, residual=torch.zeros(99, device=DEVICE))
    with pytest.raises(ShapeError):
        C.topk_compress(x, ratio=0.1, residual=x)  # overlaps x
    with pytest.raises(ShapeError):
        C.topk_compress(torch.empty(0, device=DEVICE), ratio=0.1)
    with pytest.raises(DTypeError):
        C.topk_decompress(x[:3], torch.tensor([0.0, 1.0, 2.0], device=DEVICE), 100)
    with pytest.raises(ShapeError):
        C.topk_decompress(x[:3], torch.tensor([0, 1], device=DEVICE), 100)
    for bits in (3, 16):
        with pytest.raises(InvalidArgumentError):
            C.quantize(x, bits=bits)
    for block in (0, 1, 100, 2**20):
        with pytest.raises(InvalidArgumentError):
            C.quantize(x, block=block)
    q, s = C.quantize(x, block=32)
    with pytest.raises(ShapeError, match="scales"):
        C.dequantize(q, s, block=64)
    with pytest.raises(ShapeError):
        C.dequantize(q, s, block=32, numel=99)
    with pytest.raises(DTypeError):
        C.dequantize(q.to(torch.int32), s, block=32)
    with pytest.raises(ShapeError):
        C.dequantize(q, s, block=32, out=torch.empty(50, device=DEVICE))
    bits, scale = C.sign_compress(x)
    with pytest.raises(ShapeError):
        C.sign_decompress(bits, scale, 200)
    with pytest.raises(DTypeError):
        C.sign_decompress(bits.to(torch.int8), scale, 100)
    with pytest.raises(ShapeError):
        C.orthogonalize(torch.randn(2, 3, 4, 5, device=DEVICE))
    with pytest.raises(ShapeError):
        C.orthogonalize(torch.randn(10, 4, device=DEVICE).t())  # not contiguous
    with pytest.raises(ShapeError):
        C.orthogonalize([torch.randn(10, 4, device=DEVICE), torch.randn(10, 3, device=DEVICE)])
    with pytest.raises(DTypeError):
        C.orthogonalize([torch.randn(10, 4, device=DEVICE), torch.randn(10, 4, device=DEVICE).double()])
    with pytest.raises(InvalidArgumentError):
        C.orthogonalize(torch.randn(10, 4, device=DEVICE), rtol=2.0)
    with pytest.raises(ShapeError):
        C.error_update(x, x[:50], torch.empty(100, device=DEVICE))
    if DEVICE.type == "cuda":
        with pytest.raises(DeviceMismatchError):
            C.topk_compress(x, ratio=0.1, residual=torch.zeros(100))
    with pytest.raises(ProviderError):
        C.quantize(x, provider="nope")


def test_custom_ops_pass_opcheck():
    x = torch.randn(300)
    r = torch.randn(300)
    torch.library.opcheck(C._topk_op, (x, r, 5, False, True, "torch"))
    torch.library.opcheck(C._quantize_op, (x, 4, 64, True, 99, True, "torch"))
    torch.library.opcheck(C._sign_op, (x, r, True, "torch"))
    q, s = C.quantize(x, block=64)
    torch.library.opcheck(C._dequantize_op, (q, s, torch.empty(300), 8, 64, 1.0, False, "torch"))
    torch.library.opcheck(C._ortho_op, ([torch.randn(20, 3), torch.randn(9, 3)], 1e-4, 2, "torch"))


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
def test_torch_quantize_in_cpu_slices_matches_reference(gen, bits, stochastic):
    """On the CPU the torch provider quantizes in slices of CPU_SLICE elements: several slices, a ragged
    last block and (int4) an odd count give the reference's codes and scales bit for bit."""
    n = 3 * C.CPU_SLICE + 1001
    x = rand(n, torch.float32, gen).cpu()
    q, s = C.quantize(x, bits=bits, block=128, stochastic=stochastic, seed=5, provider="torch")
    q_ref, s_ref = C.quantize_ref(x, bits=bits, block=128, stochastic=stochastic, seed=5)
    assert torch.equal(q, q_ref) and torch.equal(s, s_ref)
    out = torch.full((n,), 0.5)
    C.dequantize(q, s, block=128, numel=n, out=out, accumulate=True, provider="torch")
    torch.testing.assert_close(out, C.dequantize_ref(q, s, numel=n, block=128) + 0.5, atol=0, rtol=0)
