"""``torsh bench fsdp --fp8`` (issue 43: torsh's fp8 weights/grads against torchao's float8 all-gather). Tiny
sizes on loopback: what the cases run and record, not how fast."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest


@pytest.mark.slow  # a training run in subprocesses
def test_bench_fsdp_fp8_runs_against_torchao_or_says_why_not(tmp_path):
    out = tmp_path / "fsdp.json"
    r = subprocess.run([sys.executable, "-m", "torsh_kernels.apps.cli", "bench", "fsdp", "--fp8", "--width", "128",
                        "--layers", "2", "--steps", "2", "--warmup", "1", "--json", str(out)],
                       capture_output=True, text=True, timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr
    data = json.loads(out.read_text())
    s = {row["case"]: row for row in data["summary"]}
    try:
        import torchao.float8  # noqa: F401

        assert list(s) == ["plain", "fp8 weights", "fp8 weights + fp8 grads", "torchao float8 all-gather"]
        assert not data["skipped"]
        # torchao all-gathers e4m3 weights too (one scale per tensor); the biases and reduce-scatter stay fp32
        assert 0.5 < s["torchao float8 all-gather"]["bytes_vs_plain"]["median"] < 0.52
    except ImportError:
        assert list(s) == ["plain", "fp8 weights", "fp8 weights + fp8 grads"]
        assert "not installed" in data["skipped"]["torchao float8 all-gather"]
    # 2 layers of 128 x 128 + 128, two all-gathers and a reduce-scatter a step: fp8 weights are 1 byte and a
    # 4-byte scale per 128 elements (a quarter of fp32 and a little), the reduce-scatter fp32
    assert 0.5 < s["fp8 weights"]["bytes_vs_plain"]["median"] < 0.53
    assert 0.25 < s["fp8 weights + fp8 grads"]["bytes_vs_plain"]["median"] < 0.28
    for row in data["rows"]:
        assert row["steps_trained"] == 3 and math.isfinite(row["held_out_loss"])
    assert "held-out loss" in r.stdout
