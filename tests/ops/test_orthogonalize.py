"""orthogonalize: every provider against the torch reference (Gram-Schmidt in fp64), orthonormal
columns, zero and dependent columns, lists and views, and the typed errors.

The ops package re-exports the function ``orthogonalize``, which is therefore what ``torsh_kernels.ops.orthogonalize``
is as an attribute: the family's names are imported from its package and its modules directly."""

from __future__ import annotations

import math

import pytest
import torch

from tests.helpers import DEVICE, close, rand
from torsh_kernels.errors import DTypeError, InvalidArgumentError, NonFiniteError, ShapeError
from torsh_kernels.ops.orthogonalize import orthogonalize, orthogonalize_ref
from torsh_kernels.ops.orthogonalize.api import ortho_op


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
    got = orthogonalize(m, provider=provider)
    orthogonalize_ref(ref)
    assert got is m
    tol = {torch.float32: 2e-5, torch.float64: 1e-12, torch.bfloat16: 1.6e-2}[dtype]
    close(m, ref, tol, tol)
    for mat, rmat in zip(m.view(-1, *shape[-2:]), ref.view(-1, *shape[-2:])):
        dropped = [j for j in range(shape[-1]) if bool((rmat[:, j] == 0).all())]  # near-dependent in bf16
        assert len(dropped) <= (1 if dtype == torch.bfloat16 else 0)
        _check_orthonormal(mat, zero_cols=dropped, tol=max(tol, 1e-6) * 4)


def test_orthogonalize_zero_and_dependent_columns(provider, gen):
    m = rand((200, 6), torch.float32, gen)
    m[:, 1] = 0  # zero column
    m[:, 3] = 2 * m[:, 0] - m[:, 2]  # linearly dependent on earlier columns
    m[:, 5] = m[:, 4] * 1e-3  # dependent, and tiny
    orthogonalize(m, provider=provider)
    assert torch.isfinite(m).all()
    _check_orthonormal(m, zero_cols=(1, 3, 5))
    z = torch.zeros(50, 4, device=DEVICE)
    orthogonalize(z, provider=provider)
    assert bool((z == 0).all())


def test_orthogonalize_list_of_different_heights(provider, gen):
    mats = [rand((m, 4), torch.float32, gen) for m in (5, 130, 64, 4)]
    refs = [m.clone() for m in mats]
    orthogonalize(mats, provider=provider)
    orthogonalize_ref(refs)
    for a, b in zip(mats, refs):
        close(a, b, 2e-5, 2e-5)


def test_orthogonalize_views_of_one_buffer(provider, gen):
    buf = rand(3 * 40 * 3 + 1, torch.float32, gen)
    mats = [buf[1 + i * 120 : 1 + (i + 1) * 120].view(40, 3) for i in range(3)]
    refs = [m.clone() for m in mats]
    orthogonalize(mats, provider=provider)
    orthogonalize_ref(refs)
    for a, b in zip(mats, refs):
        close(a, b, 2e-5, 2e-5)


def test_orthogonalize_wide_rank_uses_torch_or_raises(gen):
    m = rand((100, 33), torch.float32, gen)
    ref = m.clone()
    orthogonalize(m)  # automatic: beyond the kernels' 32 columns, the torch path
    orthogonalize_ref(ref)
    close(m, ref, 2e-5, 2e-5)
    with pytest.raises(ShapeError, match="32 columns"):
        orthogonalize(m.clone(), provider="triton")


# ---------------------------------------------------------------------------------------- non-finite


@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_orthogonalize_nonfinite_inputs_are_reported_and_change_nothing(provider, gen, bad):
    m = rand((30, 3), torch.float32, gen)
    m[4, 1] = bad
    mk = m.clone()
    with pytest.raises(NonFiniteError):
        orthogonalize(m, provider=provider)
    assert torch.equal(m.nan_to_num(), mk.nan_to_num())


# -------------------------------------------------------------------------------------------- errors


def test_orthogonalize_typed_errors():
    with pytest.raises(ShapeError):
        orthogonalize(torch.randn(2, 3, 4, 5, device=DEVICE))
    with pytest.raises(ShapeError):
        orthogonalize(torch.randn(10, 4, device=DEVICE).t())  # not contiguous
    with pytest.raises(ShapeError):
        orthogonalize([torch.randn(10, 4, device=DEVICE), torch.randn(10, 3, device=DEVICE)])
    with pytest.raises(DTypeError):
        orthogonalize([torch.randn(10, 4, device=DEVICE), torch.randn(10, 4, device=DEVICE).double()])
    with pytest.raises(InvalidArgumentError):
        orthogonalize(torch.randn(10, 4, device=DEVICE), rtol=2.0)


def test_orthogonalize_custom_op_passes_opcheck():
    torch.library.opcheck(ortho_op, ([torch.randn(20, 3), torch.randn(9, 3)], 1e-4, 2, "torch"))


