"""Distributed fault scenarios for ``scripts/probe.py``: one rank of three (gloo, loopback) dies, raises,
lingers past the timeout or sends NaN in each workload of the fault-injection suite (``tests/faults.py``:
compressed all-reduce with PowerSGD and top-k, DDP with the compression hook (PowerSGD, top-k, none),
FSDP2 with the quantized comms, the expert-parallel MoE layer, the synchronizer with the offloaded
optimizer), and the offloaded optimizer's step failing on one of two ranks (FSDP2, DDP; ``_offload``).

A case re-raises, as its own class, the typed error the surviving ranks got, once every survivor got
one within the timeout (2 s) plus a slack with its parameters and optimizer state as before the failed
step or as a clean run leaves them after it: ``typed_error``. Otherwise it returns what went wrong
(``silent_acceptance``: no error, a torn or NaN state, an error too late, a rank that gave no result), or
raises ``RuntimeError`` naming an untyped error a survivor got (``other_exception``). Each case launches
its ranks itself (``run_local``, forked from a server that imported torch once); the first case of a
worker also pays that server's start, a clean run per workload the first time it is used."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

from probe_cases import Case

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 2.0
SLACK = 4.0
WORKLOADS = ("allreduce-powersgd", "allreduce-topk", "ddp-powersgd", "ddp-topk", "ddp-none", "fsdp2-int8",
             "moe-all_to_all", "offload-sync")  # fmt: skip
# phases every workload has (its first collective, the end of the step, the input), plus two NaN payloads
# that once reached every rank's parameters silently (PowerSGD's Q, the MoE router's all-reduce)
SCENARIOS = [
    (w, k, p)
    for w in WORKLOADS
    for k, p in (("die", "before#0"), ("raise", "done#0"), ("linger", "after"), ("nan", "input"))
]
SCENARIOS += [("allreduce-powersgd", "nan", "send#2"), ("moe-all_to_all", "nan", "send#4")]  # fmt: skip


@functools.cache
def _faults():
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from tests import faults

    return faults


@functools.cache
def _clean(workload: str) -> dict:
    return _faults().clean_run(workload, TIMEOUT)


def _scenario(workload: str, kind: str, phase: str):
    import torsh_kernels.errors as errors

    f = _faults()
    fault = f.Fault(kind, phase)
    values, fault_time, wall = f.run_scenario(workload, fault, TIMEOUT)
    o = f.judge(workload, fault, _clean(workload), values, fault_time, wall, TIMEOUT, SLACK)
    if o.early:  # a clean collective outlived the short timeout on a loaded machine: once more
        values, fault_time, wall = f.run_scenario(workload, fault, TIMEOUT)
        o = f.judge(workload, fault, _clean(workload), values, fault_time, wall, TIMEOUT, SLACK)
    untyped = [v["error"] for v in o.survivors.values() if v["error"] and not v["error"]["typed"]]
    if untyped:
        raise RuntimeError(f"a survivor got an untyped {untyped[0]['type']}: {untyped[0]['message']}")
    if not o.ok:
        return {"problems": o.problems}
    err = next(v["error"] for v in o.survivors.values())
    cls = getattr(errors, err["type"], None)
    if not (isinstance(cls, type) and issubclass(cls, errors.TorshKernelsError)):
        cls = errors.CollectiveError
    raise cls(f"{err['message']} ({max(o.to_error):.2f} s after the fault)")


CASES = [Case(f"faults/{w}/{k}@{p}", functools.partial(_scenario, w, k, p), timeout=180.0) for w, k, p in SCENARIOS]


# -- OffloadedOptimizer's step across ranks (issue 41, item 7) -----------------------------------------------
# Two gloo ranks, FSDP2's shards (the agreement on by default) or DDP's replicas (group= given); rank 1's
# wrapped optimizer raises, exits or stalls past the timeout in the middle of step 3. Rank 0 must end the step
# typed (RankFailedError naming rank 1 with its error; CollectiveError; CollectiveTimeoutError) within the
# timeout plus the slack, with its part of the parameters as before the step.

OFFLOAD = [(k, f) for k in ("fsdp2", "ddp") for f in ("raise", "die", "stall")]
EXPECTED = {"raise": "RankFailedError", "die": "CollectiveError", "stall": "CollectiveTimeoutError"}


def _offload(kind: str, fault: str):
    import torsh_kernels.errors as errors
    from torsh_kernels.collectives import run_local

    _faults()  # the repository root on sys.path
    from tests.parallel.test_offload_ranks import fault_scenario

    try:
        values = run_local(fault_scenario, 2, kind, fault, TIMEOUT, op_timeout=30)
    except errors.RankFailedError as e:  # rank 1 died
        values = e.values
    out = values[0]
    if out is None:
        return {"problems": ["rank 0 gave no result"]}
    problems = []
    if out["error"] != EXPECTED[fault]:
        problems.append(f"rank 0 raised {out['error']} ({out['message'][:200]}), expected {EXPECTED[fault]}")
    if not out["rolled_back"]:
        problems.append("rank 0's parameters changed in the step that failed")
    if out["took"] > TIMEOUT + SLACK:
        problems.append(f"rank 0's error came {out['took']:.1f} s into the step")
    if fault == "raise" and (list(out["failures"]) != [1] or "Injected" not in out["failures"][1]):
        problems.append(f"rank 0's error does not name rank 1's: {out['failures']}")
    other = values[1]
    if fault == "raise" and other is not None and (other["error"] != "Injected" or not other["rolled_back"]):
        problems.append(f"rank 1: {other['error']}, rolled back: {other['rolled_back']}")
    if problems:
        return {"problems": problems}
    raise getattr(errors, out["error"])(f"{out['message'][:300]} ({out['took']:.2f} s into the step)")


CASES += [Case(f"faults/offload-{k}/{f}@wrapped-step", functools.partial(_offload, k, f), timeout=180.0)
          for k, f in OFFLOAD]  # fmt: skip
