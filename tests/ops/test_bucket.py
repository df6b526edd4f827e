"""flatten / unflatten / bucket_reduce / wire_cast: every provider against the torch reference."""

from __future__ import annotations

import math
import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import torsh_kernels as tk
from tests.helpers import DEVICE, DTYPE_TOLS, poison, rand
from torsh_kernels.errors import ArgumentTypeError, DTypeError, InvalidArgumentError, NonFiniteError, ShapeError
from torsh_kernels.ops import common
from torsh_kernels.ops.bucket import BucketLayout, bucket_reduce_ref, flatten_ref, unflatten_ref, wire_cast_ref
from torsh_kernels.ops.bucket import tables as bucket_tables

COUNTS = (1, 3, 130, pytest.param(600, marks=pytest.mark.slow))  # 600 tensors: tens of seconds interpreted


def make_tensors(count: int, dtype: torch.dtype, gen: torch.Generator) -> list[torch.Tensor]:
    """``count`` tensors of mixed shapes: 4097 elements, empty, one element, 0-d, and views that are not
    contiguous (transposed, strided, permuted, and one whose strides need five dimensions)."""
    r = lambda *shape: rand(shape, dtype, gen)
    special = [
        lambda: r(4097),
        lambda: r(0),
        lambda: r(17, 241).t(),  # 4097 elements, transposed
        lambda: r(1),
        lambda: r(4, 5, 6)[:, ::2, 1:],  # three dimensions after coalescing
        lambda: r(3, 4, 5, 6)[:, ::2, :, ::2].permute(3, 1, 0, 2),  # four dimensions after coalescing
        lambda: r(6, 9)[:, 1::2],
        lambda: r(3, 4, 5).permute(2, 0, 1),
        lambda: r(2, 3, 4, 5, 6)[:, ::2, :, 1:, ::3].transpose(0, 4),
        lambda: r(),
        lambda: r(3, 0, 2),
    ]
    out = [special[i]() for i in range(min(count, len(special)))]
    sizes = torch.randint(1, 40, (max(0, count - len(out)),), generator=gen).tolist()
    for i, n in enumerate(sizes):
        if i % 5 == 0:  # every fifth one a strided view
            out.append(r(n, 2)[:, 1])
        else:
            out.append(r(n))
    return out


def test_test_tensors_cover_every_kernel_path(gen):
    """The tensors of make_tensors reach the contiguous path, the strided path with 2, 3 and 4 coalesced
    dimensions, and the contiguous-copy fallback (5 dimensions)."""
    dims = set()
    for t in make_tensors(13, torch.float32, gen):
        g = bucket_tables._geometry(t)
        dims.add("fallback" if g is None else ("contiguous" if g[0] else sum(1 for s in g[1] if s > 1)))
    assert {"contiguous", 2, 3, 4, "fallback"} <= dims, dims


def like(t: torch.Tensor, gen: torch.Generator, dtype: torch.dtype | None = None) -> torch.Tensor:
    """New storage, same shape and strides as ``t`` (so non-contiguous stays non-contiguous), fresh data."""
    dtype = dtype or t.dtype
    out = torch.empty_strided(t.shape, t.stride(), dtype=dtype, device=t.device)
    return out.copy_(rand(t.shape, dtype, gen))


def assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float) -> None:
    assert actual.dtype == expected.dtype
    assert actual.shape == expected.shape
    assert not torch.isnan(actual).any(), "an output element was not written (still NaN)"
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)


# ---------------------------------------------------------------------------------------------- flatten


@pytest.mark.parametrize("count", COUNTS)
@pytest.mark.parametrize(("dtype", "atol", "rtol"), DTYPE_TOLS)
def test_flatten_matches_reference(provider, dtype, atol, rtol, count, gen):
    tensors = make_tensors(count, dtype, gen)
    total = sum(t.numel() for t in tensors)
    out = poison((total,), dtype)
    flat, layout = tk.flatten(tensors, out=out, provider=provider)
    assert flat.data_ptr() == out.data_ptr()
    assert_close(flat, flatten_ref(tensors, dtype), atol, rtol)
    assert layout.total == total and len(layout) == count
    assert layout.shapes == tuple(tuple(t.shape) for t in tensors)


@pytest.mark.parametrize("count", (3, 130))
@pytest.mark.parametrize(("dtype", "atol", "rtol"), DTYPE_TOLS)
def test_flatten_scales_and_casts_in_one_pass(provider, dtype, atol, rtol, count, gen):
    tensors = make_tensors(count, torch.float32, gen)  # fp32 gradients to a wire dtype
    scale = 1.0 / 3.0
    flat, layout = tk.flatten(tensors, scale=scale, dtype=dtype, provider=provider)
    assert layout.dtype == dtype and layout.dtypes == (torch.float32,) * count
    assert_close(flat, flatten_ref(tensors, dtype, scale), atol, rtol)


def test_flatten_mixed_input_dtypes_promote(provider, gen):
    tensors = [rand((33,), torch.bfloat16, gen), rand((4, 5), torch.float32, gen), rand((7,), torch.float16, gen)]
    flat, layout = tk.flatten(tensors, scale=2.0, provider=provider)
    assert layout.dtype == torch.float32
    assert_close(flat, flatten_ref(tensors, torch.float32, 2.0), 1e-6, 1e-6)


def test_flatten_float64(provider, gen):
    tensors = [rand((4097,), torch.float64, gen), rand((9, 5), torch.float64, gen).t()]
    scale = 1.0 / 3.0
    flat, _ = tk.flatten(tensors, scale=scale, provider=provider)
    # fp64 compute with the exact (not fp32-rounded) scale
    assert_close(flat, flatten_ref(tensors, torch.float64, scale), 1e-15, 1e-15)


