"""The issue-43 benchmark cases: ``torsh bench moe --ep-lm`` (a small MoE LM, bf16 vs fp8 dispatch) and
``torsh bench fsdp --fp8`` (torsh's fp8 weights/grads against torchao's float8 all-gather). Tiny sizes on
loopback: they check what the cases run and record, not how fast."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from torsh_kernels.apps.bench.moe_lm import MarkovText


def test_markov_text_follows_its_order_2_law():
    text = MarkovText(32, seed=3)
    t = text.batch(256, 200, seed=0)
    assert t.shape == (256, 200) and t.dtype == torch.long and int(t.min()) >= 0 and int(t.max()) < 32
    a, b, c = t[:, :-2].reshape(-1), t[:, 1:-1].reshape(-1), t[:, 2:].reshape(-1)
    # every next token is one of the 8 candidates of the last token; its rank among them is the Zipf law
    # rotated by the token before
    hit = text.candidates[b] == c.unsqueeze(1)
    assert bool(hit.any(1).all())
    rank = (hit.float().argmax(1) - a % 8) % 8
    freq = torch.bincount(rank, minlength=8).double() / rank.numel()
    assert torch.allclose(freq, text.zipf, atol=0.01)
    assert text.entropy_rate == pytest.approx(float(-(text.zipf * text.zipf.log()).sum()))
    assert 1.4 < text.entropy_rate < math.log(8)
    assert torch.equal(text.batch(4, 10, seed=1), text.batch(4, 10, seed=1))  # a seed names a batch


@pytest.mark.slow  # two ranks in subprocesses
def test_bench_moe_ep_lm_trains_every_wire_on_the_same_data(tmp_path):
    out = tmp_path / "lm.json"
    r = subprocess.run([sys.executable, "-m", "torsh_kernels.apps.cli", "bench", "moe", "--ep-lm", "--lm-steps", "6",
                        "--lm-hidden", "128", "--lm-ffn", "32", "--lm-batch", "2", "--lm-seq", "16", "--lm-vocab",
                        "32", "--lm-wires", "bf16,fp8,none", "--json", str(out)],
                       capture_output=True, text=True, timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr
    data = json.loads(out.read_text())
    assert data["suite"] == "moe-ep-lm" and data["config"]["world_size"] == 2
    rows = {row["wire"]: row for row in data["rows"]}
    assert list(rows) == ["bf16", "fp8", "none"]
    for row in rows.values():
        assert len(row["losses"]) == 6 and all(math.isfinite(v) for v in row["losses"])
        assert abs(row["losses"][0] - math.log(32)) < 0.5  # the same initial model: about uniform over 32
        assert math.isfinite(row["held_out_loss"]) and row["step_ms"] > 0
    # the same weights and tokens: the first step's loss differs only by the forward's wire rounding
    assert abs(rows["fp8"]["losses"][0] - rows["bf16"]["losses"][0]) < 0.05
    assert rows["bf16"]["final_loss_vs_bf16"] == 0.0
    # packed e4m3 rows (128 codes + one fp32 scale) against bf16 rows (256 bytes) and fp32 rows (512)
    assert rows["fp8"]["moe_bytes_per_step"] < rows["bf16"]["moe_bytes_per_step"] < rows["none"]["moe_bytes_per_step"]
    assert "last-token-only floor" in r.stdout


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
