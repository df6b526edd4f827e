"""Every GPU kernel variant compiles for a real GPU (sm_90), even on a machine without one, and its machine code
meets the goals (the SASS gate): >= 90% of global bytes by 128-bit accesses for memory-bound Triton kernels on
aligned contiguous data (or the per-case floor ``torsh_kernels.profiling.inspection.EXCEPTIONS`` states and
explains), <= 64 registers and >= 50% theoretical occupancy for memory-bound kernels, no spills anywhere.

The interpreter and the simulator run the kernels' logic but not their compiled form; these tests run
Triton's and Numba's real compilers (see gpu_compile_check.py) in fresh processes where neither interpreter
nor simulator is switched on. ``test_sass_gate`` is the quick one (a representative subset: each kernel, each
dtype class); the two others compile every variant of every launch case and hold all of them to the goals.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a system test: minutes of compiling every variant (docs/testing.md)

SCRIPT = Path(__file__).with_name("gpu_compile_check.py")


def _start(which: str, *extra: str, shards: int = 1) -> list[tuple[list[str], subprocess.Popen]]:
    """The compile check of ``which`` started in fresh processes: ``shards`` of them, each taking every
    ``shards``-th case."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "NUMBA_ENABLE_CUDASIM")}
    args = [[which, *extra]] if shards == 1 else [[which, *extra, str(i), str(shards)] for i in range(shards)]
    return [(a, subprocess.Popen([sys.executable, str(SCRIPT), *a], env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)) for a in args]  # fmt: skip


def _join(*started: list[tuple[list[str], subprocess.Popen]]) -> list[dict]:
    """Each started check's results, its processes' joined; none is left running (a shard that timed out or
    crashed: the others are killed)."""
    out = []
    try:
        for procs in started:
            joined: dict = {"cases": [], "errors": [], "kernels": 0}
            for a, proc in procs:
                stdout, err = proc.communicate(timeout=900)
                lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
                if not lines:
                    raise AssertionError(f"{' '.join(a)} compile check crashed:\n{stdout[-3000:]}\n{err[-3000:]}")
                res = json.loads(lines[-1])
                for k in ("cases", "errors", "kernels"):
                    joined[k] += res[k]
                if "canary" in res:
                    joined["canary"] = res["canary"]
            out.append(joined)
    finally:
        for procs in started:
            for _, p in procs:
                if p.poll() is None:
                    p.kill()
                    p.communicate()
    return out


def _no_numba_nvvm(res: dict) -> bool:
    errors = " ".join(e["error"] for e in res["errors"])
    return not res["cases"] and ("NVVM" in errors or "libnvvm" in errors.lower())


def _check_goals(res: dict, what: str) -> None:
    """Fail naming each case past a goal: its kernels, the figure and the threshold."""
    lines = [f"{c['name']} ({', '.join(c['kernels'])}): " + "; ".join(c["misses"]) for c in res["cases"] if c["misses"]]
    if lines:
        pytest.fail(f"{len(lines)} {what} past the SASS goals (sm_90):\n" + "\n".join(lines), pytrace=False)


def test_sass_gate():
    """The representative subset, both providers, held to the goals; and the canary (a de-vectorized copy
    kernel) must be caught, or the gate could not fail."""
    pytest.importorskip("triton")
    from tests.ops.gpu_compile_check import GATE

    # Triton in two processes and Numba beside them (the machines that run the suite have two cores or more)
    res, num = _join(_start("triton", "--gate", shards=2), _start("numba", "--gate"))
    assert not res["errors"], json.dumps(res["errors"], indent=1)[:4000]
    assert len(res["cases"]) == len(GATE)
    assert any("128-bit" in m for m in res["canary"]), res["canary"]
    _check_goals(res, "Triton cases")
    if _no_numba_nvvm(num):
        pytest.skip("no CUDA toolkit NVVM for Numba to compile with here")
    assert not num["errors"], json.dumps(num["errors"], indent=1)[:4000]
    _check_goals(num, "Numba cases")


def test_triton_kernels_compile_to_hopper_cubins():
    pytest.importorskip("triton")
    from triton.backends.nvidia import compiler  # noqa: F401  (the NVIDIA backend with its ptxas)

    from torsh_kernels.ops.launch_cases import cases

    (res,) = _join(_start("triton", shards=2))
    assert not res["errors"], json.dumps(res["errors"], indent=1)[:4000]
    assert len(res["cases"]) == len(cases())
    _check_goals(res, "Triton cases")


def test_numba_kernels_compile_to_sm90_ptx():
    from torsh_kernels.ops.launch_cases import cases

    (res,) = _join(_start("numba", shards=2))  # (two processes: the suite's machines have two cores or more)
    if _no_numba_nvvm(res):
        pytest.skip("no CUDA toolkit NVVM for Numba to compile with here")
    assert not res["errors"], json.dumps(res["errors"], indent=1)[:4000]
    assert len(res["cases"]) == len(cases())
    _check_goals(res, "Numba cases")