# -------------------------------------------------------------------------------------------- unflatten


@pytest.mark.parametrize("accumulate", [False, True], ids=["write", "accumulate"])
@pytest.mark.parametrize("count", COUNTS)
@pytest.mark.parametrize(("dtype", "atol", "rtol"), DTYPE_TOLS)
def test_unflatten_matches_reference(provider, dtype, atol, rtol, count, accumulate, gen):
    shapes_from = make_tensors(count, dtype, gen)
    layout = BucketLayout.for_tensors(shapes_from, torch.float32)
    flat = rand((layout.total,), torch.float32, gen)  # e.g. an fp32 all-reduced bucket
    # Destinations keep the non-contiguous strides of make_tensors; poisoned unless accumulating.
    dests = [like(t, gen) for t in shapes_from]
    if not accumulate:
        for d in dests:
            d.fill_(float("nan"))
    expected = [d.clone() for d in dests]
    scale = 0.25 if accumulate else 1.0 / 3.0
    unflatten_ref(flat, layout, expected, scale=scale, accumulate=accumulate)
    tk.unflatten(flat, layout, dests, scale=scale, accumulate=accumulate, provider=provider)
    for d, e in zip(dests, expected):
        assert_close(d, e, atol, rtol)


@pytest.mark.parametrize("count", (3, 130))
@pytest.mark.parametrize(("dtype", "atol", "rtol"), DTYPE_TOLS)
def test_flatten_unflatten_roundtrip_is_exact(provider, dtype, atol, rtol, count, gen):
    tensors = make_tensors(count, dtype, gen)
    flat, layout = tk.flatten(tensors, provider=provider)
    dests = [torch.full_like(t, float("nan")) for t in tensors]
    tk.unflatten(flat, layout, dests, provider=provider)
    for d, t in zip(dests, tensors):
        assert torch.equal(d, t)


def test_unflatten_into_mixed_dtypes(provider, gen):
    dests = [poison((5, 3), torch.bfloat16), poison((4097,), torch.float32), poison((2, 2), torch.float16)]
    layout = BucketLayout.for_tensors(dests, torch.float32)
    flat = rand((layout.total,), torch.float32, gen)
    expected = [d.clone() for d in dests]
    unflatten_ref(flat, layout, expected, scale=0.5)
    tk.unflatten(flat, layout, dests, scale=0.5, provider=provider)
    for d, e, (_, atol, rtol) in zip(dests, expected, [(0, 8e-3, 8e-3), (0, 1e-6, 1e-6), (0, 1e-3, 1e-3)]):
        assert_close(d, e, atol, rtol)


def test_unflatten_into_bucket_views_in_place(provider, gen):
    """DDP's gradient_as_bucket_view: the tensors are the flat buffer's own slices."""
    flat = rand((4097 + 30,), torch.float32, gen)
    layout = BucketLayout.for_tensors([torch.empty(4097), torch.empty(5, 6)])
    views = layout.views(flat)
    before = flat.clone()
    tk.unflatten(flat, layout, views, scale=0.5, provider=provider)
    torch.testing.assert_close(flat, before * 0.5, atol=0, rtol=0)


# ----------------------------------------------- aligned segments, one-side-aligned segments, the gather


def mixed_bucket(dtype: torch.dtype, gen: torch.Generator) -> list[torch.Tensor]:
    """Tensors that reach every Triton copy variant: sizes that keep both sides 16-byte aligned (aligned
    segments), odd sizes that move every later flat offset off the 16-byte grid (segments aligned on one side,
    heads and tails), a tensor at an address off the grid, strided views, and sizes 1, 3, 17, 4097."""
    r = lambda *shape: rand(shape, dtype, gen)
    return [
        r(1024),
        r(3),  # every later flat offset is now 3 elements off
        r(4097),  # a segment aligned on one side, its head and tail gathered
        r(1),
        r(17),
        r(4098)[1:],  # its address 1 element off the grid
        r(600),
        r(41, 29).t(),  # strided: 2 dimensions
        r(2048),
        r(6, 700)[:, 3:],  # strided rows
        r(5, 8, 30)[::2, ::2, 1:],  # strided: 3 dimensions
    ]


def test_copy_plan_covers_every_element_once_in_three_variants(gen):
    from torsh_kernels.ops.bucket.tables import N_SHIFT, copy_plan

    tensors = [t.cpu() for t in mixed_bucket(torch.float32, gen)]
    offsets = BucketLayout.for_tensors(tensors).offsets
    flat = torch.empty(sum(t.numel() for t in tensors))
    plan = copy_plan(tensors, offsets, flat, True, True, 2048, 512)
    assert [(ln.kernel, ln.meta.get("ALIGN_TENSOR"), ln.meta.get("ALIGN_FLAT")) for ln in plan] == [
        ("segments", 16, 16), ("segments", 16, 4), ("gather", None, None)]  # fmt: skip
    assert plan[2].meta["NDIM"] == 3 and not plan[2].meta["IDX64"]
    covered = 0
    for ln in plan[:2]:
        addr, packed = ln.rows[:, 0], ln.rows[:, 1]
        count = packed >> N_SHIFT
        assert ((count % 16 == 0) & (count > 0) & (count <= 2048)).all() and ln.n_tiles == len(ln.rows)
        assert (addr % 16 == 0).all()  # the tensor side, aligned in both variants (prefer_tensor)
        flat_addr = (packed & ((1 << N_SHIFT) - 1)) * 4 + flat.data_ptr()
        assert (flat_addr % ln.meta["ALIGN_FLAT"] == 0).all()
        assert (flat_addr % 16 == 0).all() if ln.meta["ALIGN_FLAT"] == 16 else not (flat_addr % 16 == 0).any()
        covered += int(count.sum())
    covered += int(plan[2].rows[:, 2].sum())
    assert covered == flat.numel()
    assert copy_plan(tensors, offsets, flat, True, True, 2048, 512) is plan  # cached
    # the rows hold flat offsets: another buffer at the same address modulo 16 reuses the plan
    assert copy_plan(tensors, offsets, torch.empty_like(flat), True, True, 2048, 512) is plan


