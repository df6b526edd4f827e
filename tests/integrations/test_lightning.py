"""PyTorch Lightning with torsh, on 2 gloo ranks under torchrun (tests/integrations/lightning_job.py): DDP with every
compressor through CompressedDDPStrategy against Lightning's own DDPStrategy, FSDP2 with quantized comms under
ModelParallelStrategy against its plain FSDP2, and resumes through Lightning's own checkpoints."""

from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("lightning")
pytest.importorskip("transformers")

from tests.integrations import gpt2
from tests.integrations.jobs import check_resume, check_trained_like

HERE = os.path.dirname(__file__)
COMPRESSORS = ["none", "fp16", "bf16", "int8", "int4", "topk:0.05", "sign", "powersgd:4", "auto"]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ddp(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("lightning-ddp"))
    gpt2.torchrun(os.path.join(HERE, "lightning_job.py"), "ddp", out, env={"TORSH_LIVE": os.path.join(out, "live")})
    return out, gpt2.read(out, "ddp"), gpt2.read(out, "ddp-ckpt")


def test_every_compressor_trains_like_lightnings_own_ddp(ddp):
    _, runs, _ = ddp
    for rank in runs:
        assert sorted(rank) == sorted(["lightning-ddp", *COMPRESSORS])
        for c in COMPRESSORS:
            check_trained_like(rank[c], rank["lightning-ddp"], c)
            s = rank[c]["stats"]
            assert s["iterations"] == 15 and s["buckets"] >= 15, (c, s)  # the hook ran at every step on the CPU
        # uncompressed through the hook is Lightning's DDP, step for step
        assert rank["none"]["losses"] == pytest.approx(rank["lightning-ddp"]["losses"], abs=1e-5)
        for c, ratio in (("fp16", 1.9), ("int8", 3.5), ("powersgd:4", 5.0)):
            s = rank[c]["stats"]
            assert s["bytes_before"] / s["bytes_after"] > ratio, (c, s)


def test_stats_and_live_metrics_are_reachable(ddp):
    out, runs, _ = ddp
    assert runs[0]["auto"]["stats"]["auto"]  # auto's choice, in the hook's stats
    for r in (0, 1):
        path = os.path.join(out, "live", f"rank{r}.jsonl")
        with open(path) as f:
            records = [json.loads(x) for x in f.read().splitlines()]
        # one record per step and rank from the DDP hook (source "ddp") while TORSH_LIVE is set: 15 steps per run
        assert {x["source"] for x in records} == {"ddp"} and len(records) >= 15 * len(COMPRESSORS)
        assert {x["compressor"] for x in records} >= {"int8", "none"}, {x["compressor"] for x in records}


def test_a_resume_through_lightnings_checkpoint_restores_the_hook_state(ddp):
    _, _, ck = ddp
    for rank in ck:
        for c in ("int8", "powersgd:4"):
            r = rank[c]
            check_resume(r, c)
            assert "epoch=0-step=5.ckpt.torsh" in r["files"]
            assert r["saved_iteration"] == 5 and r["resumed_iterations"] == 15
        # ModelCheckpoint(save_top_k=1) removed the older checkpoints and, on every rank, their states
        assert rank["rotated"] == ["epoch=2-step=15.ckpt", "epoch=2-step=15.ckpt.torsh"], rank["rotated"]
        # a checkpoint Lightning wrote without torsh: resuming through the strategy names the missing state
        assert rank["plain"].startswith("FileAccessError") and "restore=False" in rank["plain"], rank["plain"]


def test_fsdp2_with_quantized_comms_under_model_parallel_strategy(tmp_path):
    out = str(tmp_path)
    gpt2.torchrun(os.path.join(HERE, "lightning_job.py"), "fsdp", out)
    for rank in gpt2.read(out, "fsdp"):
        ref = rank["lightning-fsdp2"]
        for name in ("int8", "int4-grads"):
            check_trained_like(rank[name], ref, name)
            assert rank[name]["installed"] == 3  # the two blocks and the root
            assert rank[name]["bytes_sent"]["reduce_scatter"] > 0
        assert rank["int8"]["bytes_sent"]["all_gather"] > 0
        assert rank["int4-grads"]["bytes_sent"]["all_gather"] == 0  # weights=None: FSDP2's own all-gather
        # resumed through ModelParallelStrategy's distributed checkpoint: the residuals come back as saved
        plain, ours = rank["resume-lightning-fsdp2"], rank["resume-int8-grads"]
        assert ours["residuals"] == 3 and ours["residual_norm"] > 0
        assert ours["restored_vs_saved"] == 0.0
        assert plain["resumed_vs_full"] == 0.0 and ours["resumed_vs_full"] == 0.0, (ours, plain)  # bit for bit
