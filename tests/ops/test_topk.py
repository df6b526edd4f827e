"""Top-k ops: every provider and dtype against the torch reference, the sampled threshold and its
refinement, error feedback losing nothing, and the typed errors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import torsh_kernels.ops.topk as K
from tests.helpers import DEVICE, DTYPE_TOLS, close, poison, rand
from torsh_kernels.errors import (
    ArgumentTypeError,
    DeviceMismatchError,
    DTypeError,
    InvalidArgumentError,
    NonFiniteError,
    ShapeError,
)
from torsh_kernels.ops.topk import api, providers

SIZES = [1, 7, 1000, 4097]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
HYP = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


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
    values, idx = K.topk_compress(x, ratio=ratio, residual=r, exact=exact, provider=provider)
    v_ref, i_ref = K.topk_compress_ref(x, ratio=ratio, residual=r_ref)
    k = K.topk_count(n, ratio)
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
        close(sent + r, full, 1e-6, 1e-6)


@pytest.mark.parametrize("rdtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_topk_16bit_residual_rounds_once(provider, gen, rdtype):
    """A 16-bit residual ends bit-equal to the reference's: x + residual - sent in fp32, rounded once
    (rounding x + residual first and subtracting after would leave up to an ulp of |x + residual|)."""
    n = 2001
    x = rand(n, torch.float32, gen)
    r = (rand(n, torch.float32, gen) * 0.3).to(rdtype)
    r_ref = r.clone()
    _, idx = K.topk_compress(x, ratio=0.05, residual=r, provider=provider)
    _, i_ref = K.topk_compress_ref(x, ratio=0.05, residual=r_ref)
    assert torch.equal(idx, i_ref)
    assert torch.equal(r, r_ref)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16", "bf16"])
def test_topk_no_ties_gives_the_reference_indices(provider, gen, dtype):
    n = 3001
    x = torch.randperm(n, generator=gen).float().sub_(n / 2).to(dtype).to(DEVICE)  # distinct magnitudes in fp32
    x = rand(n, torch.float32, gen) if dtype == torch.float32 else x
    values, idx = K.topk_compress(x, ratio=0.02, provider=provider)
    v_ref, i_ref = K.topk_compress_ref(x, ratio=0.02)
    if dtype == torch.float32:
        assert torch.equal(idx, i_ref) and torch.equal(values, v_ref)
    else:
        assert torch.equal(x.abs()[idx.long()].sort().values, x.abs()[i_ref.long()].sort().values)


def _count_rounds(monkeypatch, provider):
    calls = []
    impl = providers.candidates_impl.impls[provider]

    def counting(*args):
        calls.append(args[2])
        return impl(*args)

    monkeypatch.setitem(providers.candidates_impl.impls, provider, counting)
    return calls


@pytest.mark.parametrize("aim", [0.3, 1.125, 4.0], ids=["too-few", "on-target", "too-many"])
def test_topk_sampled_threshold_and_refinement(provider, gen, monkeypatch, aim):
    """A small sample (so the threshold really is estimated), aimed too low, right or too high: the
    refinement brings the candidate count into [k, CAP] and the result is still the exact top-k."""
    monkeypatch.setattr(api, "TOPK_MIN_SAMPLE", 64)
    monkeypatch.setattr(api, "TOPK_SAMPLE_PER_K", 8)
    monkeypatch.setattr(api, "_TOPK_TARGET", aim)
    calls = _count_rounds(monkeypatch, provider)
    n = 6007
    x = rand(n, torch.float32, gen)
    _, idx = K.topk_compress(x, ratio=0.02, provider=provider)
    _, i_ref = K.topk_compress_ref(x, ratio=0.02)
    assert torch.equal(idx, i_ref)
    assert 1 <= len(calls) <= K.TOPK_REFINE
    if aim != 1.125:
        assert len(calls) >= 2, "a threshold aimed outside the band must be refined"


def test_topk_falls_back_to_exact_when_ties_defeat_the_threshold(provider, gen):
    x = torch.ones(5000, device=DEVICE)
    x[17] = 3.0
    values, idx = K.topk_compress(x, ratio=0.01, provider=provider)
    assert idx.numel() == 50 and 17 in idx.tolist()
    assert bool((x[idx.long()] == values).all())


def _candidates_ref(x, r, thr):
    """(global indices ascending, their fp32 values, non-finite count) of the candidates |x + r| >= thr."""
    acc = x.float() + (r.float() if r is not None else 0)
    fin = torch.isfinite(acc)
    idx = ((acc.abs() >= thr) & fin).nonzero().view(-1)
    return idx, acc[idx], int((~fin).sum())


@pytest.mark.parametrize("n", [1, 3, 17, 4097, 8195])  # bulk + tail launches: the tail alone, both, several programs
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
def test_topk_candidates_pass_at_any_size(provider, gen, n, dtype, with_residual, idx_dtype):
    """The candidate pass itself: every candidate once with its global index and fp32 value (any order), the
    count of all candidates and of the non-finite elements, with NaN/Inf in the bulk and in the tail; with a
    buffer too small, the count still counts all and the buffer holds `cap` distinct candidates."""
    x = rand(n, dtype, gen)
    r = rand(n, torch.float32, gen) * 0.5 if with_residual else None
    for i, bad in ((n - 1, float("nan")), (n - 2, float("inf")), (3, float("-inf")), (n // 2, float("nan"))):
        if 0 <= i < n:
            x[i] = bad
    want, wval, wbad = _candidates_ref(x, r, 0.5)
    impl = providers.candidates_impl.impls[provider]
    for cap in (n, max(1, want.numel() // 2)):
        cval, cidx, cnt = impl(x, r, 0.5, cap, idx_dtype)
        count, nbad = cnt if type(cnt) is tuple else cnt.tolist()
        assert (count, nbad) == (want.numel(), wbad)
        kept = min(count, cap)
        assert cidx.dtype == idx_dtype and cval.dtype == torch.float32
        got, order = cidx[:kept].long().sort()
        if kept == want.numel():
            assert torch.equal(got, want)
        else:
            assert bool((got[1:] > got[:-1]).all()) and bool(torch.isin(got, want).all())
        assert torch.equal(cval[:kept][order], wval[torch.searchsorted(want, got)])


@pytest.mark.parametrize("k", [1, 3, 17, 4097])  # bulk + tail launches
@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("accumulate", [False, True])
def test_topk_decompress_at_any_size(provider, gen, k, idx_dtype, dtype, accumulate):
    n = 5003
    values = rand(k, dtype, gen)
    idx = torch.randperm(n, generator=gen)[:k].to(idx_dtype).to(DEVICE)
    base = rand(n, dtype, gen)
    out = base.clone() if accumulate else poison((n,), dtype)
    K.topk_decompress(values, idx, n, out=out, accumulate=accumulate, alpha=-1.5, provider=provider)
    ref = K.topk_decompress_ref(values, idx, n, out=base.clone() if accumulate else None, accumulate=accumulate,
                                alpha=-1.5)  # fmt: skip
    assert torch.equal(out, ref)


@pytest.mark.parametrize("dtype,atol,rtol", DTYPE_TOLS)
@pytest.mark.parametrize("accumulate", [False, True])
def test_topk_decompress_matches_reference(provider, gen, dtype, atol, rtol, accumulate):
    n, k = 4097, 300
    values = rand(k, dtype, gen)
    idx = torch.randperm(n, generator=gen)[:k].to(torch.int32).to(DEVICE)
    base = rand(n, dtype, gen)
    out = base.clone() if accumulate else poison((n,), dtype)
    got = K.topk_decompress(values, idx, n, out=out, accumulate=accumulate, alpha=0.5, provider=provider)
    ref = K.topk_decompress_ref(values, idx, n, out=base.clone() if accumulate else None, accumulate=accumulate,
                                alpha=0.5)  # fmt: skip
    assert got is out
    close(got, ref, atol, rtol)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("per_rank", [1, 5, 200])
def test_topk_decompress_sums_repeated_indices(provider, gen, out_dtype, per_rank):
    """Concatenated payloads of several ranks: repeated indices add up (atomics, or an fp32 copy)."""
    n = 999
    idx = torch.cat([torch.randperm(n, generator=gen)[:per_rank] for _ in range(3)]).to(torch.int32).to(DEVICE)
    values = rand(3 * per_rank, torch.float32, gen)
    out = torch.zeros(n, dtype=out_dtype, device=DEVICE)
    K.topk_decompress(values, idx, n, out=out, accumulate=True, provider=provider)
    ref = torch.zeros(n, device=DEVICE).index_add_(0, idx.long(), values)
    close(
        out,
        ref.to(out_dtype),
        1e-5 if out_dtype == torch.float32 else 8e-3,
        1e-5 if out_dtype == torch.float32 else 8e-3,
    )


def test_topk_decompress_rejects_out_of_range_indices(provider):
    out = torch.full((10,), 7.0, device=DEVICE)
    with pytest.raises(ShapeError, match="outside"):
        K.topk_decompress(torch.ones(2, device=DEVICE), torch.tensor([3, 10], device=DEVICE), 10, out=out,
                          provider=provider)  # fmt: skip
    assert bool((out == 7.0).all()), "nothing written"


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
        v, i = K.topk_compress(x, ratio=ratio, residual=r, provider="torch")
        sent.index_add_(0, i.long(), v.double())
    torch.testing.assert_close(sent + r.double(), total, atol=1e-5 * steps, rtol=1e-6)


# ---------------------------------------------------------------------------------------- non-finite


@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_topk_nonfinite_inputs_are_reported_and_change_nothing(provider, gen, bad):
    n = 2001
    x = rand(n, torch.float32, gen)
    x[1234] = bad
    r = rand(n, torch.float32, gen)
    keep = r.clone()
    for exact in (False, True):
        with pytest.raises(NonFiniteError, match="non-finite"):
            K.topk_compress(x, ratio=0.01, residual=r, exact=exact, provider=provider)
        assert torch.equal(r, keep)


# -------------------------------------------------------------------------------------------- errors


def test_topk_typed_errors():
    x = torch.randn(100, device=DEVICE)
    with pytest.raises(DTypeError):
        K.topk_compress(torch.arange(10, device=DEVICE), ratio=0.1)
    with pytest.raises(ArgumentTypeError):
        K.topk_compress([1.0, 2.0], ratio=0.1)
    for ratio in (0, 1.5, -0.1, float("nan")):
        with pytest.raises(InvalidArgumentError):
            K.topk_compress(x, ratio=ratio)
    with pytest.raises(ArgumentTypeError):
        K.topk_compress(x, ratio="0.1")
    with pytest.raises(ShapeError):
        K.topk_compress(x, ratio=0.1, residual=torch.zeros(99, device=DEVICE))
    with pytest.raises(ShapeError):
        K.topk_compress(x, ratio=0.1, residual=x)  # overlaps x
    with pytest.raises(ShapeError):
        K.topk_compress(torch.empty(0, device=DEVICE), ratio=0.1)
    with pytest.raises(DTypeError):
        K.topk_decompress(x[:3], torch.tensor([0.0, 1.0, 2.0], device=DEVICE), 100)
    with pytest.raises(ShapeError):
        K.topk_decompress(x[:3], torch.tensor([0, 1], device=DEVICE), 100)
    if DEVICE.type == "cuda":
        with pytest.raises(DeviceMismatchError):
            K.topk_compress(x, ratio=0.1, residual=torch.zeros(100))


def test_topk_custom_op_passes_opcheck():
    x = torch.randn(300)
    r = torch.randn(300)
    torch.library.opcheck(api._topk_op, (x, r, 5, False, True, "torch"))


def test_decompress_refuses_a_size_no_device_holds_before_allocating(provider):
    """numel=10**12 tried to allocate 4 TB (a bare RuntimeError, or the machine's memory): the indices are
    checked first, then the size against the device's memory; accumulate=True without out= is refused (it
    added to uninitialised memory)."""
    v, i = torch.ones(3, device=DEVICE), torch.tensor([0, 5, 9], device=DEVICE)
    for numel in (10**12, 2**62):
        with pytest.raises(InvalidArgumentError, match="memory"):
            K.topk_decompress(v, i, numel, provider=provider)
    with pytest.raises(ShapeError, match="index 9 is outside"):
        K.topk_decompress(v, i, 9, provider=provider)
    with pytest.raises(InvalidArgumentError, match="accumulate=True needs out="):
        K.topk_decompress(v, i, 10, accumulate=True, provider=provider)
    meta = K.topk_decompress(v.to("meta"), i.to("meta"), 10, provider=provider)
    assert meta.is_meta and meta.shape == (10,)
