"""The Hugging Face ``Trainer``: :func:`compress`, a ``TrainerCallback`` that registers torsh's compression hook on
the DDP model the Trainer prepares, and saves and restores the hook's state with the Trainer's checkpoints.

A callback is given the unwrapped model, not the DDP wrapper the Trainer makes in ``train()``, so :func:`compress`
binds the callback to its Trainer (``trainer.model_wrapped``). The state goes to ``checkpoint-N/torsh_compression/
rank{R}-of-{W}.pt``, one file per rank (:mod:`torsh_kernels.integrations.rank_state`), so the Trainer's rotation
(``save_total_limit``) removes it with its checkpoint. A resume (``trainer.train(resume_from_checkpoint=...)``) is
found from the step the Trainer resumed at: ``checkpoint-{step}`` under ``args.output_dir``, or
``args.resume_from_checkpoint``, or the ``resume_from`` given here; none holding the state is a typed error (unless
``restore=False``), so error feedback never restarts from zero unnoticed.

Imports ``transformers`` when imported.
"""

from __future__ import annotations

import os

from transformers import TrainerCallback

from ..compression import Compressor
from ..errors import ArgumentTypeError, FileAccessError
from ..parallel import CompressionHookState
from . import rank_state
from ._ddp import as_state, check_restore, register
from .accelerate import SUBDIR

LAUNCH = ("start the ranks with torchrun --nproc_per_node N train.py (the Trainer then runs DDP, gloo on the CPU), "
          "without FSDP or DeepSpeed in the TrainingArguments")  # fmt: skip


class CompressionCallback(TrainerCallback):
    """Registers torsh's hook on ``trainer.model_wrapped`` when training begins and keeps its state with every
    checkpoint; made by :func:`compress`. ``compression`` is the hook's state (``.stats``)."""

    def __init__(self, trainer, compression: CompressionHookState, restore: bool, resume_from: str | None) -> None:
        self.trainer = trainer
        self.compression = compression
        self.restore = restore
        self.resume_from = resume_from
        self._registered: int | None = None  # id of the DDP model the hook is on (train() prepares a new one each time)

    def on_train_begin(self, args, state, control, **kwargs):
        what = "torsh_kernels.integrations.hf_trainer"
        model = self.trainer.model_wrapped
        if self._registered != id(model):
            register(model, self.compression, what, LAUNCH)
            self._registered = id(model)
        if state.global_step > 0 and self.restore:
            self._restore(args, state.global_step, what)
        return control

    def _restore(self, args, step: int, what: str) -> None:
        places = [self.resume_from, getattr(args, "resume_from_checkpoint", None),
                  os.path.join(args.output_dir, f"checkpoint-{step}")]  # fmt: skip
        places = [p for p in places if isinstance(p, (str, os.PathLike))]
        for p in places:
            d = os.path.join(p, SUBDIR)
            if os.path.isdir(d):
                rank_state.load(self.compression, d, what=f"{what} (resuming at step {step})")
                return
        raise FileAccessError(
            f"{what}: the Trainer resumed at step {step}, and no torsh compression state was found in "
            f"{', '.join(str(p) for p in places)}: pass compress(..., resume_from=CHECKPOINT_DIR) where the "
            "checkpoint is elsewhere, or restore=False to start the hook's state afresh"
        )

    def on_save(self, args, state, control, **kwargs):
        ckpt = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        rank_state.save(self.compression, os.path.join(ckpt, SUBDIR), what="Trainer checkpoint (torsh)")
        return control


def compress(trainer, compression: CompressionHookState | Compressor | str, *, restore: bool = True,
             resume_from: str | os.PathLike | None = None) -> CompressionCallback:  # fmt: skip
    """Add to ``trainer`` (a ``transformers.Trainer``) the callback that compresses its DDP gradients through torsh's
    hook and checkpoints the hook's state; returns it (``callback.compression.stats``). Call before
    ``trainer.train()``, on every rank.

    ``compression``: a :class:`~torsh_kernels.parallel.CompressionHookState` or a compressor or its name. ``restore``:
    whether a resumed run restores the hook's state (default); ``resume_from``: the checkpoint folder to restore it
    from, where it is not ``args.output_dir/checkpoint-{step}``."""
    what = "torsh_kernels.integrations.hf_trainer.compress"
    if not callable(getattr(trainer, "add_callback", None)) or not hasattr(trainer, "model_wrapped"):
        raise ArgumentTypeError(f"{what}: trainer must be a transformers.Trainer, got {type(trainer).__name__}")
    if resume_from is not None and not isinstance(resume_from, (str, os.PathLike)):
        raise ArgumentTypeError(f"{what}: resume_from must be a path or None, got {type(resume_from).__name__}")
    cb = CompressionCallback(trainer, as_state(compression, what), check_restore(restore, what),
                             None if resume_from is None else os.fspath(resume_from))  # fmt: skip
    trainer.add_callback(cb)
    return cb


__all__ = ["LAUNCH", "CompressionCallback", "compress"]