_F32, _F16, _BF16, _F64 = torch.float32, torch.float16, torch.bfloat16, torch.float64
# (tensors' dtype, flat dtype, tolerance): the same dtype, narrowing, widening, fp64 compute
_MIXED_PAIRS = [
    pytest.param(_F32, _F32, 1e-6, id="fp32->fp32"),
    pytest.param(_F32, _BF16, 8e-3, id="fp32->bf16"),
    pytest.param(_F16, _F32, 1e-3, id="fp16->fp32"),
    pytest.param(_BF16, _F64, 8e-3, id="bf16->fp64"),
]


@pytest.mark.parametrize(("dtype", "flat_dtype", "tol"), _MIXED_PAIRS)
def test_flatten_mixed_alignments_and_layouts(provider, dtype, flat_dtype, tol, gen):
    tensors = mixed_bucket(dtype, gen)
    total = sum(t.numel() for t in tensors)
    buf = poison((total + 1,), flat_dtype)
    for out in (buf[:total], buf[1:]):  # a flat buffer on the 16-byte grid, and one off it
        out.fill_(float("nan"))
        flat, _ = tk.flatten(tensors, out=out, scale=0.75, provider=provider)
        assert_close(flat, flatten_ref(tensors, flat_dtype, 0.75), tol, tol)


@pytest.mark.parametrize("accumulate", [False, True], ids=["write", "accumulate"])
@pytest.mark.parametrize(("dtype", "flat_dtype", "tol"), _MIXED_PAIRS)
def test_unflatten_mixed_alignments_and_layouts(provider, dtype, flat_dtype, tol, accumulate, gen):
    shapes_from = mixed_bucket(dtype, gen)
    layout = BucketLayout.for_tensors(shapes_from, flat_dtype)
    buf = rand((layout.total + 1,), flat_dtype, gen)
    for flat in (buf[: layout.total], buf[1:]):
        dests = [like(t, gen) for t in shapes_from]
        dests[5] = rand((dests[5].numel() + 1,), dtype, gen)[1:]  # off the grid, as its source was
        if not accumulate:
            for d in dests:
                d.fill_(float("nan"))
        expected = [d.clone() for d in dests]
        unflatten_ref(flat, layout, expected, scale=0.5, accumulate=accumulate)
        tk.unflatten(flat, layout, dests, scale=0.5, accumulate=accumulate, provider=provider)
        for d, e in zip(dests, expected):
            assert_close(d, e, tol, tol)


def test_triton_gather_with_64_bit_index_math(gen, monkeypatch):
    """The IDX64 gather (extents of 2**31 elements or more), on small tensors: the threshold lowered."""
    from collections import OrderedDict

    monkeypatch.setattr(bucket_tables, "_I32", 0)
    monkeypatch.setattr(common, "_TABLES", OrderedDict())  # no plan built with the real threshold
    tensors = mixed_bucket(torch.float32, gen)
    layout = BucketLayout.for_tensors(tensors)
    plan = bucket_tables.copy_plan(tensors, layout.offsets, torch.empty(layout.total, device=DEVICE), True, True,
                                    2048, 512)  # fmt: skip
    assert plan[-1].kernel == "gather" and plan[-1].meta["IDX64"] and plan[-1].meta["BLOCK"] == 128
    flat, _ = tk.flatten(tensors, out=poison((layout.total,), torch.float32), provider="triton")
    assert_close(flat, flatten_ref(tensors, torch.float32), 0, 0)
    dests = [like(t, gen) for t in tensors]
    expected = [d.clone() for d in dests]
    unflatten_ref(flat, layout, expected, scale=0.5, accumulate=True)
    tk.unflatten(flat, layout, dests, scale=0.5, accumulate=True, provider="triton")
    for d, e in zip(dests, expected):
        assert_close(d, e, 1e-6, 1e-6)


def test_mixed_alignments_roundtrip_is_exact(provider, gen):
    tensors = mixed_bucket(torch.float32, gen)
    flat, layout = tk.flatten(tensors, provider=provider)
    dests = [torch.full_like(t, float("nan")) for t in tensors]
    tk.unflatten(flat, layout, dests, provider=provider)
    for d, t in zip(dests, tensors):
        assert torch.equal(d, t)


# ---------------------------------------------------------------------------------------- bucket_reduce


@pytest.mark.parametrize("k", [1, 3, 8])
@pytest.mark.parametrize("op", ["sum", "avg", "max"])
@pytest.mark.parametrize(("dtype", "atol", "rtol"), DTYPE_TOLS)
def test_bucket_reduce_matches_reference(provider, dtype, atol, rtol, op, k, gen):
    buffers = [rand((4097,), dtype, gen) for _ in range(k)]
    out = poison((4097,), dtype)
    res = tk.bucket_reduce(buffers, op=op, out=out, provider=provider)
    assert res is out
    assert_close(out, bucket_reduce_ref(buffers, op, dtype), atol, rtol)


@pytest.mark.parametrize("op", ["sum", "avg", "max"])
def test_bucket_reduce_stacked_non_contiguous_rows(provider, op, gen):
    # K=5 rows of a [5, 41, 3] tensor, each row a non-contiguous [41, 3] view (a transposed storage)
    stacked = rand((5, 3, 41), torch.float32, gen).transpose(1, 2)
    res = tk.bucket_reduce(stacked, op=op, provider=provider)
    assert res.shape == (41, 3)
    assert_close(res, bucket_reduce_ref(list(stacked.unbind(0)), op, torch.float32), 1e-6, 1e-6)