def test_iters_are_bounded_and_meta_matrices_give_meta_results(provider):
    """iters=10**9 ran (compiled, on the kernel providers) until killed: iters is capped at MAX_ITERS. Meta
    matrices failed in Tensor.item(); they now run the op's fake implementation (nothing to compute)."""
    from torsh_kernels.ops.orthogonalize import MAX_ITERS

    m = rand((9, 3), torch.float32, torch.Generator().manual_seed(5))
    before = m.clone()
    for bad in (0, MAX_ITERS + 1, 10**9):
        with pytest.raises(InvalidArgumentError, match="iters"):
            orthogonalize(m, iters=bad, provider=provider)
    assert torch.equal(m, before)
    orthogonalize(m, iters=MAX_ITERS, provider=provider)
    close(m, orthogonalize_ref(before.clone()), 1e-4, 1e-3)
    meta = torch.empty(2, 9, 3, device="meta")
    assert orthogonalize(meta, provider=provider) is meta
    assert orthogonalize([torch.empty(9, 3, device="meta")], iters=3, provider=provider)[0].is_meta
    with pytest.raises(InvalidArgumentError, match="iters"):
        orthogonalize(meta, iters=10**9, provider=provider)


# ------------------------------------------------------------------ the cpu provider's batch kernel (issue 41, item 16)


