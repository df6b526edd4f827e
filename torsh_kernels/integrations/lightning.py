"""PyTorch Lightning: :class:`CompressedDDPStrategy`, Lightning's ``DDPStrategy`` with torsh's compression hook.

Lightning's own ``DDPStrategy(ddp_comm_hook=, ddp_comm_state=)`` registers a hook only when the device is CUDA (on
the CPU it says nothing and DDP reduces uncompressed), and its checkpoints leave the hook's state out (a resume
restarts error feedback from zero). This strategy registers :func:`~torsh_kernels.parallel.compression_hook` on any
device, and saves and restores the hook's state with every checkpoint Lightning writes, one file per rank beside it
(``CKPT.torsh/rank{R}-of-{W}.pt``; :mod:`torsh_kernels.integrations.rank_state`), removed with it.

FSDP2 needs no glue: under Lightning's ``ModelParallelStrategy`` call
:func:`~torsh_kernels.parallel.apply_quantized_comm` in ``configure_model`` after ``fully_shard``; its residuals are
module buffers, so they travel in Lightning's distributed checkpoint (docs/integrations.md).

Imports Lightning (``lightning.pytorch``, or the standalone ``pytorch_lightning``) when imported.
"""

from __future__ import annotations

import os
from typing import Any

from ..compression import Compressor
from ..errors import InvalidArgumentError
from ..parallel import CompressionHookState
from . import rank_state
from ._ddp import as_state, check_restore, register

try:
    from lightning.pytorch.strategies import DDPStrategy
except ImportError:  # the standalone package
    from pytorch_lightning.strategies import DDPStrategy

SUFFIX = ".torsh"
"""The per-rank states of checkpoint ``CKPT`` are under ``CKPT + SUFFIX``."""

_THEIRS = ("ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper", "model_averaging_period")


def state_dir(checkpoint_path: str | os.PathLike) -> str:
    """Where the per-rank compression states of the Lightning checkpoint ``checkpoint_path`` are."""
    return os.fspath(checkpoint_path) + SUFFIX


class CompressedDDPStrategy(DDPStrategy):
    """Lightning's ``DDPStrategy`` whose DDP model reduces its gradients through torsh's compression hook.

    Args:
        compression: a :class:`~torsh_kernels.parallel.CompressionHookState` (its compressor, bucket settings,
            ``auto``, timeout: the spec of what the hook does), or a compressor or its name (``"int8"``,
            ``"topk:0.01"``, ``"powersgd:4"``, ``"auto"``; :mod:`torsh_kernels.compression.names`), which makes one
            with its defaults. The state is :attr:`compression`: its ``stats`` are the hook's figures.
        restore: whether a checkpoint loaded through this strategy (``trainer.fit(ckpt_path=...)``) restores the
            hook's state from the per-rank files saved with it (default). A checkpoint without them is a typed
            error; ``restore=False`` starts the hook's state afresh, on purpose.
        **kwargs: ``DDPStrategy``'s own arguments (``process_group_backend``, ``timeout``, ``start_method``, DDP's
            keyword arguments such as ``gradient_as_bucket_view`` or ``bucket_cap_mb``), except its comm-hook
            arguments, which this strategy sets.
    """

    def __init__(self, compression: CompressionHookState | Compressor | str, *, restore: bool = True,
                 **kwargs: Any) -> None:  # fmt: skip
        what = "CompressedDDPStrategy"
        given = [k for k in _THEIRS if k in kwargs]
        if given:
            raise InvalidArgumentError(
                f"{what}: {', '.join(given)} would replace torsh's hook; pass the compression (a CompressionHookState "
                "or a compressor) instead, or use Lightning's DDPStrategy for PyTorch's own hooks"
            )
        restore = check_restore(restore, what)
        compression = as_state(compression, what)
        super().__init__(**kwargs)
        self.compression = compression
        """The hook's state: ``compression.stats`` (per step in ``stats.per_iteration``), the compressor."""
        self.restore = restore

    def _register_ddp_hooks(self) -> None:
        # Lightning's own registers only when root_device.type == "cuda"; DDP hooks run on every backend
        register(
            self.model, self.compression, "CompressedDDPStrategy", "use a DDP launch (devices > 1 or num_nodes > 1)"
        )

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """Lightning's checkpoint (rank 0 writes it), then every rank's hook state beside it."""
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
        rank_state.save(self.compression, state_dir(filepath), what="CompressedDDPStrategy.save_checkpoint")

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Lightning's checkpoint, and (``restore``) this rank's hook state saved with it."""
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        if self.restore:
            rank_state.load(self.compression, state_dir(checkpoint_path), what="CompressedDDPStrategy.load_checkpoint")
        return checkpoint

    def remove_checkpoint(self, filepath: Any) -> None:
        """Lightning removes the checkpoint (rank 0); every rank removes its own hook state with it."""
        super().remove_checkpoint(filepath)
        rank_state.remove(state_dir(filepath))


__all__ = ["SUFFIX", "CompressedDDPStrategy", "state_dir"]
