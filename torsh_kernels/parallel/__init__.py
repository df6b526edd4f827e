"""Layer 4: where models, optimizers and communicators meet. DDP comm hooks that compress gradients
(:func:`compression_hook`), the same compression and bucketing without DDP
(:class:`GradientSynchronizer`), mixture-of-experts layers on one process and expert-parallel
(:class:`MoELayer`, :class:`ExpertParallelMoE`)."""

from __future__ import annotations

from .hooks import CompressionHookState, HookStats, compression_hook
from .moe import ExpertParallelMoE, MoELayer
from .offload_optimizer import OffloadedOptimizer
from .offload_params import ParameterOffloader
from .synchronizer import GradientConsistency, GradientSynchronizer

__all__ = [
    "CompressionHookState",
    "ExpertParallelMoE",
    "GradientConsistency",
    "GradientSynchronizer",
    "HookStats",
    "MoELayer",
    "OffloadedOptimizer",
    "ParameterOffloader",
    "compression_hook",
]
