"""What the DDP integrations share: the compression a user gives, made a hook state, and the hook registered on the
framework's DDP model, with a typed error where the framework did not make one."""

from __future__ import annotations

import os
import warnings

import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from ..compression import Compressor
from ..errors import ArgumentTypeError, InvalidArgumentError
from ..parallel import CompressionHookState, compression_hook


def as_state(compression: object, what: str) -> CompressionHookState:
    """``compression`` as a hook state: a :class:`CompressionHookState` as given, or a compressor or its name made into
    one with its defaults."""
    if isinstance(compression, CompressionHookState):
        return compression
    if compression is None or not isinstance(compression, (str, Compressor)):
        raise ArgumentTypeError(
            f'{what}: compression must be a CompressionHookState, a Compressor or a compressor\'s name ("int8", '
            f'"powersgd:4", "auto"), got {type(compression).__name__}'
        )
    return CompressionHookState(compressor=compression)


def check_restore(restore: object, what: str) -> bool:
    if not isinstance(restore, bool):
        raise ArgumentTypeError(f"{what}: restore must be a bool, got {type(restore).__name__}")
    return restore


def register(model: nn.Module, state: CompressionHookState, what: str, launch: str) -> bool:
    """Register torsh's hook on ``model``, the framework's DDP model, and return True. A job of one process, where the
    framework makes no DDP (Accelerate, the Trainer), has no gradient to send: a warning says so and False is
    returned. Anything else without DDP (FSDP, DeepSpeed, ranks started without a process group) is a typed error;
    ``launch`` says how to get DDP."""
    if not isinstance(model, DistributedDataParallel):
        if dist.is_available() and dist.is_initialized():
            alone = dist.get_world_size() == 1
        else:
            alone = int(os.environ.get("WORLD_SIZE", "1")) <= 1
        if alone:
            warnings.warn(
                f"{what}: one process, so the framework made no DDP model and there are no gradients to exchange: "
                f"torsh's compression hook is not installed (its state is still checkpointed). With more ranks: "
                f"{launch}",
                stacklevel=3,
            )
            return False
        raise InvalidArgumentError(
            f"{what}: the prepared model is a {type(model).__name__}, not DistributedDataParallel, so there is no DDP "
            f"to carry torsh's compression hook: {launch}"
        )
    model.register_comm_hook(state, compression_hook)
    return True
