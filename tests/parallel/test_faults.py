"""Fault injection on real gloo processes: one rank of three dies (SIGKILL), raises, lingers past the
timeout or sends NaN at a phase of a compressed all-reduce (PowerSGD: seed broadcast, P, Q; top-k: one
all-gather), a DDP step with torsh's hook (PowerSGD: several rounds coalesced across two buckets; top-k
and uncompressed: one round, through the futures DDP waits on), an FSDP2 step with the int8 all-gather
and reduce-scatter, an expert-parallel MoE step (count, dispatch and combine all_to_all, their backward,
the router's all-reduce) and a synchronized step with the offloaded optimizer.

Expected on every surviving rank: a typed error (``CollectiveError``, ``CollectiveTimeoutError`` or
``NonFiniteError``; never a bare ``RuntimeError``, never an abort) within the 2 s timeout plus a slack;
parameters and optimizer state exactly as before the step that failed or as a clean run leaves them
after it (never torn, never NaN); nothing past the hard deadline (a hang fails the scenario). A faulty
rank that raised, lingered or sent NaN must not be killed either (an abort inside gloo fails it).

The phases come from a clean run of each workload (see tests/faults.py). By default each workload x
fault kind runs at its first, middle and last phase (90 scenarios, about 40 s on two cores);
``TORSH_FAULTS=full`` runs every phase (189, about 80 s). ``TORSH_FAULTS_REPORT=path`` writes every
scenario's outcome there.
"""

from __future__ import annotations

import json
import os
import time

import pytest

from tests.faults import KINDS, WORKLOADS, clean_run, phases, plan_for, run_matrix, summary

pytestmark = pytest.mark.slow  # a system test: the whole fault matrix, in one module fixture (docs/testing.md)

TIMEOUT = 2.0
"""The collectives' timeout in the scenarios (the process group's, and the communicators')."""
SLACK = 4.0
"""How much later than the timeout a survivor's typed error may come (a loaded two-core machine)."""
FULL = os.environ.get("TORSH_FAULTS", "") == "full"


@pytest.fixture(scope="module")
def matrix() -> dict:
    t0 = time.monotonic()
    cleans = {w: clean_run(w, TIMEOUT) for w in WORKLOADS}
    plan = plan_for(cleans, FULL)
    outcomes = run_matrix(plan, cleans, TIMEOUT, SLACK)
    wall = time.monotonic() - t0
    print(f"\n{len(outcomes)} fault scenarios in {wall:.1f} s\n" + summary(outcomes))
    path = os.environ.get("TORSH_FAULTS_REPORT")
    if path:
        rows = [{"workload": o.workload, "kind": o.fault.kind, "phase": o.fault.phase, "ok": o.ok,
                 "survivors": o.errors(), "faulty": o.faulty_error(), "to_error_s": o.to_error,
                 "problems": o.problems, "wall_s": round(o.wall, 2)} for o in outcomes]  # fmt: skip
        with open(path, "w") as f:
            json.dump({"full": FULL, "seconds": round(wall, 1), "timeout": TIMEOUT, "scenarios": rows,
                       "collectives": {w: c["collectives"] for w, c in cleans.items()}}, f, indent=1)  # fmt: skip
    return {"cleans": cleans, "outcomes": outcomes}


@pytest.mark.parametrize("workload", list(WORKLOADS))
def test_every_survivor_gets_a_typed_error_in_time_and_keeps_its_state(matrix, workload):
    collectives = matrix["cleans"][workload]["collectives"]
    assert collectives, f"{workload}: the armed step issued no collective through the faulty rank's communicator"
    mine = [o for o in matrix["outcomes"] if o.workload == workload]
    for kind in KINDS:  # every kind ran at the first and last phase the run itself showed (every phase if full)
        ran = {o.fault.phase for o in mine if o.fault.kind == kind}
        ps = phases(kind, collectives)
        assert {ps[0], ps[-1]} <= ran and (not FULL or ran == set(ps)), (kind, ps, ran)
    bad = [o.line() for o in mine if not o.ok]
    assert not bad, "\n".join(bad)
