"""The first-run compile notice of the cpu provider: said while Numba really compiles (a cache miss), with the
time it took, once per process, never on a cache hit, silenced by TORSH_QUIET."""

from __future__ import annotations

import os
import subprocess
import sys

import numba
import pytest
from numba import njit
from numba.core import event

from torsh_kernels.ops.cpu_common import CompileNotice

START = "torsh: compiling kernels (first run only)..."


def _twice(a):
    return a * 2


@pytest.fixture
def notice():
    # after=0: any compile counts as long, so no assertion depends on how fast this machine compiles
    n = CompileNotice(after=0.0, modules=(__name__,))
    event.register("numba:compile", n)
    yield n
    event.unregister("numba:compile", n)


def test_said_once_while_compiling(notice, capsys):
    f = njit(_twice)
    assert f(2) == 4  # compiles: the notice
    err = capsys.readouterr().err.splitlines()
    assert err[0] == START and err[1].startswith("torsh: compiled in ") and len(err) == 2
    assert f(3.0) == 6.0 and f(4) == 8  # another compile, then none: nothing more in this process
    assert capsys.readouterr().err == "" and notice.done


def test_not_said_on_a_cache_hit(notice, capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(numba.config, "CACHE_DIR", str(tmp_path))
    notice.done = True  # the cold compile below fills the cache; its notice is not what this test is about
    assert njit(cache=True)(_twice)(5) == 10
    assert any(tmp_path.rglob("*.nbi")), "numba wrote no cache"
    capsys.readouterr()
    notice.done = False
    f = njit(cache=True)(_twice)  # a new dispatcher: loads the machine code from the cache, compiles nothing
    assert f(6) == 12
    assert f.stats.cache_hits and not f.stats.cache_misses
    assert capsys.readouterr().err == "" and not notice.done


def test_other_modules_compiles_are_not_announced(capsys):
    n = CompileNotice(after=0.0)  # the default: torsh_kernels' own kernels only
    event.register("numba:compile", n)
    try:
        assert njit(_twice)(7) == 14
    finally:
        event.unregister("numba:compile", n)
    assert capsys.readouterr().err == ""


def test_quiet(notice, capsys, monkeypatch):
    monkeypatch.setenv("TORSH_QUIET", "1")
    assert njit(_twice)(8) == 16
    assert capsys.readouterr().err == ""


_PROBE = ("import torch, torsh_kernels as tk; from torsh_kernels.ops import cpu_common; cpu_common.NOTICE.after = 0; "
          "tk.sign_compress(torch.randn(100), provider='cpu')")  # fmt: skip


@pytest.mark.slow  # two processes, one compiling torsh's kernels on a cold cache (seconds)
def test_cold_then_warm_cache_of_the_real_kernels(tmp_path):
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}
    env.pop("TORSH_QUIET", None)
    runs = [subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=300)
            for _ in range(2)]  # fmt: skip
    assert [r.returncode for r in runs] == [0, 0], runs[0].stderr + runs[1].stderr
    # with no threshold, any compile is announced: the warm run loads every kernel from the cache
    assert START in runs[0].stderr and "torsh: compiled in" in runs[0].stderr
    assert "compil" not in runs[1].stderr
