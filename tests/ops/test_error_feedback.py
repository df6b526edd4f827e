"""Error-feedback ops (residual_add, error_update): every provider and dtype against the torch
reference, and the typed errors."""

from __future__ import annotations

import pytest
import torch

import torsh_kernels.ops.error_feedback as E
from tests.helpers import DEVICE, DTYPE_TOLS, close, poison, rand
from torsh_kernels.errors import NonFiniteError, ShapeError


@pytest.mark.parametrize("dtype,atol,rtol", DTYPE_TOLS)
def test_residual_add_and_error_update(provider, gen, dtype, atol, rtol):
    n = 4097
    x, r = rand(n, dtype, gen), rand(n, torch.float32, gen)
    out = poison((n,), torch.float32)
    E.residual_add(x, r, out=out, provider=provider)
    close(out, E.residual_add_ref(x, r), 0, 0)
    approx = rand(n, torch.float32, gen)
    res, grad = poison((n,), torch.float32), poison((n,), dtype)
    E.error_update(out, approx, res, out=grad, provider=provider)
    res_ref, grad_ref = torch.empty(n, device=DEVICE), torch.empty(n, dtype=dtype, device=DEVICE)
    E.error_update_ref(out, approx, res_ref, out=grad_ref)
    close(res, res_ref, 0, 0)
    close(grad, grad_ref, atol, rtol)
    E.residual_add(x, r, out=r, provider=provider)  # in place into the residual
    close(r, out, 0, 0)


# ---------------------------------------------------------------------------------------- non-finite


@pytest.mark.parametrize("at", [1234, 2000], ids=["bulk", "tail"])  # (the Triton launch of the last n % 16 elements)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_residual_add_nonfinite_inputs_are_reported(provider, gen, bad, at):
    n = 2001
    x = rand(n, torch.float32, gen)
    x[at] = bad
    r = rand(n, torch.float32, gen)
    with pytest.raises(NonFiniteError):
        E.residual_add(x, r, provider=provider)


# -------------------------------------------------------------------------------------------- errors


def test_error_feedback_typed_errors():
    x = torch.randn(100, device=DEVICE)
    with pytest.raises(ShapeError):
        E.error_update(x, x[:50], torch.empty(100, device=DEVICE))