def test_bucket_reduce_bf16_buffers_into_fp32_out(provider, gen):
    buffers = [rand((999,), torch.bfloat16, gen) for _ in range(4)]
    out = poison((999,), torch.float32)
    tk.bucket_reduce(buffers, op="sum", out=out, provider=provider)
    assert_close(out, bucket_reduce_ref(buffers, "sum", torch.float32), 1e-6, 1e-6)


def test_bucket_reduce_in_place_into_first_buffer(provider, gen):
    buffers = [rand((4097,), torch.float32, gen) for _ in range(3)]
    expected = bucket_reduce_ref(buffers, "avg", torch.float32)
    tk.bucket_reduce(buffers, op="avg", out=buffers[0], provider=provider)
    assert_close(buffers[0], expected, 1e-6, 1e-6)


@pytest.mark.parametrize("k", [1, 2, 5])
@pytest.mark.parametrize("n", [1, 3, 17, 4097])
@pytest.mark.parametrize("op", ["sum", "avg", "max"])
def test_bucket_reduce_unaligned_buffers_and_odd_sizes(provider, op, n, k, gen):
    """Buffers off the 16-byte grid (the unaligned variant), odd K (the last pair half masked), sizes with and
    without a bulk."""
    buffers = [rand((n + 1,), torch.float32, gen)[1:] if i % 2 else rand((n,), torch.float32, gen) for i in range(k)]
    out = poison((n,), torch.float32)
    tk.bucket_reduce(buffers, op=op, out=out, provider=provider)
    assert_close(out, bucket_reduce_ref(buffers, op, torch.float32), 1e-6, 1e-6)


def test_bucket_reduce_keeps_negative_zero(provider):
    """The masked second buffer of an odd K adds -0.0: a sum of -0.0s stays -0.0, bit for bit."""
    buffers = [torch.full((33,), -0.0, device=DEVICE) for _ in range(3)]
    res = tk.bucket_reduce(buffers, op="sum", provider=provider)
    assert torch.equal(res.cpu().view(torch.int32), torch.full((33,), -0.0).view(torch.int32))


def test_bucket_reduce_max_propagates_nan(provider, gen):
    a, b = rand((37,), torch.float32, gen), rand((37,), torch.float32, gen)
    a[3] = float("nan")
    b[10] = float("nan")
    res = tk.bucket_reduce([a, b], op="max", provider=provider)
    assert torch.isnan(res[3]) and torch.isnan(res[10])
    mask = torch.ones(37, dtype=torch.bool)
    mask[[3, 10]] = False
    torch.testing.assert_close(res[mask], torch.maximum(a, b)[mask], atol=0, rtol=0)


def test_bucket_reduce_float64(provider, gen):
    buffers = [rand((1001,), torch.float64, gen) for _ in range(3)]
    res = tk.bucket_reduce(buffers, op="avg", provider=provider)
    assert_close(res, bucket_reduce_ref(buffers, "avg", torch.float64), 1e-15, 1e-15)


def rounding_probe() -> torch.Tensor:
    """fp32 values whose conversion to bf16 / fp16 depends on the rounding mode: exact ties (to even,
    up and down), just above and below half an ulp, overflow, subnormals, signed zeros, inf and NaN."""
    vals = []
    for e in (-20, -3, 0, 5, 14):
        base = 2.0**e
        for frac in (2**-8, 2**-8 + 2**-9, 2**-8 + 2**-20, 2**-9 + 2**-20, 3 * 2**-8, 2**-11, 2**-11 + 2**-20,
                     3 * 2**-11, 2**-12):  # fmt: skip
            vals += [base * (1 + frac), -base * (1 + frac)]
    vals += [3.4e38, 65519.0, 65520.0, 1e-40, -1e-40, 6e-8, 1e-45, 0.0, -0.0, math.inf, -math.inf, math.nan]
    return torch.tensor(vals, dtype=torch.float32, device=DEVICE)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # 3.4e38 -> fp16 inf, on purpose
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_casts_round_to_nearest_even(provider, dtype):
    """Bit for bit: every provider converts as PyTorch does (round to nearest, ties to even)."""
    x = rounding_probe()
    expected = x.to(dtype)
    nan = torch.isnan(x)

    def same_bits(actual: torch.Tensor) -> None:
        # NaN payloads differ between PyTorch's own CPU and CUDA conversions; a NaN must stay a NaN.
        assert torch.isnan(actual[nan]).all()
        assert torch.equal(actual[~nan].view(torch.int16), expected[~nan].view(torch.int16))

    flat, _ = tk.flatten([x[:40], x[40:]], dtype=dtype, provider=provider)
    same_bits(flat)
    dests = [poison((x.numel(),), dtype)]
    tk.unflatten(x, BucketLayout.for_tensors(dests), dests, provider=provider)
    same_bits(dests[0])
    out = poison((x.numel(),), dtype)
    tk.bucket_reduce([x], op="sum", out=out, provider=provider)
    same_bits(out)


# ---------------------------------------------------------------------------- one launch, many tensors


class _LaunchCounter:
    """Counts kernel launches through a Triton kernel's ``kernel[grid](...)``."""

    def __init__(self, kernel) -> None:
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


def _count_copy_launches(monkeypatch) -> list[str]:
    """Patches the Triton copy kernels; the returned list gets one entry per launch (the kernel's name)."""
    from torsh_kernels.ops.bucket import triton as bucket_triton

    launches: list[str] = []
    for name in ("_segment_kernel", "_gather_kernel"):
        monkeypatch.setattr(bucket_triton, name, _NamedCounter(getattr(bucket_triton, name), name, launches))
    return launches


