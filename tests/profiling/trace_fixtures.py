"""A hand-written two-rank torsh trace whose breakdown is known exactly (the viewer's and report's tests).

Rank 0, in ms (rank 1: the same, 8 ms later, so its collectives start 8 ms after rank 0's):

    step 0 [0, 100]:   forward [0, 30], backward [30, 80] holding a wait [60, 70], TopK round 1 [80, 90]
                       all_reduce in flight on "comm 0" [40, 75]
    step 1 [100, 200]: forward [100, 130], backward [130, 180], TopK round 1 [180, 190]
                       all_reduce in flight [185, 195]

Over its steps (200 ms): compute 150 (forward 60 + backward 100 - wait 10), compression 20, exposed
communication 15 ([60, 70] and [190, 195]), unrecorded 15 ([90, 100] and [195, 200]); communication in flight
45 ms: share 22.5%; overlapped by compute or compression: 25 + 5 = 30 ms, 66.7%.
"""

from __future__ import annotations

import json
from pathlib import Path

EXPECTED = {"compute_ms": 150.0, "compression_ms": 20.0, "communication_ms": 15.0, "unrecorded_ms": 15.0,
            "memory_ms": 0.0, "comm_ms": 45.0, "comm_share": 0.225, "overlap": 30 / 45, "window_ms": 200.0}  # fmt: skip
SHIFT_MS = 8.0
BASE_US = 1_000_000.0  # ts of time 0, in microseconds after the file's base_unix_us


def _x(name, cat, a, b, tid, shift, rank, **args):
    ev = {"ph": "X", "name": name, "cat": cat, "ts": BASE_US + (a + shift) * 1e3, "dur": (b - a) * 1e3,
          "pid": rank, "tid": tid}  # fmt: skip
    if args:
        ev["args"] = args
    return ev


def rank_trace(rank: int, world: int = 2, shift: float | None = None) -> dict:
    sh = SHIFT_MS * rank if shift is None else shift
    ev = [
        {"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}},
        {"ph": "M", "name": "thread_name", "pid": rank, "tid": 1, "args": {"name": "main"}},
        {"ph": "M", "name": "thread_name", "pid": rank, "tid": 2, "args": {"name": "comm 0"}},
    ]
    for k, off in enumerate((0.0, 100.0)):
        ev.append(_x(f"step {k}", "step", off, off + 100, 1, sh, rank, step=k, label="topk"))
        ev.append(_x("forward", "user", off, off + 30, 1, sh, rank))
        ev.append(_x("backward", "user", off + 30, off + 80, 1, sh, rank))
        ev.append(_x("TopK round 1", "compression", off + 80, off + 90, 1, sh, rank, compressor="TopK"))
    ev.append(_x("wait", "wait", 60, 70, 1, sh, rank))
    ev.append(_x("all_reduce", "collective", 40, 75, 2, sh, rank, op="all_reduce", bytes=4096, wire_bytes=4096,
                 group="0,1", seq=1))  # fmt: skip
    ev.append(_x("all_reduce", "collective", 185, 195, 2, sh, rank, op="all_reduce", bytes=4096, wire_bytes=4096,
                 group="0,1", seq=2))  # fmt: skip
    ev.append({"ph": "C", "name": "wire bytes", "ts": BASE_US + (40 + sh) * 1e3, "pid": rank, "tid": 0,
               "args": {"sent": 4096}})  # fmt: skip
    return {
        "traceEvents": ev,
        "displayTimeUnit": "ms",
        "otherData": {
            "schema": "torsh-trace/1",
            "rank": rank,
            "world_size": world,
            "device": "test",
            "versions": {},
            "clock": {"base_unix_us": 1_700_000_000_000_000},
            "wire_bytes": 8192,
        },
    }


def write_trace(directory: Path, ranks: int = 2, **kw) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for r in range(ranks):
        (directory / f"rank{r}.json").write_text(json.dumps(rank_trace(r, ranks, **kw)))
    return directory
