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
from pathlib import Path

import torch

from tests.helpers import DEVICE, GPU, PROVIDERS

if not GPU:
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
# Keep the user's provider choice and tuning cache out of the tests: they select providers explicitly,
# and the tuner's tests use their own cache directories.
os.environ.pop("TORSH_KERNELS_PROVIDER", None)
os.environ["TORSH_KERNELS_CACHE_DIR"] = tempfile.mkdtemp(prefix="torsh-test-cache-")
# The fault-injection harness (tests/faults.py) loads every kernel and optimizer its workloads use when it is
# imported with this set: in the fork server below, once for every rank forked from it.
os.environ["TORSH_FAULTS_WARM"] = "1"

import pytest

from torsh_kernels.collectives import launch

# The suite launches a few hundred small multi-rank jobs: forks of one server that imported torch, torsh_kernels
# and the fault harness once, instead of fresh interpreters (collectives/launch.py), unless a test asks for one.
launch.set_defaults(start_method="forkserver", preload=["tests.faults"])


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


_SLOW_WHEN_INTERPRETED = {torch.float16, torch.bfloat16}


SLOW_CASES = Path(__file__).resolve().parent / "slow_cases.txt"


def _measured_slow_cases() -> frozenset[str]:
    """The cases the fast tier's own run measured at 0.5 s or more here (tests/slow_cases.txt, derived by
    scripts/slow_cases.py from a durations log): marked ``slow``, so that the fast tier stays a few minutes."""
    lines = SLOW_CASES.read_text().splitlines() if SLOW_CASES.exists() else []
    return frozenset(ln.strip() for ln in lines if ln.strip() and not ln.startswith("#"))


def pytest_collection_modifyitems(config, items) -> None:
    """The fast tier's rules beyond the explicit ``slow`` marks (docs/testing.md): the measured list
    (``tests/slow_cases.txt``), and where Triton's interpreter
    and Numba's simulator run the kernels (no GPU), an op test's triton and numba cases in 16-bit dtypes are
    ``slow``. The simulator and interpreter run every thread in Python, so these cases take most of the op
    tests' time; their fp32 (and fp64) cases, and every dtype on the cpu and torch providers, stay in the fast
    tier, and plain ``pytest`` runs them all. On a GPU the kernels are compiled and nothing is marked."""
    slow = pytest.mark.slow
    measured = _measured_slow_cases()
    for item in items:
        if item.nodeid in measured:
            item.add_marker(slow)
    if GPU:
        return
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if (
            item.nodeid.startswith("tests/ops/")
            and params.get("provider") in ("triton", "numba")
            and params.get("dtype") in _SLOW_WHEN_INTERPRETED
        ):
            item.add_marker(slow)