class _NamedCounter:
    """Records each launch of a Triton kernel (its name) in a shared list."""

    def __init__(self, kernel, name: str, sink: list[str]) -> None:
        self.kernel, self.name, self.sink = kernel, name, sink

    def __getitem__(self, grid):
        self.sink.append(self.name)
        return self.kernel[grid]


@pytest.mark.parametrize("count", [1, 3, 130, pytest.param(600, marks=pytest.mark.slow)])
def test_triton_launch_count_does_not_grow_with_tensor_count(count, gen, monkeypatch):
    """At most three launches per dtype group (aligned segments, one-side-aligned segments, the gather of
    strided tensors and unaligned pieces), whatever the number of tensors."""
    launches = _count_copy_launches(monkeypatch)
    tensors = make_tensors(count, torch.float32, gen)
    flat, layout = tk.flatten(tensors, provider="triton")
    n_flatten = len(launches)
    tk.unflatten(flat, layout, tensors, accumulate=True, provider="triton")
    assert 1 <= n_flatten <= 3 and 1 <= len(launches) - n_flatten <= 3


def test_triton_at_most_three_launches_per_dtype(gen, monkeypatch):
    tensors = [rand((n,), torch.float32 if i % 2 else torch.bfloat16, gen) for i, n in enumerate(range(1, 520))]
    tensors += [rand((1000 + n,), torch.float32 if n % 2 else torch.bfloat16, gen) for n in range(8)]
    launches = _count_copy_launches(monkeypatch)
    flat, _ = tk.flatten(tensors, provider="triton")
    assert 2 <= len(launches) <= 6
    assert_close(flat, flatten_ref(tensors, torch.float32), 1e-6, 1e-6)


def test_numba_launch_count_does_not_grow_with_tensor_count(gen, monkeypatch):
    from torsh_kernels.ops import numba_common

    launches = []
    real = numba_common.launch
    monkeypatch.setattr(numba_common, "launch", lambda *a: (launches.append(a[0]), real(*a)))
    tensors = make_tensors(600, torch.float32, gen)
    flat, layout = tk.flatten(tensors, provider="numba")
    tk.unflatten(flat, layout, tensors, provider="numba")
    tk.bucket_reduce([flat, flat, flat], provider="numba")
    assert len(launches) == 3


@pytest.mark.parametrize(("n", "launches"), [(4096, 1), (5000, 2), (7, 1)])
def test_triton_bucket_reduce_bulk_and_tail_launches(n, launches, gen, monkeypatch):
    """One launch for the bulk (a multiple of 16 elements), one for the tail, only when there is one."""
    from torsh_kernels.ops.bucket import triton as bucket_triton

    counter = _LaunchCounter(bucket_triton._bucket_reduce_kernel)
    monkeypatch.setattr(bucket_triton, "_bucket_reduce_kernel", counter)
    buffers = [rand((n,), torch.float32, gen) for _ in range(7)]
    res = tk.bucket_reduce(buffers, provider="triton")
    assert counter.launches == launches
    assert_close(res, bucket_reduce_ref(buffers, "sum", torch.float32), 1e-6, 1e-6)


# ------------------------------------------------------------------------------ reuse across steps


def test_tables_are_rebuilt_for_new_tensors_and_reread_for_new_data(provider, gen):
    """Cached launch tables must never serve stale addresses: new tensors of the same shapes, and
    old tensors with new contents, both give correct results."""
    a = make_tensors(130, torch.float32, gen)
    flat_a, layout = tk.flatten(a, provider=provider)
    b = [like(t, gen) for t in a]  # same shapes and strides, new storage and data
    flat_b, layout_b = tk.flatten(b, provider=provider)
    assert layout_b == layout
    assert_close(flat_b, flatten_ref(b, torch.float32), 0, 0)
    for t in a:
        t.mul_(-2.0)
    flat_a2, _ = tk.flatten(a, out=torch.empty_like(flat_a), provider=provider)
    assert_close(flat_a2, flatten_ref(a, torch.float32), 0, 0)
    assert_close(flat_a2, flat_a * -2.0, 0, 0)


def test_layout_is_small_picklable_and_reusable(gen):
    tensors = make_tensors(130, torch.bfloat16, gen)
    flat, layout = tk.flatten(tensors)
    restored = pickle.loads(pickle.dumps(layout))
    assert restored == layout
    assert len(pickle.dumps(layout)) < 8192
    views = restored.views(flat)
    for v, t in zip(views, tensors):
        assert v.shape == t.shape and torch.equal(v, t)
    assert layout.nbytes == layout.total * 2
    assert layout.offsets[1] == tensors[0].numel()


def test_layout_rejects_inconsistent_fields():
    with pytest.raises(tk.InvalidArgumentError, match="running sum"):
        BucketLayout(((2,), (3,)), (torch.float32,) * 2, (0, 1), 5, torch.float32)
    with pytest.raises(tk.InvalidArgumentError, match="add up to 5"):
        BucketLayout(((2,), (3,)), (torch.float32,) * 2, (0, 2), 6, torch.float32)
    with pytest.raises(tk.InvalidArgumentError, match="one dtype and one offset"):
        BucketLayout(((2,),), (), (0,), 2, torch.float32)


# ------------------------------------------------------------------------------------------ bad input


