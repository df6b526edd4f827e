"""Layer 4: where models, optimizers and communicators meet. DDP comm hooks that compress gradients
(:func:`compression_hook`), the same compression and bucketing without DDP
(:class:`GradientSynchronizer`), mixture-of-experts layers on one process and expert-parallel
(:class:`MoELayer`, :class:`ExpertParallelMoE`, DeepSeek-V3's aux-loss-free :class:`BiasBalancer`), offload,
and FSDP2 with quantized communication
(:func:`apply_quantized_comm`, :func:`reset_residuals` for a model built on the meta device,
:mod:`torsh_kernels.parallel.fsdp`, imported on first use: importing FSDP2 takes about a second)."""

from __future__ import annotations

from .auto_follow import FollowSpec
from .buckets import BucketSpec
from .fsdp_format import QuantizedCommSpec
from .hooks import CompressionHookState, HookStats, compression_hook
from .moe import ExpertParallelMoE, MoELayer
from .moe_balance import BiasBalancer
from .moe_spec import MoESpec
from .moe_wire import ExpertWireSpec
from .offload_optimizer import OffloadedOptimizer
from .offload_params import ParameterOffloader
from .synchronizer import GradientConsistency, GradientSynchronizer, SyncStats

__all__ = [
    "BiasBalancer",
    "BucketSpec",
    "CompressionHookState",
    "ExpertParallelMoE",
    "ExpertWireSpec",
    "FollowSpec",
    "GradientConsistency",
    "GradientSynchronizer",
    "HookStats",
    "MoELayer",
    "MoESpec",
    "OffloadedOptimizer",
    "ParameterOffloader",
    "QuantizedAllGather",
    "QuantizedCommSpec",
    "QuantizedReduceScatter",
    "SyncStats",
    "apply_quantized_comm",
    "compression_hook",
    "reset_residuals",
]

_FSDP = {"QuantizedAllGather", "QuantizedReduceScatter", "apply_quantized_comm", "reset_residuals"}


def __getattr__(name: str):
    if name in _FSDP:
        from . import fsdp

        return getattr(fsdp, name)
    raise AttributeError(f"module 'torsh_kernels.parallel' has no attribute {name!r}")
