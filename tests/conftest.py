"""Shared test harness.

Where no GPU is present (or TORSH_TEST_INTERPRET=1 asks for it), Triton kernels run in Triton's
interpreter on CPU tensors and Numba CUDA kernels in Numba's simulator on host arrays. Both read their
switches when kernels are defined / when numba is imported (on a provider's first launch, since importing
torsh_kernels imports neither), so they are set here, before any test module imports torsh_kernels. On a
GPU machine the same tests run the compiled kernels on CUDA tensors.
"""

from __future__ import annotations

import os
import tempfile
import zlib

import torch

_GPU = torch.cuda.is_available() and os.environ.get("TORSH_TEST_INTERPRET", "0") != "1"
if not _GPU:
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
# Keep the user's provider choice and tuning cache out of the tests: they select providers explicitly,
# and the tuner's tests use their own cache directories.
os.environ.pop("TORSH_KERNELS_PROVIDER", None)
os.environ["TORSH_KERNELS_CACHE_DIR"] = tempfile.mkdtemp(prefix="torsh-test-cache-")

import pytest  # noqa: E402

# Importing torsh_kernels loads no Triton or Numba: each provider's kernels load, in the mode chosen above,
# on its first launch.
import torsh_kernels  # noqa: E402,F401

DEVICE = torch.device("cuda") if _GPU else torch.device("cpu")
PROVIDERS = ("triton", "numba", "torch")

# (dtype, atol, rtol): about two units in the last place of each dtype, so a wrong element or a missed
# element (the outputs are poisoned with NaN) fails. A one-ulp rounding error passes these; rounding
# modes are checked separately, bit for bit (test_casts_round_to_nearest_even).
DTYPE_TOLS = [
    pytest.param(torch.float32, 1e-6, 1e-6, id="fp32"),
    pytest.param(torch.float16, 1e-3, 1e-3, id="fp16"),
    pytest.param(torch.bfloat16, 8e-3, 8e-3, id="bf16"),
]


@pytest.fixture
def device() -> torch.device:
    return DEVICE


@pytest.fixture(params=PROVIDERS)
def provider(request) -> str:
    return request.param


@pytest.fixture
def gen(request) -> torch.Generator:
    """A generator seeded from the test id: fresh data per test, reproducible per test."""
    g = torch.Generator()
    g.manual_seed(zlib.crc32(request.node.nodeid.encode()))
    return g


def rand(shape, dtype, gen, device=DEVICE) -> torch.Tensor:
    """Random normal data (never zeros), made on the CPU from ``gen`` then moved."""
    return torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype).to(device)


def poison(shape, dtype, device=DEVICE) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def close(a, b, atol, rtol) -> None:
    """assert_close of fp32 CPU copies; a NaN (an element left poisoned) never matches."""
    torch.testing.assert_close(a.float().cpu(), b.float().cpu(), atol=atol, rtol=rtol, equal_nan=False)
