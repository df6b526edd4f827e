"""Every GPU kernel variant compiles for a real GPU (sm_90), even on a machine without one.

The interpreter and the simulator run the kernels' logic but not their compiled form; these tests run
Triton's and Numba's real compilers (see gpu_compile_check.py) in a fresh process where neither
interpreter nor simulator is switched on.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("gpu_compile_check.py")


def _run(which: str, shards: int = 1) -> dict:
    """The compile check of ``which`` in fresh processes: ``shards`` of them in parallel, each compiling every
    ``shards``-th variant, their results joined."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "NUMBA_ENABLE_CUDASIM")}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "0")
    args = [[which]] if shards == 1 else [[which, str(i), str(shards)] for i in range(shards)]
    procs = [subprocess.Popen([sys.executable, str(SCRIPT), *a], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for a in args]  # fmt: skip
    results = []
    try:
        for a, proc in zip(args, procs):
            out, err = proc.communicate(timeout=900)
            lines = [ln for ln in out.splitlines() if ln.startswith("{")]
            if not lines:
                raise AssertionError(f"{' '.join(a)} compile check crashed:\n{out[-3000:]}\n{err[-3000:]}")
            results += json.loads(lines[-1])["results"]
    finally:  # (a shard that timed out or crashed: the others are not left running)
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    return {"which": which, "results": results}


def test_triton_kernels_compile_to_hopper_cubins():
    pytest.importorskip("triton")
    from triton.backends.nvidia import compiler  # noqa: F401  (the NVIDIA backend with its ptxas)

    res = _run("triton")
    failed = [r for r in res["results"] if not r["ok"]]
    assert not failed, json.dumps(failed, indent=1)[:4000]
    assert len(res["results"]) == 53 + 90 + 42  # bucket: 16 flatten + 16 unflatten + 12 reduce + 9 wire_cast; ...


def test_numba_kernels_compile_to_sm90_ptx():
    res = _run("numba", shards=2)  # (two processes: the machines that run the suite have two cores or more)
    errors = " ".join(r.get("error", "") for r in res["results"])
    if all(not r["ok"] for r in res["results"]) and ("NVVM" in errors or "libnvvm" in errors.lower()):
        pytest.skip(f"no CUDA toolkit NVVM for Numba to compile with here: {errors[:300]}")
    failed = [r for r in res["results"] if not r["ok"]]
    assert not failed, json.dumps(failed, indent=1)[:4000]
    assert len(res["results"]) == 62 + 75 + 41  # bucket 53 + 9 wire_cast, compress 75, moe 41
