"""Hugging Face Accelerate and the Trainer with torsh, on 2 gloo ranks under torchrun (tests/integrations/hf_job.py):
torsh's hook on the prepared DDP model against the framework's own DDP, and resumes through the framework's own
checkpointing (``accelerator.save_state``/``load_state``; the Trainer's ``checkpoint-N`` folders)."""

from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

from tests.integrations import gpt2
from tests.integrations.jobs import check_resume, check_trained_like

HERE = os.path.dirname(__file__)
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def accelerate(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("accelerate"))
    gpt2.torchrun(os.path.join(HERE, "hf_job.py"), "accelerate", out)
    return gpt2.read(out, "accelerate")


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("trainer"))
    gpt2.torchrun(os.path.join(HERE, "hf_job.py"), "trainer", out, env={"TORSH_LIVE": os.path.join(out, "live")})
    return out, gpt2.read(out, "trainer")


def test_accelerate_trains_like_its_own_ddp_and_resumes_with_the_hook_state(accelerate):
    for rank in accelerate:
        for c in ("int8", "powersgd:4"):
            check_trained_like(rank[c], rank["accelerate-ddp"], c)
            assert rank[c]["bytes_before"] / rank[c]["wire_bytes"] > 3.0, rank[c]
            check_resume(rank[c], c)
            assert rank[c]["resumed_iteration"] == 15
    # Accelerate's own register_for_checkpointing writes rank 0's state only: rank 1 refuses it, typed
    assert accelerate[1]["register_for_checkpointing"].startswith("InvalidArgumentError"), accelerate[1]
    assert "saved by rank 0 of 2" in accelerate[1]["register_for_checkpointing"]


def test_the_trainer_trains_like_its_own_ddp_and_resumes_with_the_hook_state(trainer):
    out, ranks = trainer
    for rank in ranks:
        for c in ("int8", "powersgd:4"):
            check_trained_like(rank[c], rank["trainer-ddp"], c)
            assert rank[c]["checkpoints"] == ["checkpoint-10", "checkpoint-15", "checkpoint-5"]
            check_resume(rank[c], c)
            assert rank[c]["resumed_iteration"] == 15
            # the resumed run's log (steps 1-5 from the checkpoint's trainer_state.json, then its own) is the
            # uninterrupted run's
            assert rank[c]["resumed_losses"] == pytest.approx(rank[c]["full_losses"], abs=1e-6)
        assert rank["plain_checkpoint"].startswith("FileAccessError"), rank["plain_checkpoint"]
    with open(os.path.join(out, "live", "rank1.jsonl")) as f:
        records = [json.loads(x) for x in f.read().splitlines()]
    assert {r["source"] for r in records} == {"ddp"} and len(records) >= 2 * 15
