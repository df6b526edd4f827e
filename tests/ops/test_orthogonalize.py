"""orthogonalize: every provider against the torch reference (Gram-Schmidt in fp64), orthonormal
columns, zero and dependent columns, lists and views, and the typed errors.

The ops package re-exports the function ``orthogonalize``, which is therefore what ``torsh_kernels.ops.orthogonalize``
is as an attribute: the family's names are imported from its package and its modules directly."""

from __future__ import annotations

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
