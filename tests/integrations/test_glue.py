"""The integrations' glue without a job: typed errors for what a user can get wrong, the per-rank state files, and
that importing torsh_kernels.integrations imports no framework."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from torsh_kernels.errors import ArgumentTypeError, FileAccessError, InvalidArgumentError
from torsh_kernels.integrations import rank_state
from torsh_kernels.parallel import CompressionHookState


def test_importing_the_package_imports_no_framework():
    code = ("import sys, torsh_kernels.integrations, torsh_kernels.integrations.rank_state\n"
            "print(sorted(m for m in ('lightning', 'pytorch_lightning', 'accelerate', 'transformers', 'torchtitan') "
            "if m in sys.modules))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_rank_state_round_trip_and_its_errors(tmp_path):
    state = CompressionHookState(compressor="int8", start_iter=3)
    p = rank_state.save(state, tmp_path / "s")
    assert p.name == "rank0-of-1.pt"
    again = CompressionHookState(compressor="int8", start_iter=3)
    rank_state.load(again, tmp_path / "s")
    assert again.state_dict().keys() == state.state_dict().keys()
    # another compressor's state is refused by the hook state itself, typed
    with pytest.raises(InvalidArgumentError):
        rank_state.load(CompressionHookState(compressor="powersgd:4"), tmp_path / "s")
    with pytest.raises(FileAccessError, match="no torsh state for rank 0 of 1"):
        rank_state.load(again, tmp_path / "missing")
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "rank0-of-1.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(FileAccessError, match="cannot be read"):
        rank_state.load(again, tmp_path / "junk")
    torch.save({"something": 1}, tmp_path / "junk" / "rank0-of-1.pt")
    with pytest.raises(FileAccessError, match="not a torsh per-rank state"):
        rank_state.load(again, tmp_path / "junk")
    with pytest.raises(ArgumentTypeError):
        rank_state.save(object(), tmp_path / "s")
    with pytest.raises(ArgumentTypeError):
        rank_state.save(state, 3)
    with pytest.raises(InvalidArgumentError, match="URL"):
        rank_state.save(state, "s3://bucket/ckpt")
    rank_state.remove(tmp_path / "s")
    assert not (tmp_path / "s").exists()


def test_lightning_strategy_refuses_what_would_replace_its_hook():
    pytest.importorskip("lightning")
    from torsh_kernels.integrations.lightning import CompressedDDPStrategy, state_dir

    s = CompressedDDPStrategy("powersgd:4", gradient_as_bucket_view=True)
    assert isinstance(s.compression, CompressionHookState) and s.restore is True
    given = CompressionHookState(compressor="int8")
    assert CompressedDDPStrategy(given).compression is given
    with pytest.raises(InvalidArgumentError, match="ddp_comm_hook"):
        CompressedDDPStrategy("int8", ddp_comm_hook=lambda s, b: None)
    with pytest.raises(ArgumentTypeError):
        CompressedDDPStrategy(None)
    with pytest.raises(ArgumentTypeError):
        CompressedDDPStrategy(8)
    with pytest.raises(ArgumentTypeError):
        CompressedDDPStrategy("int8", restore="yes")
    with pytest.raises(InvalidArgumentError):
        CompressedDDPStrategy("nonsense")  # the compressor's name is checked now, not at the first backward
    assert state_dir("a/epoch=0-step=5.ckpt") == "a/epoch=0-step=5.ckpt.torsh"


def test_accelerate_and_trainer_glue_refuse_a_model_without_ddp(monkeypatch):
    pytest.importorskip("accelerate")
    from torsh_kernels.integrations import accelerate as ta

    class FakeAccelerator:  # has the hooks' registration, so the model is what is checked
        def register_save_state_pre_hook(self, h): ...
        def register_load_state_pre_hook(self, h): ...

    monkeypatch.setenv("WORLD_SIZE", "1")  # one process: no DDP, nothing to exchange; said, not raised
    with pytest.warns(UserWarning, match="one process"):
        state = ta.compress(FakeAccelerator(), torch.nn.Linear(2, 2), "int8")
    assert isinstance(state, CompressionHookState)
    monkeypatch.setenv("WORLD_SIZE", "2")  # ranks without DDP (FSDP, DeepSpeed, no process group): refused
    with pytest.raises(InvalidArgumentError, match="torchrun"):
        ta.compress(FakeAccelerator(), torch.nn.Linear(2, 2), "int8")
    with pytest.raises(ArgumentTypeError, match="Accelerator"):
        ta.compress(object(), torch.nn.Linear(2, 2), "int8")
    with pytest.raises(ArgumentTypeError):
        ta.compress(FakeAccelerator(), torch.nn.Linear(2, 2), "int8", restore=1)
    pytest.importorskip("transformers")
    from torsh_kernels.integrations import hf_trainer

    with pytest.raises(ArgumentTypeError, match="Trainer"):
        hf_trainer.compress(object(), "int8")