def test_rejects_integer_tensors(provider):
    with pytest.raises(tk.DTypeError, match=r"tensors\[1\] has dtype torch.int64"):
        tk.flatten([torch.ones(3), torch.ones(3, dtype=torch.int64)], provider=provider)
    with pytest.raises(TypeError):  # also a TypeError for callers who catch the built-in
        tk.bucket_reduce([torch.ones(3, dtype=torch.int32)] * 2, provider=provider)
    layout = BucketLayout.for_tensors([torch.ones(3)])
    with pytest.raises(tk.DTypeError, match=r"flat has dtype torch\.int32"):
        tk.unflatten(torch.ones(3, dtype=torch.int32), layout, [torch.ones(3)])
    with pytest.raises(tk.DTypeError, match="not a floating-point dtype"):
        tk.flatten([torch.ones(3)], dtype=torch.int8)


def test_rejects_mixed_devices():
    cpu, meta = torch.ones(3), torch.ones(3, device="meta")
    with pytest.raises(tk.DeviceMismatchError, match=r"tensors\[1\] is on meta"):
        tk.flatten([cpu, meta])
    with pytest.raises(tk.DeviceMismatchError):
        tk.bucket_reduce([cpu, meta])
    layout = BucketLayout.for_tensors([cpu])
    with pytest.raises(tk.DeviceMismatchError, match="flat is on cpu"):
        tk.unflatten(cpu, layout, [meta])
    with pytest.raises(tk.DeviceMismatchError, match="out is on meta"):
        tk.flatten([cpu], out=torch.empty(3, device="meta"))


def test_rejects_mismatched_layout():
    tensors = [torch.ones(3, 4), torch.ones(5)]
    flat, layout = tk.flatten(tensors)
    with pytest.raises(tk.LayoutMismatchError, match="describes 2 tensors, got 1"):
        tk.unflatten(flat, layout, [torch.ones(3, 4)])
    with pytest.raises(tk.LayoutMismatchError, match=r"tensors\[0\] has shape \(4, 3\), the layout says \(3, 4\)"):
        tk.unflatten(flat, layout, [torch.ones(4, 3), torch.ones(5)])
    with pytest.raises(tk.LayoutMismatchError, match="flat has 16 elements but the layout describes 17"):
        tk.unflatten(torch.ones(16), layout, tensors)
    with pytest.raises(tk.ArgumentTypeError, match="layout must be a BucketLayout"):
        tk.unflatten(flat, [(3, 4), (5,)], tensors)
    assert isinstance(tk.LayoutMismatchError("x"), ValueError)


def test_rejects_wrong_out():
    tensors = [torch.ones(3, 4), torch.ones(5)]
    with pytest.raises(tk.ShapeError, match="out has 16 elements but the tensors hold 17"):
        tk.flatten(tensors, out=torch.empty(16))
    with pytest.raises(tk.ShapeError, match="contiguous"):
        tk.flatten(tensors, out=torch.empty(34)[::2])
    with pytest.raises(tk.InvalidArgumentError, match=r"disagrees with out\.dtype"):
        tk.flatten(tensors, out=torch.empty(17), dtype=torch.float16)
    with pytest.raises(tk.ShapeError, match="overlaps"):
        big = torch.ones(40)
        tk.flatten([big[:10], big[10:17]], out=big[5:22])
    with pytest.raises(tk.ShapeError, match=r"out has shape \(4\,\), the buffers \(5\,\)"):
        tk.bucket_reduce([torch.ones(5)] * 2, out=torch.empty(4))
    with pytest.raises(tk.ShapeError, match="overlaps"):
        buf = torch.ones(10)
        tk.bucket_reduce([buf[:5], torch.ones(5)], out=buf[2:7])


def test_rejects_bad_arguments():
    with pytest.raises(tk.ArgumentTypeError, match="list or tuple of tensors, got Tensor"):
        tk.flatten(torch.ones(3))
    with pytest.raises(tk.InvalidArgumentError, match="empty"):
        tk.flatten([])
    with pytest.raises(tk.ArgumentTypeError, match=r"tensors\[1\] is a list"):
        tk.flatten([torch.ones(2), [1.0]])
    with pytest.raises(tk.InvalidArgumentError, match="scale must be finite"):
        tk.flatten([torch.ones(2)], scale=math.inf)
    with pytest.raises(tk.ArgumentTypeError, match="scale must be a real number"):
        tk.flatten([torch.ones(2)], scale=torch.tensor(2.0))
    with pytest.raises(tk.InvalidArgumentError, match="op='mean'"):
        tk.bucket_reduce([torch.ones(2)], op="mean")
    with pytest.raises(tk.ShapeError, match=r"buffers\[1\] has shape \(3,\)"):
        tk.bucket_reduce([torch.ones(2), torch.ones(3)])
    with pytest.raises(tk.DTypeError, match="reduce buffers of one dtype"):
        tk.bucket_reduce([torch.ones(2), torch.ones(2, dtype=torch.float16)])
    with pytest.raises(tk.ShapeError, match="expanded"):
        layout = BucketLayout.for_tensors([torch.ones(4, 3)])
        tk.unflatten(torch.ones(12), layout, [torch.ones(3).expand(4, 3)])
    with pytest.raises(tk.ShapeError, match=r"tensors\[0\] and tensors\[2\] share memory"):
        base = torch.ones(20)
        layout = BucketLayout.for_tensors([torch.ones(6), torch.ones(3), torch.ones(6)])
        tk.unflatten(torch.ones(15), layout, [base[:6], torch.ones(3), base[4:10]])
    with pytest.raises(tk.ShapeError, match=r"tensors\[0\] and tensors\[1\] share memory"):
        t = torch.ones(4)
        tk.unflatten(torch.ones(8), BucketLayout.for_tensors([t, t]), [t, t])
    # interleaved strided views of one storage share a byte range, not elements: allowed
    m = torch.zeros(5, 2)
    tk.unflatten(torch.arange(10.0), BucketLayout.for_tensors([m[:, 0], m[:, 1]]), [m[:, 0], m[:, 1]])
    assert torch.equal(m.t().reshape(-1), torch.arange(10.0))
    with pytest.raises(tk.ShapeError, match="overlaps flat"):
        flat = torch.ones(12)
        layout = BucketLayout.for_tensors([torch.ones(6), torch.ones(6)])
        tk.unflatten(flat, layout, [flat[1:7], torch.ones(6)])