def _deficient(shape, dtype, gen):
    m = rand(shape, torch.float32, gen).to(dtype)
    r = shape[-1]
    if r > 1:
        m[..., r // 2] = 0  # a zero column
    if r > 2:
        m[..., r - 1] = 2 * m[..., 0] - m[..., 1]  # a dependent one
    return m


@pytest.mark.parametrize("r", [1, 2, 3, 4, 5, 8, 16, 33])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_default_cpu_batch_matches_reference_with_zero_and_dependent_columns(gen, r, dtype):
    """A [B, m, r] batch on the CPU goes to the cpu kernel in one call (the fast path): every matrix as the
    reference has it, zero and dependent columns zero (fp64: a dependent column exactly, small integers, up to
    r = 8: the Gram matrix's rounding, ~1e-16 of its diagonal, is above fp64's rtol**2 = 1e-20, so beyond a few
    columns the Gram-Schmidt in it cannot tell an exactly dependent column from a nearly dependent one, on
    every provider that runs CholeskyQR)."""
    m = _deficient((5, 70, r), dtype, gen)
    dep = r > 2 and (dtype == torch.float32 or r <= 8)
    if dtype == torch.float64:
        m = m.mul(4).round()
        m[..., r - 1] = 2 * m[..., 0] - m[..., 1] if dep else m[..., r - 1]
    ref = m.clone()
    assert orthogonalize(m) is m
    orthogonalize_ref(ref)
    tol = 2e-5 if dtype == torch.float32 else 1e-12
    close(m, ref, tol, tol)
    zero = [j for j in range(r) if (r > 1 and j == r // 2) or (dep and j == r - 1)]
    for mat in m:
        _check_orthonormal(mat, zero_cols=zero, tol=1e-4)


def test_default_cpu_list_of_mixed_shapes_and_views(gen):
    """PowerSGD's shapes: a list of [m_i, r] of different heights (16 to 8192), one of them a view into a
    buffer at an odd offset, with a zero matrix among them."""
    mats = [rand((m, 4), torch.float32, gen) for m in (16, 8192, 700, 33, 2048)]
    buf = rand(1 + 90 * 4, torch.float32, gen)
    mats.append(buf[1:].view(90, 4))
    mats.append(torch.zeros(40, 4))
    refs = [m.clone() for m in mats]
    orthogonalize(mats)
    orthogonalize_ref(refs)
    for a, b in zip(mats, refs):
        close(a, b, 2e-5, 2e-5)
    assert bool((mats[-1] == 0).all())


def test_cpu_one_column_skips_only_passes_that_change_nothing(gen):
    """r = 1: a second iteration whose factor is within a quarter ulp of 1 is skipped; the result is the
    same bits as running it."""
    import numpy as np

    from torsh_kernels.ops.orthogonalize import cpu as K

    for dtype in (torch.float32, torch.float64):
        a = rand((6, 3000, 1), torch.float32, gen).to(dtype)
        a[2] *= 1e-20
        b = a.clone()
        offs = np.arange(0, a.numel(), 3000, dtype=np.int64)
        rows = np.full(6, 3000, dtype=np.int64)
        assert K.ortho_span(a.numpy().reshape(-1), offs, rows, 1, 1e-8, 2, False, K._EXACT[dtype])
        assert K.ortho_span(b.numpy().reshape(-1), offs, rows, 1, 1e-8, 2, False, 0.0)
        assert torch.equal(a, b)


def _conditioned(m: int, r: int, cond: float, gen: torch.Generator) -> torch.Tensor:
    """An fp64 [m, r] matrix with singular values spaced logarithmically from 1 down to 1 / cond."""
    u = torch.linalg.qr(torch.randn(m, r, dtype=torch.float64, generator=gen)).Q
    v = torch.linalg.qr(torch.randn(r, r, dtype=torch.float64, generator=gen)).Q
    return (u * torch.logspace(0, -math.log10(cond), r, dtype=torch.float64)) @ v.T


@pytest.mark.parametrize("r", [2, 4, 8, 16])
def test_cpu_kernel_stops_iterating_once_the_gram_matrix_is_settled(r):
    """The cpu kernel skips the iterations left once the stored Q's Gram matrix is the identity within half
    the unit roundoff per column (the next would move no column by more than its rounding): a moderately
    conditioned fp32 matrix comes out of iters=2 and 3 as the same bits as iters=1, orthonormal to that
    bound; an ill-conditioned one (cond 1e6, rtol 0) still takes the second iteration, which it needs (one
    leaves it orthogonal only to ~1e-5); fp64, whose roundoff fp64 sums cannot beat, keeps iterating."""
    gen = torch.Generator().manual_seed(r)
    u32 = 2.0**-24
    for cond in (1.0, 1e2, 1e4):
        a = _conditioned(2048, r, cond, gen).float()
        one, two, three = (orthogonalize(a.clone(), iters=i, provider="cpu") for i in (1, 2, 3))
        assert torch.equal(one, two) and torch.equal(two, three), cond
        q = one.double()
        assert ((q.T @ q - torch.eye(r, dtype=torch.float64)).norm(dim=0) <= u32).all(), cond
    a = _conditioned(2048, r, 1e6, gen).float()
    one, two = (orthogonalize(a.clone(), iters=i, provider="cpu", rtol=0.0) for i in (1, 2))
    err = [(q.double().T @ q.double() - torch.eye(r, dtype=torch.float64)).abs().max().item() for q in (one, two)]
    assert err[0] > 1e-6 and err[1] < 1e-7, err
    a = _conditioned(500, r, 1e3, gen)
    one, two = (orthogonalize(a.clone(), iters=i, provider="cpu") for i in (1, 2))
    assert not torch.equal(one, two)
    assert (two.T @ two - torch.eye(r, dtype=torch.float64)).abs().max() < 1e-14


@pytest.mark.parametrize("check", [True, False])
def test_default_cpu_batch_nonfinite_changes_nothing(gen, check):
    m = rand((4, 50, 3), torch.float32, gen)
    m[3, 7, 2] = float("nan")
    before = m.clone()
    if check:
        with pytest.raises(NonFiniteError):
            orthogonalize(m)
        assert torch.equal(m.nan_to_num(), before.nan_to_num())
    else:
        orthogonalize(m, check_finite=False)
        assert torch.isfinite(m[:3]).all()


@pytest.mark.parametrize("r", [2, 5])
def test_default_cpu_batch_split_over_threads_is_the_one_thread_result(gen, r):
    """A large batch is split over torch's intra-op threads (whole matrices per thread): the same bits as one
    thread, zero columns kept zero; a NaN in the last matrix changes nothing (every element is checked before
    any thread writes)."""
    from torsh_kernels.ops.orthogonalize import cpu as K

    if DEVICE.type != "cpu":
        pytest.skip("the CPU default")
    b = 7
    m = _deficient((b, -(-K.PARALLEL_MIN_WORK // (b * r * r)) + 3, r), torch.float32, gen)
    assert m.numel() * r >= K.PARALLEL_MIN_WORK
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = orthogonalize(m.clone())
        torch.set_num_threads(3)
        many = orthogonalize(m.clone())
        bad = m.clone()
        bad[-1, -1, -1] = float("nan")
        before = bad.clone()
        with pytest.raises(NonFiniteError):
            orthogonalize(bad)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)
    assert torch.equal(bad.nan_to_num(), before.nan_to_num())
    ref = orthogonalize_ref(m.clone())
    close(many, ref, 2e-5, 2e-5)


_FORKED = """
import os, faulthandler, numpy as np, torch
import torsh_kernels as tk
from torsh_kernels.ops.orthogonalize import cpu as K
torch.set_num_threads(2)
a = np.random.default_rng(0).standard_normal((4, K.PARALLEL_MIN_WORK // 64 + 1, 4)).astype(np.float32)
want = tk.orthogonalize(torch.from_numpy(a.copy())).numpy()  # the parent's pool exists now
pid = os.fork()
if pid == 0:
    faulthandler.dump_traceback_later(60, exit=True)
    # (no torch op that runs on its OpenMP threads: GNU OpenMP's pool does not survive a fork either)
    got = tk.orthogonalize(torch.from_numpy(a.copy())).numpy()
    print("child", np.array_equal(got, want), flush=True)
    os._exit(0)
os.waitpid(pid, 0)
"""


def test_the_thread_split_works_in_a_forked_child():
    """The pool's threads do not follow a fork: a child that orthogonalises a large batch after its parent did
    makes its own pool (it waited forever on the parent's), with the two torch threads it inherited."""
    import subprocess
    import sys

    if DEVICE.type != "cpu":
        pytest.skip("the CPU default")
    p = subprocess.run([sys.executable, "-c", _FORKED], capture_output=True, text=True, timeout=180)
    assert p.stdout.strip() == "child True", (p.stdout, p.stderr[-2000:])
