"""Judging the framework jobs' results (tests/integrations/*_job.py): the losses against the framework's own run, the
replicas, a resume against the run that never stopped."""

from __future__ import annotations

LOSS_TOLERANCE = 0.05
"""A compressed run's loss over its last 3 steps lies within 5% of the framework's own uncompressed run's (the
largest seen: PowerSGD rank 4, 2.6% above, on this model and these 15 steps)."""


def tail(losses: list[float], n: int = 3) -> float:
    return sum(losses[-n:]) / n


def check_trained_like(ours: dict, reference: dict, name: str) -> None:
    """``ours`` (one rank's record of one run) trained: its loss fell, and ends near the reference's; its replicas are
    identical."""
    lo, ref = ours["losses"], reference["losses"]
    assert len(lo) == len(ref), (name, len(lo), len(ref))
    fell = ref[0] - tail(ref)
    assert fell > 0.1, ("reference", ref)  # the framework's own run learned something in these steps
    assert lo[0] - tail(lo) > 0.5 * fell, (name, lo, ref)  # ours learned at least half as much
    assert abs(tail(lo) - tail(ref)) <= LOSS_TOLERANCE * tail(ref), (name, tail(lo), tail(ref))
    assert ours["spread"] == 0.0, (name, ours["spread"])  # every rank holds the same parameters


def check_resume(r: dict, name: str) -> None:
    """A run resumed from the checkpoint at step K ends where the uninterrupted run ends, bit for bit; one resumed
    with the hook's state started afresh does not (so the state is what was restored)."""
    assert r["resumed_vs_full"] == 0.0, (name, r["resumed_vs_full"])
    assert r["afresh_vs_full"] > 1e-4, (name, r["afresh_vs_full"])
    assert r["state_files"] == ["rank0-of-2.pt", "rank1-of-2.pt"], (name, r["state_files"])