def test_rejects_unknown_provider():
    with pytest.raises(tk.ProviderError, match="unknown provider 'cutlass'"):
        tk.flatten([torch.ones(3)], provider="cutlass")
    with pytest.raises(ValueError):
        tk.bucket_reduce([torch.ones(3)], provider="cuda")


def test_inputs_are_not_modified(provider, gen):
    tensors = make_tensors(130, torch.bfloat16, gen)
    before = [t.clone() for t in tensors]
    flat, _ = tk.flatten(tensors, scale=3.0, dtype=torch.float32, provider=provider)
    tk.bucket_reduce([flat, flat], provider=provider)
    for t, b in zip(tensors, before):
        assert torch.equal(t, b)


# ------------------------------------------------------------------------------------------- opcheck


@pytest.mark.parametrize("prov", ["torch", "triton", "numba", "cpu"])
def test_opcheck(prov, gen):
    tensors = [rand((5, 3), torch.float32, gen), rand((7,), torch.bfloat16, gen), rand((2, 2), torch.float32, gen)]
    flat = rand((15 + 7 + 4,), torch.float32, gen)
    dests = [poison(t.shape, t.dtype) for t in tensors]
    buffers = [rand((11,), torch.float32, gen) for _ in range(3)]
    ops = torch.ops.torsh
    cases = [
        (ops.flatten.default, (tensors, torch.bfloat16, 0.5, prov)),
        (ops.flatten_out.default, (tensors, poison((26,), torch.float32), 2.0, prov)),
        (ops.unflatten.default, (flat, dests, 0.5, False, prov)),
        (ops.unflatten.default, (flat, [rand(t.shape, t.dtype, gen) for t in tensors], 1.0, True, prov)),
        (ops.bucket_reduce.default, (buffers, "avg", prov)),
        (ops.bucket_reduce_out.default, (buffers, poison((11,), torch.float32), "max", prov)),
        (ops.wire_cast.default, (buffers[0], poison((11,), torch.float16), 3.0, True, prov)),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args)


def test_custom_ops_compose_with_torch_compile(gen):
    tensors = [rand((5, 3), torch.float32, gen), rand((7,), torch.float32, gen)]

    def step(a, b):
        flat = torch.ops.torsh.flatten(a_list := [a * 2, b], torch.float32, 0.5, "")
        out = torch.ops.torsh.bucket_reduce([flat, flat], "sum", "")
        return out, a_list

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    out, _ = compiled(*tensors)
    expected = flatten_ref([tensors[0] * 2, tensors[1]], torch.float32, 0.5) * 2
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-6)


@given(st.lists(st.tuples(st.integers(0, 60), st.integers(0, 12)), min_size=0, max_size=12))
@settings(max_examples=300, deadline=None)
def test_contiguous_clash_agrees_with_pairwise_check(spans):
    """Views (start, length) of one storage: the sort-based check finds a clash exactly when some pair
    of non-empty views overlaps, and any pair it names does overlap."""
    storage = torch.zeros(80)
    views = [storage[a : a + n] for a, n in spans]
    clash = common.Ranges.of(views).contiguous_clash() if views else None

    def overlap(i: int, j: int) -> bool:
        (a, n), (b, m) = spans[i], spans[j]
        return n > 0 and m > 0 and a < b + m and b < a + n

    pairs = [(i, j) for i in range(len(spans)) for j in range(i + 1, len(spans)) if overlap(i, j)]
    assert (clash is None) == (not pairs)
    if clash is not None:
        assert clash[0] < clash[1] and overlap(*clash)


# ------------------------------------------------------------------------------------------- wire_cast

# fp32 values at the edges of the wire formats: signed zeros, fp16 subnormals and their halfway points, the
# largest fp16 and the values that round to it or overflow, bf16's range, thirds (inexact quotients)
_EDGES = [0.0, -0.0, 1e-8, -1e-8, 5.96e-8, 2.98e-8, 2.99e-8, 6.1e-5, 6.09e-5, 65504.0, 65519.0, -65519.9, 1.0 / 3,
          2.0**-24, 3 * 2.0**-26, 1e30, -3e38, 1.5, 2.5, -0.5]  # fmt: skip


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


_OVERFLOW = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the emulators' fp16 casts


