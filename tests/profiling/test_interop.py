"""HolisticTraceAnalysis interop: HTA reading a 2-rank torsh trace written by the recorder in 2 gloo
processes (the recorder writes distributedInfo, as Kineto does, so HTA tells the ranks apart)."""

from __future__ import annotations

import json

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.helpers import MLP
from torsh_kernels.collectives import run_local
from torsh_kernels.compression import PowerSGD
from torsh_kernels.parallel import CompressionHookState, compression_hook
from torsh_kernels.profiling import timeline
from torsh_kernels.profiling.traces import load, validate

# -- HolisticTraceAnalysis on torsh's own traces -------------------------------------------------------------


def _recorded(comm, d: str) -> None:
    net = MLP(24, 64, 10, seed=0)
    ddp = DDP(net)
    ddp.register_comm_hook(CompressionHookState(compressor=PowerSGD(2), start_iter=0, min_numel=16),
                           compression_hook)  # fmt: skip
    g = torch.Generator().manual_seed(comm.rank)
    with timeline.Recorder(d):
        for i in range(3):
            with timeline.step(i):
                ddp(torch.randn(8, 24, generator=g)).sum().backward()


def test_hta_finds_both_ranks_of_a_torsh_trace(tmp_path):
    TraceAnalysis = pytest.importorskip("hta.trace_analysis").TraceAnalysis
    d = tmp_path / "tr"
    run_local(_recorded, 2, str(d), timeout=240)
    counts = {}
    for r in (0, 1):
        f = d / f"rank{r}.json"
        text = f.read_text()
        assert text.startswith(f'{{"distributedInfo": {{"backend": "gloo", "rank": {r}, "world_size": 2, ')
        data = json.loads(text)
        assert validate(data, f) == "torsh"
        di = data["distributedInfo"]
        assert di["pg_count"] >= 1 and di["pg_config"][0]["ranks"] == [0, 1]  # as Kineto writes them
        counts[r] = sum(1 for e in data["traceEvents"] if e["ph"] == "X")
    assert load(d).ranks[1]["backend"] == "gloo"
    ta = TraceAnalysis(trace_dir=str(d))
    assert sorted(ta.t.traces) == [0, 1]
    for r, df in ta.t.traces.items():
        names = set(ta.t.symbol_table.sym_table[i] for i in df["name"].unique())
        assert {"PowerSGD round 1", "step 0"} <= names
        assert len(df) == counts[r]
    # without distributedInfo (the files torsh wrote before) HTA takes every file for rank 0
    old = tmp_path / "old"
    old.mkdir()
    for r in (0, 1):
        data = json.loads((d / f"rank{r}.json").read_text())
        del data["distributedInfo"]
        (old / f"rank{r}.json").write_text(json.dumps(data, separators=(",", ":")))
    assert sorted(TraceAnalysis(trace_dir=str(old)).t.traces) == [0]
