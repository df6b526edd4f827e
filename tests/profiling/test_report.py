"""`torsh report`: breakdown, stragglers, suggestions from thresholds, --json; and the issue's end-to-end
check: `torsh demo --trace DIR`, `torsh timeline DIR` and `torsh report DIR` agree on the communication
share, which is recomputed here from the raw JSON files independently of the library's analysis."""

from __future__ import annotations

import json

import pytest

from tests.profiling.trace_fixtures import EXPECTED, write_trace
from torsh_kernels.apps.cli import main as cli
from torsh_kernels.env import fmt_bytes
from torsh_kernels.errors import InvalidArgumentError
from torsh_kernels.profiling.report import Thresholds, build
from torsh_kernels.profiling.traces import load, validate


@pytest.fixture
def trace_dir(tmp_path):
    return write_trace(tmp_path / "tr")


def test_report_numbers_and_straggler(trace_dir):
    rep = build(load(trace_dir))
    assert rep["window"]["over"] == "steps"
    for r in rep["ranks"]:
        for k, v in EXPECTED.items():
            assert r[k] == pytest.approx(v, abs=1e-6), k
    s = rep["summary"]
    assert s["comm_share"] == pytest.approx(0.225) and s["overlap"] == pytest.approx(2 / 3)
    assert s["step_ms_median"] == pytest.approx(100.0) and s["steps_per_rank"] == 2
    st = {d["rank"]: d for d in rep["stragglers"]}
    # rank 1 starts both collectives 8 ms after rank 0 (threshold: 5% of the 100 ms step)
    assert st[1]["straggler"] and st[1]["median_late_ms"] == pytest.approx(8.0) and st[1]["latest_fraction"] == 1.0
    assert not st[0]["straggler"] and st[0]["median_late_ms"] == 0.0
    assert [g["id"] for g in rep["suggestions"]] == ["straggler"]
    assert "Rank 1" in rep["suggestions"][0]["message"]


def test_thresholds_drive_suggestions(trace_dir):
    tr = load(trace_dir)
    rep = build(tr, thresholds=Thresholds(comm_share=0.2, unrecorded=0.05))
    assert [g["id"] for g in rep["suggestions"]] == ["communication", "unrecorded", "straggler"]
    # the trace shows TopK rounds: the job compresses, so no "compress with compression_hook"; compression
    # (10% of the step) costs more than the exposed communication (7.5%): no "compress harder" either
    comm = rep["suggestions"][0]["message"]
    assert "already compresses (TopK)" in comm and "compression_hook" not in comm
    assert "raise the compression" not in comm
    # the 7.5% no span covers is unrecorded host time, not idle: advice to record it, never host stalls
    unrec = rep["suggestions"][1]["message"]
    assert "7.5% of the step is covered by no recorded span" in unrec and "stall" not in unrec
    assert rep["summary"]["gpu_idle_share"] is None and rep["summary"]["host_unrecorded_share"] == pytest.approx(0.075)
    assert "idle" not in [g["id"] for g in build(tr, thresholds=Thresholds(idle=0.0))["suggestions"]]
    rep = build(tr, thresholds=Thresholds(overlap=0.9, compression=0.05))
    assert [g["id"] for g in rep["suggestions"]] == ["overlap", "compression", "straggler"]
    # the all-reduce starts inside backward [30, 80]: the job already overlaps, so no "start buckets during backward"
    assert rep["facts"]["comm_during_backward"] is True
    assert "already start during backward" in rep["suggestions"][0]["message"]
    assert "GradientSynchronizer(overlap=True)" not in rep["suggestions"][0]["message"]
    assert "switch to a cheaper compressor (FP16 or BF16 or Quantize)" in rep["suggestions"][1]["message"]
    # no straggler when the ranks are in step
    rep = build(load(write_trace(trace_dir.parent / "even", shift=0.0)))
    assert rep["suggestions"] == [] and not any(d["straggler"] for d in rep["stragglers"])
    with pytest.raises(InvalidArgumentError, match="comm_share"):
        Thresholds(comm_share=30)


def test_report_step_and_window(trace_dir):
    tr = load(trace_dir)
    rep = build(tr, step=1)
    r0 = rep["ranks"][0]
    assert r0["window_ms"] == pytest.approx(100) and r0["compute_ms"] == pytest.approx(80)
    assert r0["comm_ms"] == pytest.approx(10)
    rep = build(tr, window=(40.0, 75.0))
    assert rep["ranks"][0]["comm_share"] == pytest.approx(1.0)
    with pytest.raises(InvalidArgumentError, match="step 9"):
        build(tr, step=9)