@_OVERFLOW
@pytest.mark.parametrize("wire", [torch.float16, torch.bfloat16, torch.float32], ids=["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("xdt", [torch.float32, torch.bfloat16, torch.float16], ids=["x32", "xbf16", "x16"])
@pytest.mark.parametrize("divisor", [1, 2.0, 3, 7.0])
@pytest.mark.parametrize("n", [1, 1000, 4097])
def test_wire_cast_matches_reference_bit_for_bit(provider, gen, wire, xdt, divisor, n):
    x = torch.cat([torch.tensor(_EDGES), rand(n, torch.float32, gen, torch.device("cpu")) * 300])[:n].to(xdt)
    x = x.to(DEVICE)
    out = poison((n,), wire)
    ref = wire_cast_ref(x.cpu(), wire, divisor)
    overflow = not bool(torch.isfinite(ref).all())  # an fp16 overflow (of the wire or of a 16-bit x)
    if overflow:
        with pytest.raises(NonFiniteError, match=f"{int((~torch.isfinite(ref)).sum())} non-finite"):
            tk.wire_cast(x, wire, divisor=divisor, out=out, provider=provider)
    got = tk.wire_cast(x, wire, divisor=divisor, out=out, check_finite=not overflow, provider=provider)
    assert got is out and got.dtype == wire
    assert torch.equal(_bits(got.cpu()), _bits(ref)), "the same bits as x.to(wire).div_(divisor)"


def test_wire_cast_is_pytorchs_fp16_compress_arithmetic(provider, gen):
    """What torch.distributed's fp16_compress_hook sends: ``buffer.to(float16).div_(world_size)``."""
    x = rand((3, 333), torch.float32, gen) * 1000
    for ws in (2, 3, 8):
        got = tk.wire_cast(x, divisor=ws, provider=provider)
        assert got.shape == (999,) and torch.equal(_bits(got), _bits(x.reshape(-1).to(torch.float16).div_(ws)))


@_OVERFLOW
def test_wire_cast_counts_nonfinite_values(provider):
    x = torch.tensor([1.0, float("nan"), 7e4, -7e4, float("inf"), 3.0], device=DEVICE)
    with pytest.raises(NonFiniteError, match="4 non-finite"):
        tk.wire_cast(x, provider=provider)  # NaN, inf, and two fp16 overflows
    with pytest.raises(NonFiniteError, match="2 non-finite"):
        tk.wire_cast(x, torch.bfloat16, provider=provider)  # bf16 holds 7e4: NaN and inf only
    out = tk.wire_cast(x, provider=provider, check_finite=False)
    assert out.float().isinf().sum() == 3 and out.float().isnan().sum() == 1


@_OVERFLOW
@pytest.mark.parametrize("n", [3, 17, 4096, 4097])
def test_wire_cast_bulk_and_tail_sizes_and_counts(provider, gen, n):
    """Sizes with only a tail, a bulk and a tail, only a bulk; non-finite values counted in both."""
    x = rand((n,), torch.float32, gen) * 100
    bad = [0, n - 1] + ([n // 2] if n > 16 else [])
    x[bad] = float("inf")
    ref = wire_cast_ref(x.cpu(), torch.float16, 3.0)
    with pytest.raises(NonFiniteError, match=f"{len(bad)} non-finite"):
        tk.wire_cast(x, torch.float16, divisor=3, out=poison((n,), torch.float16), provider=provider)
    got = tk.wire_cast(x, torch.float16, divisor=3, check_finite=False, provider=provider)
    assert torch.equal(_bits(got.cpu()), _bits(ref))


def test_wire_cast_in_place_and_typed_errors(provider, gen):
    x = rand(1000, torch.float32, gen)
    ref = wire_cast_ref(x, torch.float32, 3.0)
    assert tk.wire_cast(x, divisor=3, out=x, provider=provider) is x  # fp32 in place
    assert torch.equal(x, ref)
    y = torch.zeros(1000, device=DEVICE)
    with pytest.raises(ShapeError, match="overlaps"):
        tk.wire_cast(y, out=y.view(torch.float16)[:1000], provider=provider)
    with pytest.raises(ShapeError, match="elements"):
        tk.wire_cast(y, out=torch.empty(999, dtype=torch.float16, device=DEVICE), provider=provider)
    with pytest.raises(DTypeError, match="float16"):
        tk.wire_cast(y, torch.float16, out=torch.empty(1000, dtype=torch.bfloat16, device=DEVICE))
    with pytest.raises(DTypeError):
        tk.wire_cast(y, torch.float64)
    with pytest.raises(DTypeError):
        tk.wire_cast(y.long())
    with pytest.raises(InvalidArgumentError, match="divisor"):
        tk.wire_cast(y, divisor=0)
    with pytest.raises(InvalidArgumentError, match="divisor"):
        tk.wire_cast(y, divisor=float("inf"))
    with pytest.raises(ArgumentTypeError, match="divisor"):
        tk.wire_cast(y, divisor=True)
    with pytest.raises(ShapeError, match="contiguous"):
        tk.wire_cast(y, out=torch.empty(2000, dtype=torch.float16, device=DEVICE)[::2])
    assert tk.wire_cast(torch.empty(0, device=DEVICE)).numel() == 0


def test_a_layout_checks_its_fields_and_an_expanded_bucket_must_fit_in_memory():
    base = dict(shapes=((2,), (3,)), dtypes=(torch.float32,) * 2, offsets=(0, 2), total=5, dtype=torch.float32)
    for change, err in (
        (dict(shapes=((-2,), (3,)), offsets=(0, -2), total=1), InvalidArgumentError),
        (dict(shapes=[(2,), (3,)]), ArgumentTypeError),
        (dict(dtype=torch.int32), DTypeError),
        (dict(total=5.0), ArgumentTypeError),
    ):
        with pytest.raises(err):
            BucketLayout(**{**base, **change})
    huge = torch.zeros(1).expand(2**38)  # no memory behind it: flattening it would need 1 TiB
    with pytest.raises(InvalidArgumentError, match="memory"):
        tk.flatten([huge])
    with pytest.raises(InvalidArgumentError, match="memory"):
        tk.bucket_reduce([huge, huge])
    with pytest.raises(InvalidArgumentError, match="memory"):
        tk.wire_cast(huge)


@pytest.mark.parametrize("src", [torch.float16, torch.bfloat16])
def test_one_16bit_tensor_scaled_into_fp32_is_computed_in_fp32(provider, src):
    """Found by the fuzz: the torch and cpu providers computed ``scale * x`` in x's 16-bit dtype when one
    16-bit tensor was flattened into fp32 (-3 * 1.541 came out -4.625 instead of -4.623)."""
    x = torch.tensor([1.541015625, -0.3330078125, 7.0], dtype=src, device=DEVICE)
    flat, _ = tk.flatten([x], dtype=torch.float32, scale=-3.0, provider=provider)
    assert torch.equal(flat.cpu(), x.float().cpu() * -3.0)
