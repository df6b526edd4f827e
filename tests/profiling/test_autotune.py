"""The autotuner: search logic, pruning, wrong or failing candidates never winning, the cache it writes
(keying, resume, invalidation), the dispatcher using what it tuned, rank consistency on real processes,
`torsh tune`. The cache reader itself (ops.tuning) is tested in tests/ops/test_tuning.py."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

import torsh_kernels.ops.tuning as T
import torsh_kernels.profiling.autotune as A
from torsh_kernels.apps.cli import main
from torsh_kernels.collectives import run_local
from torsh_kernels.ops import registry
from torsh_kernels.ops.bucket.providers import flatten_impl

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(T.ENV_CACHE_DIR, str(tmp_path / "cache"))
    T._STORE.data = None
    A.install()  # the registry's default reader (another test may have swapped the registry's hooks)
    yield
    T._STORE.data = None


CALLS: list[str] = []


def _fake_space(op: str = "test_fake") -> T.TuneSpace:
    """torch: right, and as slow as its meta X says (X=1 fastest); triton: fast but wrong; numba: raises."""

    def run(x, provider):
        CALLS.append(provider)
        if provider == "numba":
            raise RuntimeError("this configuration does not compile")
        if provider == "triton":
            return x * 0  # instant and wrong
        X = registry.tuned_meta(op, CPU, x.dtype, x.numel(), provider).get("X", 2)
        time.sleep(0.002 * X**2)
        return x * 2

    return T.TuneSpace(op=op, family="test", dtypes=(torch.float32,), meta={"torch": {"X": (2, 1, 4)}},
                       make=lambda d, dt, n, g: torch.randn(n, generator=g, dtype=dt).to(d), run=run,
                       check=lambda x, out: torch.equal(out, x * 2))  # fmt: skip


@pytest.mark.parametrize("strategy", A.STRATEGIES)
def test_wrong_and_failing_candidates_never_win(strategy):
    A.register_space(_fake_space())
    t = A.Tuner(CPU, providers=("torch", "triton", "numba"), strategy=strategy, budget_s=60, reps=3)
    (r,) = t.tune(["test_fake"], [torch.float32], [1000])
    assert r.winner == T.Candidate("torch", (("X", 1),)), r
    assert "triton" in r.dropped and "wrong result" in r.dropped["triton"]
    assert "numba" in r.dropped and "does not compile" in r.dropped["numba"]
    assert r.bucket == 10 and r.default == T.Candidate("torch")
    assert r.speedup and r.speedup > 1.5  # X=1 against the default (X=2): 4x less sleep
    if strategy == "exhaustive":
        assert "torch(X=4)" in r.pruned, "8x slower than the best after one repetition: pruned"


def test_cache_keying_resume_and_invalidation():
    A.register_space(_fake_space())
    t = A.Tuner(CPU, providers=("torch",), budget_s=60, reps=2)
    t.tune(["test_fake"], [torch.float32], [1000, 5000])
    data = json.loads(T.cache_path().read_text())
    (env_key,) = data["environments"]
    env = data["environments"][env_key]
    assert env["env"]["torch"] == torch.__version__ and env["env"]["device"].startswith("cpu")
    assert set(env["entries"]) == {"test_fake | float32 | 2^10", "test_fake | float32 | 2^13"}
    assert env["entries"]["test_fake | float32 | 2^10"]["meta"] == {"X": 1}
    # a second process (a fresh Tuner) uses the cache without running a candidate
    CALLS.clear()
    again = A.Tuner(CPU, providers=("torch",), budget_s=60, reps=2).tune(["test_fake"], [torch.float32], [700, 4100])
    assert all(r.cached for r in again) and CALLS == []
    # resume: a new size is tuned, the old ones stay
    more = A.Tuner(CPU, providers=("torch",), budget_s=60, reps=2).tune(["test_fake"], [torch.float32], [1000, 40000])
    assert [r.cached for r in more] == [True, False]
    # the dispatcher's lookups see the winner (size 600 is in bucket 2^10)
    assert registry.tuned_meta("test_fake", CPU, torch.float32, 600, "torch") == {"X": 1}
    # a version change is another environment: the old winners no longer apply
    T.cache_path().write_text(T.cache_path().read_text().replace(f"torch={torch.__version__}", "torch=0.0.1"))
    registry.reload()  # a change from outside the tuner: cached lookups see it after a reload
    assert registry.tuned_meta("test_fake", CPU, torch.float32, 600, "torch") == {}


def test_budget_stops_and_a_later_run_resumes():
    A.register_space(_fake_space())
    first = A.Tuner(CPU, providers=("torch",), budget_s=0.05, reps=2).tune(["test_fake"], [torch.float32],
                                                                            [2**8, 2**9, 2**11])  # fmt: skip
    assert 1 <= len(first) < 3, "the budget ran out after the first bucket"
    second = A.Tuner(CPU, providers=("torch",), budget_s=60, reps=2).tune(["test_fake"], [torch.float32],
                                                                           [2**8, 2**9, 2**11])  # fmt: skip
    assert [r.cached for r in second][: len(first)] == [True] * len(first) and not second[-1].cached


def test_dispatcher_uses_cached_winners_for_real_ops():
    t = A.Tuner(CPU, providers=("torch", "triton", "numba"), strategy="greedy", budget_s=120, reps=2)
    (r,) = t.tune(["flatten"], [torch.float32], [1000])
    assert not r.dropped, r.dropped
    # the winner is the fastest of what was timed (median), and its time is the one recorded for it
    fastest = min(r.timings, key=lambda c: r.timings[c]["median_ms"])
    assert str(r.winner) == fastest and r.winner_ms == r.timings[fastest]["median_ms"]
    assert r.winner.provider in ("torch", "triton", "numba")
    assert len(r.timings) + len(r.pruned) >= 3
    assert flatten_impl.select(CPU, torch.float32, 900, None) == r.winner.provider  # automatic selection
    # (a winner written by hand, its meta-parameters reaching the launchers: tests/ops/test_tuning.py)


def _sync_worker(comm, root):
    os.environ[T.ENV_CACHE_DIR] = os.path.join(root, f"rank{comm.rank}")
    T._STORE.data = None
    key, env = T.environment_key(torch.device("cpu"))
    entries = {"flatten | float32 | 2^12": {"provider": "torch" if comm.rank == 0 else "triton", "meta": {},
                                            "median_ms": 1.0}}  # fmt: skip
    if comm.rank == 1:
        entries["quantize | float32 | 2^20"] = {"provider": "numba", "meta": {}, "median_ms": 2.0}
    T.update_cache(lambda data: data["environments"].update({key: {"env": env, "entries": entries}}))
    n = A.sync_tuning(comm)
    got = T.load_cache()["environments"][key]["entries"]
    return (
        n,
        {k: (v["provider"], v.get("synced_from_rank")) for k, v in got.items()},
        flatten_impl.select(torch.device("cpu"), torch.float32, 3000, None),
    )


def test_sync_tuning_makes_ranks_agree(tmp_path):
    (n0, c0, p0), (n1, c1, p1) = run_local(_sync_worker, 2, str(tmp_path), timeout=120)
    assert n0 == n1 == 1
    assert c0 == {"flatten | float32 | 2^12": ("torch", None)}
    assert c1 == {"flatten | float32 | 2^12": ("torch", 0)}, "rank 0's winner, marked; rank 1's extra entry dropped"
    assert p0 == p1 == "torch"


def test_torsh_tune_cli(capsys):
    assert main(["tune", "--ops", "bucket", "--dtypes", "fp32", "--sizes", "2^10", "--budget", "60"]) == 0
    out = capsys.readouterr().out
    assert "flatten" in out and "bucket_reduce" in out and "tuned now" in out
    assert main(["tune", "--ops", "flatten", "--dtypes", "fp32", "--sizes", "2^10"]) == 0
    assert "cache (tuned" in capsys.readouterr().out, "a second run uses the cache"
    assert main(["tune", "--show"]) == 0
    shown = capsys.readouterr().out
    assert "flatten | float32 | 2^10" in shown and "current" in shown
    assert main(["tune", "--ops", "nonsense"]) == 2
    assert main(["tune", "--clear"]) == 0
    assert not T.cache_path().exists()
