"""Hugging Face Accelerate: :func:`compress`, torsh's compression hook on the model ``accelerator.prepare`` returned,
with its state in every ``accelerator.save_state`` / ``load_state``.

Accelerate's own ``DistributedDataParallelKwargs(comm_hook=...)`` takes only PyTorch's built-in hook types, and
``accelerator.register_for_checkpointing(obj)`` writes one file from the main process, so on resume every rank
would load rank 0's error-feedback residuals (refused by the hook's state, which knows its rank). :func:`compress`
registers the hook on the prepared DDP model and adds a save and a load pre-hook to the accelerator, so each rank
writes and reads its own state in the checkpoint folder (``DIR/torsh_compression/rank{R}-of-{W}.pt``;
:mod:`torsh_kernels.integrations.rank_state`).

On the CPU, ``accelerate launch --cpu --num_processes 2`` starts one process (its multi-CPU launch is MPI's); start
the ranks with ``torchrun --nproc_per_node 2 train.py`` (Accelerate picks gloo and DDP from the environment).

Imports nothing of Accelerate: it works on the ``Accelerator`` it is given.
"""

from __future__ import annotations

import os

import torch.nn as nn

from ..compression import Compressor
from ..errors import ArgumentTypeError
from ..parallel import CompressionHookState
from . import rank_state
from ._ddp import as_state, check_restore, register

SUBDIR = "torsh_compression"
"""The per-rank hook states of an Accelerate checkpoint folder ``DIR`` are under ``DIR/SUBDIR``."""

LAUNCH = ("start the ranks with torchrun --nproc_per_node N (on the CPU, `accelerate launch --cpu --num_processes N` "
          "starts one process), and pass the model through accelerator.prepare without FSDP or DeepSpeed (for FSDP2, "
          "torsh's quantized comms: torsh_kernels.parallel.apply_quantized_comm)")  # fmt: skip


def compress(accelerator, model: nn.Module, compression: CompressionHookState | Compressor | str, *,
             restore: bool = True) -> CompressionHookState:  # fmt: skip
    """Register torsh's compression hook on ``model`` (what ``accelerator.prepare`` returned, a
    ``DistributedDataParallel``) and checkpoint the hook's state with ``accelerator.save_state`` /
    ``load_state``, one file per rank. Call it once per prepared model, on every rank, before training.

    ``compression``: a :class:`~torsh_kernels.parallel.CompressionHookState` or a compressor or its name (``"int8"``,
    ``"powersgd:4"``, ``"auto"``). ``restore``: whether ``load_state`` restores the hook's state (default; a checkpoint
    saved without it is then a typed error); False starts it afresh. Returns the hook's state (``.stats``)."""
    what = "torsh_kernels.integrations.accelerate.compress"
    state = as_state(compression, what)
    restore = check_restore(restore, what)
    for name in ("register_save_state_pre_hook", "register_load_state_pre_hook"):
        if not callable(getattr(accelerator, name, None)):
            raise ArgumentTypeError(
                f"{what}: accelerator must be an accelerate.Accelerator (it has no {name}), got "
                f"{type(accelerator).__name__}"
            )
    register(model, state, what, LAUNCH)

    def save(models, weights, output_dir) -> None:
        rank_state.save(state, os.path.join(output_dir, SUBDIR), what="accelerator.save_state (torsh)")

    def load(models, input_dir) -> None:
        if restore:
            rank_state.load(state, os.path.join(input_dir, SUBDIR), what="accelerator.load_state (torsh)")

    accelerator.register_save_state_pre_hook(save)
    accelerator.register_load_state_pre_hook(load)
    return state


__all__ = ["LAUNCH", "SUBDIR", "compress"]