def test_report_cli(trace_dir, capsys):
    assert cli(["report", str(trace_dir), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["summary"]["comm_share"] == pytest.approx(0.225)
    assert cli(["report", str(trace_dir), "--width", "150"]) == 0
    out = capsys.readouterr().out
    assert "communication share 22.5% of step time" in out and "overlap 66.7%" in out
    assert "YES" in out and "(straggler) Rank 1" in out
    assert cli(["report", str(trace_dir / "nope")]) == 2
    assert "no such file or directory" in capsys.readouterr().err


# -- end to end: the demo's trace ----------------------------------------------------------------------


def _merge(iv):
    out = []
    for a, b in sorted(iv):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def _independent_comm_share(path) -> tuple[float, set]:
    """Communication share straight from a torsh trace file: the union of its collective and issue
    events (collectives in flight, and issuing them) inside its step events, over the steps' length."""
    data = json.loads(path.read_text())
    validate(data, path)
    xs = [e for e in data["traceEvents"] if e["ph"] == "X"]
    steps = _merge([(e["ts"], e["ts"] + e["dur"]) for e in xs if e["cat"] == "step"])
    comm = _merge([(e["ts"], e["ts"] + e["dur"]) for e in xs if e["cat"] in ("collective", "issue")])
    inside = 0.0
    for a, b in comm:
        for c, d in steps:
            inside += max(0.0, min(b, d) - max(a, c))
    labels = {e["args"]["label"] for e in xs if e["cat"] == "step"}
    return inside / sum(b - a for a, b in steps), labels


def test_demo_timeline_and_report_agree(tmp_path, capsys):
    d = tmp_path / "demo"
    rc = cli(["demo", "--link", "none", "--steps", "16", "--compressors", "none,powersgd", "--hidden", "48",
              "--batch", "8", "--trace", str(d), "--trace-steps", "4", "--no-progress",
              "--json", str(tmp_path / "demo.json")])  # fmt: skip
    assert rc == 0
    demo_out = capsys.readouterr().out
    assert sorted(p.name for p in d.iterdir()) == ["rank0.json", "rank1.json"]
    expected = {}
    for r in (0, 1):
        share, labels = _independent_comm_share(d / f"rank{r}.json")
        assert labels == {"none", "powersgd:4"}
        assert 0 < share < 1
        expected[r] = share
    assert cli(["report", str(d), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert list(rep["labels"]) == ["none", "powersgd:4"]
    for row in rep["ranks"]:
        assert row["comm_share"] == pytest.approx(expected[row["rank"]], abs=1e-9)
        assert row["steps"] == 8 and row["collectives"] > 0 and row["wire_bytes"] > 0
    assert cli(["timeline", str(d), "--width", "200"]) == 0
    tl_out = capsys.readouterr().out
    for out in (demo_out, tl_out):  # the demo prints the viewer's summary; both show the same shares
        assert "per-rank totals over its steps" in out
        for r, share in expected.items():
            row = next(line for line in out.splitlines() if line.startswith(f"│ {r} "))
            assert f"{100 * share:.1f}%" in row.split("│")[9]
    assert "powersgd" in demo_out and "PowerSGD round 1" in tl_out
    # one source of truth: the demo's table (and JSON) shows each compressor's traced steps as the report
    # computes them; the hook's own count of wire bytes (its communicator's Traffic counters) and the
    # trace's (the recorder's collective spans) are two separate paths that agree to the byte
    rows = json.loads((tmp_path / "demo.json").read_text())["rows"]
    for row in rows:
        f = rep["by_label"][row["compressor"]]
        assert row["figures_from"] == "trace"
        assert row["step_ms"] == f["step_ms_median"] and row["bytes_per_step"] == f["wire_bytes_per_step"]
        assert row["hook_bytes_per_step"] == row["bytes_per_step"] > 0
        # the demo's own timer over all its timed steps against the traced steps' median: the same
        # quantity in the same unit (noise on a shared machine allows a wide band, not a unit slip)
        assert 0.2 < row["timer_step_ms"] / row["step_ms"] < 5
        table_row = next(line for line in demo_out.splitlines() if line.startswith(f"│ {row['compressor']} "))
        label_row = next(line for line in demo_out.splitlines()[::-1] if line.startswith(f"│ {row['compressor']} "))
        assert f"{row['step_ms']:.2f}" in table_row and f"{row['step_ms']:.3f}" in label_row
        assert fmt_bytes(row["bytes_per_step"]) in table_row and fmt_bytes(row["bytes_per_step"]) in label_row
    none, psgd = rows
    assert none["bytes_per_step"] == none["payload_bytes_per_step"]  # 2 ranks: an all-reduce sends its payload
    assert psgd["ratio"] == pytest.approx(none["payload_bytes_per_step"] / psgd["payload_bytes_per_step"], rel=1e-3)
