"""`torsh bench moe`'s full-layer cases: torsh's MoELayer against Hugging Face's blocks on the same weights and
tokens (the same math checked before timing, a layer that differs refused), the sizes and widths they use, and
the harness's full runs asking for the target size."""

from __future__ import annotations

import json

import pytest
import torch

from torsh_kernels.apps import cli
from torsh_kernels.apps.bench import harness
from torsh_kernels.apps.bench import moe as bench_moe
from torsh_kernels.apps.cli import main

pytest.importorskip("transformers")

SMALL = ["bench", "moe", "--device", "cpu", "--providers", "torch", "--tokens", "33", "--hidden", "16", "--experts",
         "4", "--reps", "1", "--layer-tokens", "40", "--layer-hidden", "16", "--layer-reps", "1"]  # fmt: skip


def test_layer_cases_check_the_same_math_then_time_ours_and_hf_side_by_side(tmp_path, capsys):
    out = tmp_path / "moe.json"
    assert main([*SMALL, "--profile-layer", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    for needle in ("layer mixtral: T=40 H=16 E=4 k=2 width=56 float32", "torsh MoELayer",
                   "HF MixtralSparseMoeBlock (eager experts)", "HF MixtralSparseMoeBlock (grouped_mm experts)",
                   "layer deepseek-v3", "HF DeepseekV3MoE (eager experts)", "vs HF eager", "tokens/s",
                   "torsh MoELayer by phase", "bwd experts: GEMMs alone"):  # fmt: skip
        assert needle in text, needle
    doc = json.loads(out.read_text())
    layer = [r for r in doc["results"] if r["op"].startswith("layer")]
    assert doc["config"]["layer"]["tokens"] == 40 and doc["config"]["layer"]["dtype"] == "fp32"
    assert len(doc["config"]["layer"]["load_average_before_after"]) == 2
    mixtral = {r["impl"]: r for r in layer if r["extra"]["block"] == "mixtral"}
    ours = mixtral["torsh MoELayer"]
    assert ours["kind"] == "ours" and ours["extra"]["expert_width"] == 56  # 3.5 x 16
    # the model's size in parameters (the router's [E, H], gate_up [E, 2F, H], down [E, H, F]) and gradient bytes
    assert ours["extra"]["parameters"] == 4 * 16 + 4 * 2 * 56 * 16 + 4 * 16 * 56
    assert ours["extra"]["gradient_bytes"] == 4 * ours["extra"]["parameters"]
    errs = ours["extra"]["max_rel_error"]
    assert set(errs) == {"y", "grad x", "grad gate.weight", "grad experts.gate_up_proj", "grad experts.down_proj"}
    assert all(0 <= e <= 1e-4 for e in errs.values())
    eager = mixtral["HF MixtralSparseMoeBlock (eager experts)"]["timing"]["median_ms"]
    grouped = next(r for k, r in mixtral.items() if k.startswith("HF MixtralSparseMoeBlock (grouped_mm experts)"))
    grouped = grouped["timing"]["median_ms"]
    # the fastest peer's ratio (it was the eager block's, the slow non-default one)
    assert ours["speedup_vs_best_peer"] == pytest.approx(min(eager, grouped) / ours["timing"]["median_ms"])
    for key in ("speedup_vs_hf_eager", "speedup_vs_hf_grouped_mm"):
        q = ours["extra"][key]
        assert q["low"] <= q["median"] <= q["high"]
    for r in layer:
        assert r["timing"]["median_ms"] > 0 and r["extra"]["tokens_per_s"] > 0 and r["extra"]["gflops"] > 0
    prof = ours["extra"]["profile_ms"]
    assert {"fwd moe_route", "bwd experts", "whole step (fwd+bwd)"} <= set(prof) and all(v > 0 for v in prof.values())
    deepseek = {r["impl"]: r for r in layer if r["extra"]["block"] == "deepseek-v3"}
    assert {r["extra"]["n_group"] for r in deepseek.values()} == {2}
    ours = deepseek["torsh MoELayer"]
    mode = ours["extra"]["expert_compute"]
    assert ours["kind"] == "ours" and (mode == "grouped" or mode.startswith("loop"))
    errs = ours["extra"]["max_rel_error"]  # the shared MLP's three weights too, through from_hf's mapping
    assert {"grad shared_experts.gate_proj.weight", "grad shared_experts.up_proj.weight",
            "grad shared_experts.down_proj.weight", "grad gate.weight"} <= set(errs)  # fmt: skip
    assert all(0 <= e <= 1e-4 for e in errs.values())
    assert {"fwd shared experts", "bwd shared experts"} <= set(ours["extra"]["profile_ms"])


@pytest.mark.parametrize("where", ["output", "gradient"])
def test_a_layer_that_differs_from_the_hf_block_is_not_timed(monkeypatch, where):
    """A port off by 1% in one weight (the output differs) or one weight's gradient off by 1% (the output is
    the same) stops the bench before timing, naming what differs."""
    port = bench_moe.torsh_layer

    def off(kind, block):
        made = port(kind, block)
        if made is not None:
            layer = made[0]
            if where == "output":
                with torch.no_grad():
                    layer.w_out.mul_(1.01)
            else:
                layer.w_in.register_hook(lambda g: g * 1.01)
        return made

    monkeypatch.setattr(bench_moe, "torsh_layer", off)
    match = "in y" if where == "output" else "in grad experts.gate_up_proj"
    with pytest.raises(AssertionError, match=f"differs from the Hugging Face block {match}.*not timing"):
        main([*SMALL, "--blocks", "mixtral", "--no-hf-grouped-mm"])


def test_expert_widths_and_deepseek_groups():
    assert bench_moe.expert_width(1024, 8) == 3584 and bench_moe.expert_width(1024, 64) == 512
    assert bench_moe.expert_width(1, 64) == 1
    assert bench_moe.deepseek_groups(64, 2) == (8, 4)  # DeepSeek-V3's 8 groups, 4 kept
    assert bench_moe.deepseek_groups(8, 2) == (4, 2)  # 2 experts per group at least
    assert bench_moe.deepseek_groups(6, 2) == (2, 1)
    assert bench_moe.deepseek_groups(6, 4) == (1, 1)  # one kept group of 3 cannot hold k=4
    assert bench_moe.deepseek_groups(3, 2) == (1, 1)


def test_harness_full_runs_ask_for_the_target_layer_size():
    for argv, full in ((["moe", "--device", "cpu"], False), (["moe", "--device", "cpu", "--full"], True)):
        args = cli.harness_parser().parse_args(argv)
        ((name, _, ns),) = harness._plan(args, None)
        assert name == "moe" and ns.layer_full is full and ns.blocks == ["mixtral", "deepseek-v3"]
    ns = cli.harness_parser().parse_args(["moe", "--device", "cpu"])
    ns.args = [("moe", ["--blocks", "none"])]
    assert harness._plan(ns, None)[0][2].blocks == []
