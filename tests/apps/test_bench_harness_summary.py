"""`interleaved_summary`, the one summary of interleaved runs the benchmark scripts share: per case the median
[min-max] and n of the per-run figures, and the per-run paired speedup over a baseline case. The runs are made
by hand and every expected figure is worked out by hand in the comments."""

from __future__ import annotations

import pytest

from torsh_kernels.apps.bench.ddp_report import fmt_spread
from torsh_kernels.apps.bench.harness import interleaved_summary, run_spread
from torsh_kernels.errors import InvalidArgumentError

RUNS = [
    {"base": [10.0, 12.0, 8.0], "a": 8.0, "b": [20.0, 20.0]},  # figures: base 10 (median), a 8, b 20
    {"b": 24.0, "a": [16.0, 15.0, 17.0], "base": 12.0},  # base 12, a 16 (median), b 24; another order
    {"base": 9.0, "b": 36.0},  # a missing from this run
    {"a": 4.0, "b": 2.0, "c": 5.0},  # the baseline missing: no ratio from this run; c only here
]


def test_medians_ranges_and_paired_speedups_by_hand():
    s = interleaved_summary(RUNS, "base")
    assert list(s) == ["base", "a", "b", "c"]  # the order of first appearance
    # base: 10, 12, 9 -> median 10 [9-12], 3 runs; against itself 1 in each of its runs
    assert s["base"]["figure"] == {"median": 10.0, "min": 9.0, "max": 12.0, "n": 3}
    assert s["base"]["runs"] == [10.0, 12.0, 9.0, None]
    assert s["base"]["speedup_vs_baseline"] == {"median": 1.0, "min": 1.0, "max": 1.0, "n": 3}
    # a: 8, 16, -, 4 -> sorted 4, 8, 16: median 8 [4-16], 3 runs; paired only in runs 0 and 1 (run 2 lacks a,
    # run 3 the baseline): 10/8 = 1.25 and 12/16 = 0.75 -> median 1.0 [0.75-1.25], 2 runs
    assert s["a"]["figure"] == {"median": 8.0, "min": 4.0, "max": 16.0, "n": 3}
    assert s["a"]["runs"] == [8.0, 16.0, None, 4.0]
    assert s["a"]["speedup_vs_baseline"] == {"median": 1.0, "min": 0.75, "max": 1.25, "n": 2}
    # b: 20, 24, 36, 2 -> median (20 + 24) / 2 = 22 [2-36], 4 runs; paired in runs 0-2: 10/20 = 0.5,
    # 12/24 = 0.5, 9/36 = 0.25 -> median 0.5 [0.25-0.5], 3 runs
    assert s["b"]["figure"] == {"median": 22.0, "min": 2.0, "max": 36.0, "n": 4}
    assert s["b"]["speedup_vs_baseline"] == {"median": 0.5, "min": 0.25, "max": 0.5, "n": 3}
    # c: only in the run without the baseline: its figure, no speedup
    assert s["c"]["figure"] == {"median": 5.0, "min": 5.0, "max": 5.0, "n": 1}
    assert s["c"]["runs"] == [None, None, None, 5.0]
    assert s["c"]["speedup_vs_baseline"] is None
    assert fmt_spread(s["a"]["speedup_vs_baseline"], 3) == "1.000 [0.750-1.250]"
    assert fmt_spread(s["c"]["figure"], 1) == "5.0"  # one run: the median alone


def test_none_is_a_missing_case_and_run_spread_skips_none():
    s = interleaved_summary([{"base": 2.0, "a": None}, {"base": 4.0, "a": 1.0}], "base")
    # a only in run 1: 4/1 = 4
    assert s["a"]["runs"] == [None, 1.0]
    assert s["a"]["speedup_vs_baseline"] == {"median": 4.0, "min": 4.0, "max": 4.0, "n": 1}
    assert run_spread([None, 3.0, 1.0]) == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 2}
    assert run_spread([None]) is None


@pytest.mark.parametrize(
    ("runs", "baseline", "match"),
    [
        ([{"a": 1.0}], "base", "no run has the baseline 'base'"),
        ([{"base": 1.0, "a": []}], "base", "'a' has no step times"),
        ([{"base": 1.0, "a": 0.0}], "base", "'a': 0.0 is not a figure > 0"),
        ([{"base": float("nan")}], "base", "is not a figure > 0"),
        ([{"base": True}], "base", "is not a figure > 0"),
    ],
)
def test_bad_input_is_typed(runs, baseline, match):
    with pytest.raises(InvalidArgumentError, match=match):
        interleaved_summary(runs, baseline)
