"""`torsh report` with one outlier step (issue 42, item 2): 21 steps of 22 ms (20 ms compute, 1 ms
compression, 1 ms unrecorded) and one of 56.9 s spent compressing. Summed over the steps, the outlier decides
every share ("Compression takes 99.9% of the step"); the report flags it, lists it and leaves it out, so the
shares are those of the 21 ordinary steps."""

from __future__ import annotations

import json

import pytest

from tests.profiling.trace_fixtures import _x
from torsh_kernels.apps.cli import main
from torsh_kernels.profiling import report as R
from torsh_kernels.profiling.traces import load

OUTLIER = 7  # the step number of the 56.9 s step


def _trace(path, steps: int = 22, outlier_ms: float | None = 56_900.0, label: str | None = None):
    ev = [{"ph": "M", "name": "process_name", "pid": 0, "tid": 0, "args": {"name": "rank 0"}},
          {"ph": "M", "name": "thread_name", "pid": 0, "tid": 1, "args": {"name": "main"}}]  # fmt: skip
    t = 0.0
    for k in range(steps):
        comp = outlier_ms - 21.0 if (k == OUTLIER and outlier_ms) else 1.0
        dur = 20.0 + comp + 1.0
        args = {"step": k} | ({"label": label} if label else {})
        ev.append(_x(f"step {k}", "step", t, t + dur, 1, 0.0, 0, **args))
        ev.append(_x("forward", "user", t, t + 20, 1, 0.0, 0))
        ev.append(_x("TopK round 1", "compression", t + 20, t + 20 + comp, 1, 0.0, 0, compressor="TopK"))
        t += dur
    doc = {"traceEvents": ev, "displayTimeUnit": "ms",
           "otherData": {"schema": "torsh-trace/1", "rank": 0, "world_size": 1, "device": "test", "versions": {},
                         "clock": {"base_unix_us": 1_700_000_000_000_000}}}  # fmt: skip
    path.write_text(json.dumps(doc))
    return path


def test_outlier_step_is_flagged_and_left_out_of_the_shares(tmp_path):
    rep = R.build(load(_trace(tmp_path / "t.json")))
    (o,) = rep["outliers"]["steps"]
    assert o["step"] == OUTLIER and o["ms"] == pytest.approx(56_900.0) and o["median_ms"] == pytest.approx(22.0)
    assert rep["outliers"]["excluded"]
    s = rep["summary"]
    assert s["compression_share"] == pytest.approx(1 / 22)  # the ordinary steps' share, not 99.9%
    assert s["step_ms_median"] == pytest.approx(22.0) and s["steps_per_rank"] == 21
    assert rep["ranks"][0]["window_ms"] == pytest.approx(21 * 22.0)
    assert not [g for g in rep["suggestions"] if g["id"] == "compression"]  # 4.5% is below the 15% threshold


def test_outlier_in_labelled_steps_and_the_printed_line(tmp_path, capsys):
    path = _trace(tmp_path / "t.json", label="topk")
    rep = R.build(load(path))
    assert rep["by_label"]["topk"]["compression"] == pytest.approx(1 / 22)
    assert rep["by_label"]["topk"]["step_ms_mean"] == pytest.approx(22.0)
    assert main(["report", str(path), "--width", "300"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "1 outlier step(s) excluded from every figure of this report" in out
    assert f"rank 0 step {OUTLIER} (topk): 5.69e+04 ms (median 22 ms" in out
    assert "Compression takes" not in out


def test_no_outlier_without_one_and_step_reports_it(tmp_path):
    """Steps of one length: nothing flagged; `--step N` reports on the outlier itself."""
    assert R.build(load(_trace(tmp_path / "a.json", outlier_ms=None)))["outliers"]["steps"] == []
    rep = R.build(load(_trace(tmp_path / "b.json")), step=OUTLIER)
    assert rep["outliers"]["steps"] == [] and rep["summary"]["compression_share"] > 0.99


def test_a_mode_of_slow_steps_is_not_outliers(tmp_path):
    """Every fourth step twice as long (gradient accumulation's synchronising steps): a mode, kept."""
    path = tmp_path / "m.json"
    _trace(path, steps=20, outlier_ms=None)
    doc = json.loads(path.read_text())
    for ev in doc["traceEvents"]:
        if ev.get("cat") == "step" and ev["args"]["step"] % 4 == 3:
            ev["dur"] *= 3
    path.write_text(json.dumps(doc))
    assert R.build(load(path))["outliers"]["steps"] == []
