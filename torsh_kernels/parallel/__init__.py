"""Layer 3: where models, optimizers and communicators meet. DDP comm hooks that compress gradients
(:func:`compression_hook`), the same compression and bucketing without DDP
(:class:`GradientSynchronizer`)."""

from __future__ import annotations

from .hooks import CompressionHookState, HookStats, compression_hook
from .synchronizer import GradientConsistency, GradientSynchronizer

__all__ = ["CompressionHookState", "GradientConsistency", "GradientSynchronizer", "HookStats", "compression_hook"]
